//! Defects of the hardening issue (#7) in the apply path, the lease changes and shutdown, each
//! reproduced against a real PostgreSQL with an in-process daemon.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;
use vantage::config::{Settings, WorkerSettings};
use vantage::daemon::{DaemonBuilder, RunningDaemon};
use vantage::internals::store::{InstanceInfo, StoreInternals as _};
use vantage::perspective::{ApplyError, ApplyTx, EventEnvelope, Perspective};
use vantage::store::{InstanceId, NewEvent, Store};

use crate::support::{self, Env};

async fn env() -> Env {
    Env::migrated().await
}

/// The suites' fast settings with `extra` TOML (perspectives) appended, then `tune`d: tests
/// that want one consumer loop (so a wedged loop shows) say so there.
fn settings(url: &str, extra: &str, tune: impl FnOnce(&mut WorkerSettings)) -> Settings {
    let mut s = support::fast_settings(url, extra);
    tune(&mut s.worker);
    s
}

/// A test daemon on the test's store, without HTTP.
fn daemon_on(env: &Env, s: Settings) -> DaemonBuilder {
    DaemonBuilder::new(s)
        .store(env.store.clone())
        .without_http()
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// Registers a perspective before the daemon starts, so events appended now fan out to it and
/// the daemon finds them all in its first claim.
async fn register(env: &Env, name: &str, types: &[&str]) {
    sqlx::query("SELECT register_perspective($1, $2)")
        .bind(name)
        .bind(types.iter().map(|t| t.to_string()).collect::<Vec<_>>())
        .execute(env.store.pool())
        .await
        .unwrap();
}

async fn append(env: &Env, stream: Uuid, types: &[&str]) {
    let events: Vec<NewEvent> = types
        .iter()
        .map(|t| NewEvent::new(*t, serde_json::json!({})))
        .collect();
    env.store
        .append_events(stream, None, &events)
        .await
        .unwrap();
}

/// Streams whose lanes sort first and last in a batch (lanes are ordered by stream id).
fn low_stream() -> Uuid {
    Uuid::from_u128(0x0000_0001_0000_0000_0000_0000_0000_0001)
}
fn high_stream() -> Uuid {
    Uuid::from_u128(0xffff_fff0_0000_0000_0000_0000_0000_0001)
}

async fn shutdown_within(daemon: RunningDaemon, limit: Duration) -> Duration {
    let started = Instant::now();
    match tokio::time::timeout(limit, daemon.shutdown()).await {
        Ok(result) => result.unwrap(),
        Err(_) => panic!("shutdown still running after {limit:?}"),
    }
    started.elapsed()
}

fn metric_value(name: &str, labels: &[(&str, &str)]) -> f64 {
    vantage::internals::telemetry::recorder::render()
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Polls [`metric_value`] until it reaches `at_least`, returning what it read then; panics
/// after `limit` (a liveness bound). Counters move after the commit they count, so a test that
/// saw the commit waits for the counter too instead of reading it once.
async fn wait_for_metric(
    name: &str,
    labels: &[(&str, &str)],
    at_least: f64,
    limit: Duration,
) -> f64 {
    let started = Instant::now();
    loop {
        let value = metric_value(name, labels);
        if value >= at_least {
            return value;
        }
        assert!(
            started.elapsed() < limit,
            "{name}{labels:?} still {value} after {limit:?} (waiting for {at_least})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const RAISE_CODE: &str =
    "CREATE FUNCTION raise_code(code text) RETURNS void LANGUAGE plpgsql AS $$ \
     BEGIN RAISE EXCEPTION 'raised on purpose with SQLSTATE %', code USING ERRCODE = code; END $$";

/// Defect 3 (and 7): a batch whose statement hangs on the server, with a row lock held by its
/// transaction, must not make shutdown hang past the grace. The server-side work is cancelled,
/// nothing of ours stays locked or leased, and rows whose handler had started are not refunded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_cancels_a_hung_statement_and_does_not_refund_started_rows() {
    let env = env().await;
    // The failing lane comes first: its failure is recorded in the batch's transaction (a row
    // lock), then the second lane's statement hangs.
    register(&env, "hang", &["Fail", "Hang"]).await;
    append(&env, low_stream(), &["Fail"]).await;
    append(&env, high_stream(), &["Hang"]).await;
    let perspective = r#"
[[perspectives]]
name = "hang"
events = ["Fail", "Hang"]
[perspectives.sql]
Fail = "SELECT 1/0"
Hang = "SELECT pg_sleep(600)"
"#;
    let s = settings(&env.url, perspective, |w| {
        w.consumers = 1;
        w.lease = secs(120);
        w.apply_timeout = secs(100);
        w.shutdown_grace = secs(1);
    });
    let daemon = daemon_on(&env, s).start().await.unwrap();
    let instance = daemon.instance_id();
    env.wait_until("SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(600)' AND state = 'active'",
        1,
        Duration::from_secs(30),
    )
    .await;
    let took = shutdown_within(daemon, Duration::from_secs(20)).await;
    eprintln!("hung statement: shutdown took {took:?} with a 1 s grace");
    assert!(
        took < Duration::from_secs(1) + Duration::from_secs(6),
        "shutdown took {took:?} with a 1 s grace"
    );
    // The statement was cancelled on the server, not left running.
    env.wait_until("SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(600)' AND state = 'active'",
        0,
        Duration::from_secs(3),
    )
    .await;
    let rows: Vec<(Uuid, Option<Uuid>, i32)> = sqlx::query_as(
        "SELECT stream_id, instance_id, attempts FROM wh_perspective_events ORDER BY stream_id",
    )
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for (stream, holder, attempts) in rows {
        assert_eq!(holder, None, "stream {stream}: lease left behind");
        assert_eq!(
            attempts, 1,
            "stream {stream}: its handler had started, so its claim is not refunded"
        );
    }
    let registered: i64 =
        sqlx::query_scalar("SELECT count(*) FROM wh_service_instances WHERE instance_id = $1")
            .bind(instance.0)
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    assert_eq!(registered, 0, "deregistered");
}

/// A Rust handler that never returns.
struct Forever;

#[async_trait]
impl Perspective for Forever {
    fn name(&self) -> &str {
        "forever"
    }
    fn event_types(&self) -> Vec<String> {
        vec!["HangR".into(), "OkR".into()]
    }
    async fn apply(&self, e: &EventEnvelope, tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        if e.event_type == "HangR" {
            std::future::pending::<()>().await;
        }
        sqlx::query("INSERT INTO rust_applied (stream_id) VALUES ($1)")
            .bind(e.stream_id)
            .execute(tx.connection()?)
            .await
            .map_err(ApplyError::from_sqlx)?;
        Ok(())
    }
}

/// Defect 4: a hung handler (a SQL statement, or Rust code that never returns) times out after
/// `worker.apply_timeout`, is charged like any other failure and ends dead-lettered; it never
/// holds its lane and its consumer loop (the only one) forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_handler_times_out_is_charged_and_does_not_wedge_its_loop() {
    let env = env().await;
    env.exec(
        "CREATE TABLE sql_applied (stream_id uuid PRIMARY KEY); \
         CREATE TABLE rust_applied (stream_id uuid PRIMARY KEY)",
    )
    .await;
    register(&env, "slow_sql", &["Hang", "Ok"]).await;
    register(&env, "forever", &["HangR", "OkR"]).await;
    append(&env, low_stream(), &["Hang", "HangR"]).await;
    for _ in 0..5 {
        append(&env, Uuid::new_v4(), &["Ok", "OkR"]).await;
    }
    let perspective = r#"
[[perspectives]]
name = "slow_sql"
events = ["Hang", "Ok"]
[perspectives.sql]
Hang = "SELECT pg_sleep(600)"
Ok = "INSERT INTO sql_applied (stream_id) VALUES ($2)"
"#;
    let s = settings(&env.url, perspective, |w| {
        w.consumers = 1;
        w.apply_timeout = secs(1);
        w.max_perspective_event_attempts = Some(1);
        w.shutdown_grace = secs(2);
    });
    let daemon = daemon_on(&env, s)
        .perspective(Forever)
        .start()
        .await
        .unwrap();
    env.wait_until(
        "SELECT (SELECT count(*) FROM sql_applied) + (SELECT count(*) FROM rust_applied)",
        10,
        Duration::from_secs(30),
    )
    .await;
    env.wait_until(
        "SELECT count(*) FROM wh_dead_letters WHERE failures_when_dlq >= 1",
        2,
        Duration::from_secs(30),
    )
    .await;
    shutdown_within(daemon, Duration::from_secs(15)).await;
    let errors: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT perspective_name, error_text FROM wh_dead_letters ORDER BY perspective_name",
    )
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    assert_eq!(errors.len(), 2, "{errors:?}");
    for (perspective, error) in &errors {
        let error = error.as_deref().unwrap_or("");
        assert!(
            error.contains("timeout") || error.contains("timed out"),
            "{perspective}: the dead letter says the apply timed out: {error}"
        );
    }
}

/// Fails one event type and is slow on another, to stretch the batch's transaction.
struct SlowThenFail;

#[async_trait]
impl Perspective for SlowThenFail {
    fn name(&self) -> &str {
        "clock"
    }
    fn event_types(&self) -> Vec<String> {
        vec!["Slow".into(), "Fail".into()]
    }
    async fn apply(&self, e: &EventEnvelope, _tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        if e.event_type == "Slow" {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            Ok(())
        } else {
            Err(ApplyError::Retryable("fails on purpose".into()))
        }
    }
}

/// Defect 5: the backoff of a failure recorded late in a long batch transaction starts at the
/// failure, not at the start of the transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backoff_is_measured_from_the_failure_not_from_the_batch_start() {
    let env = env().await;
    register(&env, "clock", &["Slow", "Fail"]).await;
    append(&env, low_stream(), &["Slow"]).await;
    append(&env, high_stream(), &["Fail"]).await;
    let s = settings(&env.url, "", |w| {
        w.consumers = 1;
        w.lease = secs(30);
        w.retry_backoff_base = secs(3);
        w.retry_backoff_max = secs(3);
    });
    let daemon = daemon_on(&env, s)
        .perspective(SlowThenFail)
        .start()
        .await
        .unwrap();
    env.wait_until(
        "SELECT count(*) FROM wh_perspective_events WHERE failures = 1",
        1,
        Duration::from_secs(30),
    )
    .await;
    let remaining: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM scheduled_for - clock_timestamp())::float8 \
         FROM wh_perspective_events WHERE failures = 1",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    shutdown_within(daemon, Duration::from_secs(15)).await;
    eprintln!(
        "backoff: a 3 s backoff recorded 1.5 s into its transaction has {remaining:.2} s left"
    );
    assert!(
        remaining > 2.2,
        "a 3 s backoff recorded just now has {remaining:.2} s left: it was counted from the start of the batch"
    );
}

/// Defects 6 and 10: statements that fail the same way every time with a SQLSTATE that looks
/// like a lock conflict (40001, 40P01, 55P03) or like a lost database (08006 raised by the
/// statement, 57P01 from a statement that kills its own backend) are charged and end
/// dead-lettered, with their error kept; a healthy perspective in the same batches applies
/// every event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_that_fail_with_transient_looking_sqlstates_are_charged_and_do_not_block_others()
{
    let env = env().await;
    env.exec(RAISE_CODE).await;
    env.exec("CREATE TABLE healthy_applied (stream_id uuid, version int, PRIMARY KEY (stream_id, version))",
    )
    .await;
    let kinds = [
        ("Serialization", "SELECT raise_code('40001')"),
        ("Deadlock", "SELECT raise_code('40P01')"),
        ("LockNotAvailable", "SELECT raise_code('55P03')"),
        ("ConnectionFailure", "SELECT raise_code('08006')"),
        ("AdminShutdown", "SELECT raise_code('57P01')"),
        (
            "KillsItself",
            "SELECT pg_terminate_backend(pg_backend_pid())",
        ),
    ];
    let types: Vec<&str> = kinds.iter().map(|(t, _)| *t).collect();
    let list = types
        .iter()
        .map(|t| format!("\"{t}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let poison_sql: String = kinds
        .iter()
        .map(|(t, sql)| format!("{t} = \"{sql}\"\n"))
        .collect();
    let healthy_sql: String = types
        .iter()
        .map(|t| {
            format!("{t} = \"INSERT INTO healthy_applied (stream_id, version) VALUES ($2, $6)\"\n")
        })
        .collect();
    let perspectives = format!(
        "[[perspectives]]\nname = \"poison\"\nevents = [{list}]\n[perspectives.sql]\n{poison_sql}\n\
         [[perspectives]]\nname = \"healthy\"\nevents = [{list}]\n[perspectives.sql]\n{healthy_sql}\n"
    );
    register(&env, "poison", &types).await;
    register(&env, "healthy", &types).await;
    for t in &types {
        append(&env, Uuid::new_v4(), &[t, t]).await;
    }
    let s = settings(&env.url, &perspectives, |w| {
        w.max_perspective_event_attempts = Some(2);
        w.shutdown_grace = secs(2);
    });
    let started = Instant::now();
    let daemon = daemon_on(&env, s).start().await.unwrap();
    env.wait_until(
        "SELECT count(*) FROM healthy_applied",
        12,
        Duration::from_secs(60),
    )
    .await;
    env.wait_until(
        "SELECT count(*) FROM wh_dead_letters WHERE perspective_name = 'poison'",
        12,
        Duration::from_secs(90),
    )
    .await;
    eprintln!(
        "transient-looking SQLSTATEs: 12 poison rows dead-lettered (max 2 attempts) and 12 healthy applied in {:?}",
        started.elapsed()
    );
    shutdown_within(daemon, Duration::from_secs(15)).await;
    let missing_error = env
        .scalar("SELECT count(*) FROM wh_dead_letters WHERE error_text NOT LIKE '%last error: %'")
        .await;
    assert_eq!(
        missing_error, 0,
        "every dead letter carries the statement's last error"
    );
}

/// Defect 7: a release refunds exactly the bump its claim made. A row re-leased by its own
/// instance (lease expired, no takeover) was not bumped, so giving it back refunds nothing.
#[tokio::test]
async fn a_release_refunds_only_the_bump_its_claim_made() {
    let env = env().await;
    env.exec("SELECT register_perspective('refund', ARRAY['E'])")
        .await;
    let stream = Uuid::new_v4();
    append(&env, stream, &["E"]).await;
    let instance = InstanceId::new();
    env.store
        .heartbeat(instance, &InstanceInfo::current("test"))
        .await
        .unwrap();
    let lease = Duration::from_secs(60);
    let names = vec!["refund".to_string()];
    let rows = env
        .store
        .get_stream_events(instance, &[stream], lease, Some(&names), None)
        .await
        .unwrap();
    assert_eq!(rows[0].attempts, 1, "a takeover bumps");
    env.exec("UPDATE wh_perspective_events SET lease_expiry = now() - interval '1 second'")
        .await;
    let rows = env
        .store
        .get_stream_events(instance, &[stream], lease, Some(&names), None)
        .await
        .unwrap();
    assert_eq!(rows[0].attempts, 1, "re-leasing our own row does not bump");
    vantage::internals::leases::release_unstarted(
        env.store.pool(),
        instance,
        &[rows[0].event_work_id],
    )
    .await
    .unwrap();
    assert_eq!(
        env.scalar("SELECT attempts::bigint FROM wh_perspective_events")
            .await,
        1,
        "the second claim made no bump, so there is nothing to refund"
    );
    // A fresh takeover is refunded exactly once.
    let rows = env
        .store
        .get_stream_events(instance, &[stream], lease, Some(&names), None)
        .await
        .unwrap();
    assert_eq!(rows[0].attempts, 2);
    for _ in 0..2 {
        vantage::internals::leases::release_unstarted(
            env.store.pool(),
            instance,
            &[rows[0].event_work_id],
        )
        .await
        .unwrap();
    }
    assert_eq!(
        env.scalar("SELECT attempts::bigint FROM wh_perspective_events")
            .await,
        1
    );
}

/// Steals the lease of its event's row (once) while the batch runs, as a takeover by another
/// instance would; fails or permanently fails other types.
struct Thief {
    store: Store,
    thief: InstanceId,
    stolen: AtomicBool,
}

#[async_trait]
impl Perspective for Thief {
    fn name(&self) -> &str {
        "thief"
    }
    fn event_types(&self) -> Vec<String> {
        vec!["Fail".into(), "Perm".into(), "Steal".into(), "Ok".into()]
    }
    async fn apply(&self, e: &EventEnvelope, _tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        match e.event_type.as_str() {
            "Fail" => Err(ApplyError::Retryable("fails on purpose".into())),
            "Perm" => Err(ApplyError::Permanent("never works".into())),
            "Steal" if !self.stolen.swap(true, Ordering::SeqCst) => {
                sqlx::query(
                    "UPDATE wh_perspective_events SET instance_id = $1, \
                     lease_expiry = now() + interval '1 hour' WHERE event_work_id = $2",
                )
                .bind(self.thief.0)
                .bind(e.event_work_id)
                .execute(self.store.pool())
                .await
                .unwrap();
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// Defects 8 and 13: when a batch loses a lease, its transaction rolls back, but the failure it
/// recorded is still recorded, the permanent failure still dead-lettered (once, with one metric
/// increment, after the move is durable), and the rows behind them are given back, not left
/// leased to us.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_still_records_failures_and_gives_back_the_rest() {
    let env = env().await;
    let fail_stream = low_stream();
    let perm_stream = Uuid::from_u128(0x0000_0002_0000_0000_0000_0000_0000_0001);
    register(&env, "thief", &["Fail", "Perm", "Steal", "Ok"]).await;
    append(&env, fail_stream, &["Fail", "Ok", "Ok"]).await;
    append(&env, perm_stream, &["Perm", "Ok"]).await;
    append(&env, high_stream(), &["Steal"]).await;
    let thief = InstanceId::new();
    env.store
        .heartbeat(thief, &InstanceInfo::current("thief"))
        .await
        .unwrap();
    let s = settings(&env.url, "", |w| {
        w.consumers = 1;
        w.lease = secs(30);
        w.retry_backoff_base = secs(60);
        w.retry_backoff_max = secs(60);
        w.shutdown_grace = secs(2);
    });
    let daemon = daemon_on(&env, s)
        .perspective(Thief {
            store: env.store.clone(),
            thief,
            stolen: AtomicBool::new(false),
        })
        .start()
        .await
        .unwrap();
    let instance = daemon.instance_id();
    env.wait_until(
        &format!(
            "SELECT count(*) FROM wh_perspective_events WHERE stream_id = '{fail_stream}' \
             AND stream_version = 1 AND failures = 1 AND instance_id IS NULL"
        ),
        1,
        Duration::from_secs(8),
    )
    .await;
    env.wait_until(
        "SELECT count(*) FROM wh_dead_letters WHERE perspective_name = 'thief'",
        1,
        Duration::from_secs(8),
    )
    .await;
    // Nothing behind the failure stays leased to us. The give-back of the rows behind it
    // commits after the failure this test waited for: wait for it too, instead of racing it.
    env.wait_until(
        &format!(
            "SELECT count(*) FROM wh_perspective_events WHERE instance_id = '{}' \
             AND stream_id = '{fail_stream}'",
            instance.0
        ),
        0,
        Duration::from_secs(8),
    )
    .await;
    // The move is counted after its commit, so the dead letter can be visible before the
    // count is: wait for the count as well, then check it is exactly one.
    let moves = wait_for_metric(
        "vantage_dead_letter_moves_total",
        &[("perspective", "thief"), ("reason", "PermanentFailure")],
        1.0,
        Duration::from_secs(8),
    )
    .await;
    assert_eq!(moves, 1.0, "one move, counted once");
    let history = env.scalar("SELECT count(*) FROM wh_dead_letter_history h JOIN wh_dead_letters d USING (dead_letter_id) \
         WHERE d.perspective_name = 'thief' AND h.kind = 'Exhausted'",
    )
    .await;
    assert_eq!(history, 1);
    shutdown_within(daemon, Duration::from_secs(15)).await;
}

/// A TCP proxy in front of PostgreSQL that can black-hole: once cut, its connections are dropped
/// and new ones are accepted but never answered, like a database host gone off the network.
struct Proxy {
    addr: std::net::SocketAddr,
    cut: CancellationToken,
    /// Connections accepted since the cut and never answered.
    held: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

async fn proxy_to(target: String) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cut = CancellationToken::new();
    let token = cut.clone();
    let held_count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = held_count.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                return;
            };
            if token.is_cancelled() {
                held.push(client);
                counted.store(held.len(), Ordering::SeqCst);
                continue;
            }
            let target = target.clone();
            let token = token.clone();
            tokio::spawn(async move {
                let Ok(mut server) = TcpStream::connect(&target).await else {
                    return;
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                    _ = token.cancelled() => {}
                }
            });
        }
    });
    Proxy {
        addr,
        cut,
        held: held_count,
    }
}

/// Defect 12: with the database gone (no answer at all), shutdown does not wait for claims
/// stuck on the pool, and deregistration is bounded: the process is gone in a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_the_database_gone_is_quick() {
    let env = env().await;
    let mut url = url::Url::parse(&env.url).unwrap();
    let target = format!("{}:{}", url.host_str().unwrap(), url.port().unwrap_or(5432));
    let proxy = proxy_to(target).await;
    url.set_host(Some("127.0.0.1")).unwrap();
    url.set_port(Some(proxy.addr.port())).unwrap();
    env.exec("CREATE TABLE gone_applied (stream_id uuid PRIMARY KEY)")
        .await;
    let perspective = r#"
[[perspectives]]
name = "gone"
events = ["E"]
[perspectives.sql]
E = "INSERT INTO gone_applied (stream_id) VALUES ($2)"
"#;
    let s = settings(url.as_str(), perspective, |w| w.shutdown_grace = secs(20));
    let daemon = DaemonBuilder::new(s).without_http().start().await.unwrap();
    append(&env, Uuid::new_v4(), &["E"]).await;
    env.wait_until(
        "SELECT count(*) FROM gone_applied",
        1,
        Duration::from_secs(30),
    )
    .await;
    // The daemon's connections are named after its instance (issue #7: operators tell its
    // sessions apart in pg_stat_activity).
    let named: Vec<String> = sqlx::query_scalar(
        "SELECT application_name FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name LIKE 'vantage %'",
    )
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    let want = format!("vantage {}", daemon.instance_id());
    assert!(named.contains(&want), "{want} not in {named:?}");
    proxy.cut.cancel();
    // Shut down only once the database is gone for the daemon: its sessions have left the
    // server, and it has knocked again and hangs on a connection nobody answers.
    env.wait_until(
        &format!("SELECT count(*) FROM pg_stat_activity WHERE application_name = '{want}'"),
        0,
        Duration::from_secs(30),
    )
    .await;
    let started = Instant::now();
    while proxy.held.load(Ordering::SeqCst) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the daemon never tried to reach the database after the cut"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = shutdown_within(daemon, Duration::from_secs(60)).await;
    eprintln!("database gone: shutdown took {took:?} with a 20 s grace and no batch in flight");
    assert!(
        took < Duration::from_secs(8),
        "shutdown with the database gone took {took:?} (grace 20 s, no batch in flight)"
    );
}

/// Every change made on behalf of a lease is fenced: a move that names an instance moves only
/// rows leased to it (before, an unleased row moved too, so a fenced-out worker could dead-letter
/// a row a rebuild had taken back). An operator's move (no instance) is not fenced.
#[tokio::test]
async fn a_move_on_behalf_of_a_lease_only_moves_rows_leased_to_it() {
    use vantage::internals::store::MoveOutcome;
    let env = env().await;
    register(&env, "fenced", &["E"]).await;
    append(&env, Uuid::new_v4(), &["E"]).await;
    let work_id: Uuid = sqlx::query_scalar("SELECT event_work_id FROM wh_perspective_events")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    let instance = InstanceId::new();
    let moved = vantage::internals::leases::move_to_dead_letters(
        env.store.pool(),
        instance,
        work_id,
        "MaxAttemptsExceeded",
        "test",
    )
    .await
    .unwrap();
    assert_eq!(
        moved,
        MoveOutcome::AlreadyGone,
        "an unleased row is not ours to move"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM wh_perspective_events")
            .await,
        1
    );
    // (the SQL contract's operator move: no instance; the Rust API has no unfenced move)
    let moved: Option<Uuid> =
        sqlx::query_scalar("SELECT move_to_dead_letters($1, $2, $3, $4, $5, NULL)")
            .bind(Uuid::new_v4())
            .bind(vantage::internals::store::SOURCE_TABLE)
            .bind(work_id)
            .bind("MaxAttemptsExceeded")
            .bind("test")
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    let moved = moved.map_or(MoveOutcome::AlreadyGone, MoveOutcome::Moved);
    assert!(matches!(moved, MoveOutcome::Moved(_)));
}

/// Issue 19, defect 4: after DDL, a row-returning statement fails with "cached plan must not
/// change result type" (0A000) on every pooled connection that prepared it. That failure is
/// the connection's, not the event's: it is never charged, and it heals without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_cached_plan_after_ddl_is_not_charged_to_the_event() {
    let env = env().await;
    env.exec("CREATE TABLE rm_rows (event_id uuid PRIMARY KEY)")
        .await;
    register(&env, "rm", &["Ok", "Bad"]).await;
    let perspectives = "[[perspectives]]\nname = \"rm\"\nevents = [\"Ok\", \"Bad\"]\n\
        [perspectives.sql]\nOk = \"INSERT INTO rm_rows (event_id) VALUES ($3) RETURNING *\"\n\
        Bad = \"SELECT 1/0\"\n";
    let s = settings(&env.url, perspectives, |w| {
        w.consumers = 1;
        // A charged row stays parked for the test's length: each round is one careful pass.
        w.retry_backoff_base = secs(3600);
        w.retry_backoff_max = secs(3600);
    });
    let daemon = daemon_on(&env, s).start().await.unwrap();
    for round in 0..8 {
        // `Bad` fails the fast pass, so the careful pass runs `Ok` on its own (a prepared,
        // cached statement on whichever pooled connection the batch got).
        let stream = Uuid::new_v4();
        append(&env, stream, &["Ok", "Bad"]).await;
        let charged =
            format!("SELECT count(*) FROM wh_perspective_events WHERE stream_id = '{stream}' AND failures > 0");
        env.wait_until(&charged, 1, Duration::from_secs(30)).await;
        let left: Vec<(String, Option<String>)> = sqlx::query_as(
            "SELECT e.event_type, w.last_error FROM wh_perspective_events w \
             JOIN wh_event_store e USING (event_id) WHERE w.stream_id = $1",
        )
        .bind(stream)
        .fetch_all(env.store.pool())
        .await
        .unwrap();
        assert_eq!(
            left.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>(),
            ["Bad"],
            "round {round}: only the poison event is charged, the healthy one is applied: {left:?}"
        );
        env.exec(&format!("ALTER TABLE rm_rows ADD COLUMN c{round} int"))
            .await;
    }
    shutdown_within(daemon, Duration::from_secs(15)).await;
    assert_eq!(env.scalar("SELECT count(*) FROM rm_rows").await, 8);
    assert_eq!(
        env.scalar("SELECT count(*) FROM wh_dead_letters").await,
        0,
        "nothing dead-lettered"
    );
}

/// Issue 19, defect 8: a huge payload that a failing cast copies into the error text is stored
/// (and logged) capped: the first 64 KiB and "… (N bytes more)".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_error_text_is_stored_capped() {
    let env = env().await;
    register(&env, "casts", &["Big"]).await;
    let perspectives = "[[perspectives]]\nname = \"casts\"\nevents = [\"Big\"]\n\
        [perspectives.sql]\nBig = \"SELECT ($1->>'big')::int\"\n";
    let big = "x".repeat(1_000_000);
    env.store
        .append_events(
            Uuid::new_v4(),
            None,
            &[NewEvent::new("Big", serde_json::json!({ "big": big }))],
        )
        .await
        .unwrap();
    let s = settings(&env.url, perspectives, |w| {
        w.max_perspective_event_attempts = Some(1);
    });
    let daemon = daemon_on(&env, s).start().await.unwrap();
    env.wait_until(
        "SELECT count(*) FROM wh_dead_letters",
        1,
        Duration::from_secs(60),
    )
    .await;
    shutdown_within(daemon, Duration::from_secs(15)).await;
    let (len, text): (i32, String) =
        sqlx::query_as("SELECT octet_length(error_text), error_text FROM wh_dead_letters")
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    // The move's own text plus the row's last error, each capped at 64 KiB.
    assert!(len < 2 * 65_536 + 1_000, "error_text is {len} bytes");
    assert!(
        text.contains("bytes more)"),
        "{}",
        &text[text.len() - 200..]
    );
}

/// Issue 19, defect 12: a fast (set-wise) pass abandoned at shutdown does not refund the rows
/// it handed to the statement call: the row whose statement was running keeps its attempt, so
/// a statement slower than the grace is charged across restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_during_a_fast_pass_keeps_the_attempt_of_the_rows_handed_over() {
    let env = env().await;
    register(&env, "slowfast", &["Hang"]).await;
    append(&env, low_stream(), &["Hang"]).await;
    // A plain write (the set-wise call runs it inside the dispatcher) that hangs.
    let perspective = "[[perspectives]]\nname = \"slowfast\"\nevents = [\"Hang\"]\n\
        [perspectives.sql]\nHang = \"INSERT INTO public.nothing (v) SELECT 1 FROM pg_sleep(600)\"\n";
    env.exec("CREATE TABLE public.nothing (v int)").await;
    let s = settings(&env.url, perspective, |w| {
        w.consumers = 1;
        w.lease = secs(120);
        w.apply_timeout = secs(100);
        w.shutdown_grace = secs(1);
    });
    let daemon = daemon_on(&env, s).start().await.unwrap();
    env.wait_until(
        "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%apply_and_complete_perspective_events%' AND state = 'active' AND wait_event = 'PgSleep'",
        1,
        Duration::from_secs(30),
    )
    .await;
    shutdown_within(daemon, Duration::from_secs(20)).await;
    let rows: Vec<(Option<Uuid>, i32)> =
        sqlx::query_as("SELECT instance_id, attempts FROM wh_perspective_events")
            .fetch_all(env.store.pool())
            .await
            .unwrap();
    assert_eq!(rows, [(None, 1)], "released, and its claim not refunded");
}

/// Locks its database against new connections and cuts every connection to it (its own
/// included) on its first apply, then says the database is unavailable: the batch fails, and
/// so does its give-back, as when the database goes away mid-batch. Applies from then on.
struct Severs {
    admin_url: String,
    database: String,
    cut: AtomicBool,
    applied: std::sync::Mutex<Vec<i32>>,
}

#[async_trait]
impl Perspective for Severs {
    fn name(&self) -> &str {
        "severs"
    }
    fn event_types(&self) -> Vec<String> {
        vec!["E".into()]
    }
    async fn apply(&self, e: &EventEnvelope, _tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        if !self.cut.swap(true, Ordering::SeqCst) {
            use sqlx::Connection as _;
            let mut admin = sqlx::PgConnection::connect(&self.admin_url).await.unwrap();
            sqlx::query(&format!(
                "ALTER DATABASE \"{}\" ALLOW_CONNECTIONS false",
                self.database
            ))
            .execute(&mut admin)
            .await
            .unwrap();
            sqlx::query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
            )
            .bind(&self.database)
            .execute(&mut admin)
            .await
            .unwrap();
            return Err(ApplyError::Unavailable("the test cut the database".into()));
        }
        self.applied.lock().unwrap().push(e.attempts);
        Ok(())
    }
}

/// Finding A of the soak: a batch that fails because the database went away gives its rows
/// back; when that give-back fails too, the rows stayed leased to this (live) instance with
/// nothing in flight, so no claim, ours or another's, could take them until their lease ran
/// out (`worker.lease`, 60 s by default; an hour here). The owner gives them back itself once
/// the database answers again, with the refund the give-back would have made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_whose_give_back_failed_are_given_back_once_the_database_answers() {
    use sqlx::Connection as _;
    use vantage::internals::perspective::PerspectiveRegistry;
    use vantage::internals::pipeline::Pipeline;

    let env = env().await;
    register(&env, "severs", &["E"]).await;
    let stream = Uuid::new_v4();
    append(&env, stream, &["E", "E"]).await;
    let admin_url = match env.url.rfind('/') {
        Some(at) => format!("{}/postgres", &env.url[..at]),
        None => panic!("a database URL: {}", env.url),
    };
    let severs = std::sync::Arc::new(Severs {
        admin_url: admin_url.clone(),
        database: env.db.name.clone(),
        cut: AtomicBool::new(false),
        applied: std::sync::Mutex::new(Vec::new()),
    });
    let instance = InstanceId::new();
    env.store
        .heartbeat(instance, &InstanceInfo::current("test"))
        .await
        .unwrap();
    let mut registry = PerspectiveRegistry::new();
    registry.add(severs.clone()).unwrap();
    let worker = WorkerSettings {
        lease: Duration::from_secs(3600),
        ..WorkerSettings::default()
    };
    let pipeline = Pipeline::new(env.store.clone(), instance, registry, None, &worker);

    // The batch fails with the database, and so does its give-back.
    let _ = pipeline.drain_once().await;
    assert!(severs.cut.load(Ordering::SeqCst), "the first apply ran");
    let mut admin = sqlx::PgConnection::connect(&admin_url).await.unwrap();
    sqlx::query(&format!(
        "ALTER DATABASE \"{}\" ALLOW_CONNECTIONS true",
        env.db.name
    ))
    .execute(&mut admin)
    .await
    .unwrap();

    // The database answers again: both events are applied, well before the lease could lapse,
    // charged as the give-back would have charged them: the first was seen by its handler (the
    // attempt was used), the second was not (its claim's bump refunded).
    let deadline = Instant::now() + secs(60);
    while severs.applied.lock().unwrap().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the rows are still leased to us with nothing in flight: {:?}",
            sqlx::query_as::<_, (Option<Uuid>, i32)>(
                "SELECT instance_id, attempts FROM wh_perspective_events ORDER BY stream_version"
            )
            .fetch_all(env.store.pool())
            .await
        );
        let _ = pipeline.drain_once().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(*severs.applied.lock().unwrap(), vec![2, 1]);
}

/// Writes one row per event; the table's deferred trigger waits at COMMIT for an advisory lock
/// the test holds, so the test can end the pass's session exactly there.
struct CommitsSlowly;

#[async_trait]
impl Perspective for CommitsSlowly {
    fn name(&self) -> &str {
        "cut_at_commit"
    }
    fn event_types(&self) -> Vec<String> {
        vec!["E".into()]
    }
    async fn apply(&self, e: &EventEnvelope, tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        sqlx::query("INSERT INTO public.cut_applied (position) VALUES ($1)")
            .bind(e.global_position)
            .execute(tx.connection()?)
            .await
            .map_err(|e| ApplyError::Retryable(e.to_string()))?;
        Ok(())
    }
}

/// Finding H of the soak: a pass that dies with its session at a step of its own (here its
/// COMMIT; also its BEGIN or a SAVEPOINT) has no handler to blame, yet its rows went back
/// charged because their handlers had seen them: with sessions terminated twice a second, 125
/// healthy events were dead-lettered after 11 claims and no failure. Such rows are now given
/// back with a refund, as many times per row as a row may be claimed (so a commit that kills
/// its own session every time is still charged in the end, and dead-lettered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_a_pass_whose_commit_died_with_its_session_are_refunded_a_bounded_number_of_times()
{
    use sqlx::Connection as _;
    use vantage::internals::perspective::PerspectiveRegistry;
    use vantage::internals::pipeline::Pipeline;

    let env = env().await;
    register(&env, "cut_at_commit", &["E"]).await;
    env.exec("CREATE TABLE public.cut_applied (position bigint PRIMARY KEY)")
        .await;
    env.exec(
        "CREATE FUNCTION public.wait_at_commit() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NULL; END $$",
    )
    .await;
    env.exec(
        "CREATE CONSTRAINT TRIGGER wait_at_commit AFTER INSERT ON public.cut_applied \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.wait_at_commit()",
    )
    .await;
    append(&env, Uuid::new_v4(), &["E", "E"]).await;
    let instance = InstanceId::new();
    env.store
        .heartbeat(instance, &InstanceInfo::current("test"))
        .await
        .unwrap();
    let mut registry = PerspectiveRegistry::new();
    registry.add(std::sync::Arc::new(CommitsSlowly)).unwrap();
    let worker = WorkerSettings {
        max_perspective_event_attempts: Some(2),
        ..WorkerSettings::default()
    };
    let pipeline = Pipeline::new(env.store.clone(), instance, registry, None, &worker);
    // (in this test's database: the suite's other tests share the server)
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                   AND wait_event_type = 'Lock' AND wait_event = 'advisory'";
    let rows = || async {
        sqlx::query_as::<_, (Option<Uuid>, i32)>(
            "SELECT instance_id, attempts FROM wh_perspective_events ORDER BY stream_version",
        )
        .fetch_all(env.store.pool())
        .await
        .unwrap()
    };

    // Rounds 1 and 2 (max_perspective_event_attempts = 2): refunded; round 3: charged.
    for (round, attempts) in [(1, 0), (2, 0), (3, 1)] {
        let mut holder = sqlx::PgConnection::connect(&env.url).await.unwrap();
        sqlx::query("SELECT pg_advisory_lock(4242)")
            .execute(&mut holder)
            .await
            .unwrap();
        let drain = tokio::spawn({
            let pipeline = pipeline.clone();
            async move { pipeline.drain_once().await }
        });
        env.wait_until(waiting, 1, secs(30)).await;
        env.exec(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE datname = current_database() \
               AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
        )
        .await;
        let result = drain.await.unwrap();
        assert!(result.is_err(), "round {round}: the pass died: {result:?}");
        holder.close().await.unwrap();
        assert_eq!(
            rows().await,
            [(None, attempts), (None, attempts)],
            "round {round}: given back, the claim's bump refunded only while the row has budget"
        );
    }
    // With the lock free, the next pass applies both (attempts 2: not beyond the maximum).
    let outcome = pipeline.drain_once().await.unwrap();
    assert_eq!(outcome.claimed, 2, "{outcome:?}");
    assert_eq!(
        env.scalar("SELECT count(*) FROM public.cut_applied").await,
        2
    );
    assert_eq!(env.scalar("SELECT count(*) FROM wh_dead_letters").await, 0);
}

/// `Store::close` waits for every connection of its pool to come back. A batch session kept
/// for the next batch is a connection taken from the pool: closing must let it go, or it
/// waits forever (it did: the producers bench hung in `daemon_store.close()`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_closes_although_it_keeps_batch_sessions() {
    use vantage::internals::store::{WorkStore as _, WorkTx as _};
    let env = env().await;
    let store = Store::connect(&vantage::store::StoreOptions::for_url(&env.db.url))
        .await
        .unwrap();
    // A committed batch leaves its session clean: the store keeps it for the next one. A batch
    // rolled back on drop gives its session back from a task of its own.
    let tx = store.begin_batch(secs(5)).await.unwrap();
    tx.commit().await.unwrap();
    drop(store.begin_batch(secs(5)).await.unwrap());
    let closed = tokio::time::timeout(secs(10), store.close()).await;
    assert!(
        closed.is_ok(),
        "Store::close waited 10 s for its kept batch sessions"
    );
    // A session given back after the close is closed, not kept.
    assert!(store.pool().is_closed());
}

/// The real store, except that its first claim's answer is lost after the claim committed (as
/// when the session is terminated, the server restarts or the network drops between the
/// server's commit and the client's read).
#[derive(Clone, Debug)]
struct LosesFirstClaimAnswer {
    inner: Store,
    lost: std::sync::Arc<AtomicBool>,
}

#[async_trait]
impl vantage::internals::store::WorkStore for LosesFirstClaimAnswer {
    type Tx = <Store as vantage::internals::store::WorkStore>::Tx;

    async fn claim_work(
        &self,
        instance: InstanceId,
        lease: Duration,
        max_lanes: u32,
        max_rows: u32,
        perspectives: &[String],
    ) -> Result<Vec<vantage::internals::store::WorkRow>, vantage::store::StoreError> {
        self.claim_work_reading(instance, lease, max_lanes, max_rows, perspectives, true)
            .await
    }
    async fn claim_work_reading(
        &self,
        instance: InstanceId,
        lease: Duration,
        max_lanes: u32,
        max_rows: u32,
        perspectives: &[String],
        data: bool,
    ) -> Result<Vec<vantage::internals::store::WorkRow>, vantage::store::StoreError> {
        let rows = self
            .inner
            .claim_work_reading(instance, lease, max_lanes, max_rows, perspectives, data)
            .await?;
        if !rows.is_empty() && !self.lost.swap(true, Ordering::SeqCst) {
            return Err(vantage::store::StoreError::Database(sqlx::Error::Io(
                std::io::Error::new(std::io::ErrorKind::ConnectionReset, "answer lost"),
            )));
        }
        Ok(rows)
    }
    async fn release_unstarted(
        &self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, vantage::store::StoreError> {
        self.inner.release_unstarted(instance, ids).await
    }
    async fn release_started(
        &self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, vantage::store::StoreError> {
        self.inner.release_started(instance, ids).await
    }
    async fn leased_to(
        &self,
        instance: InstanceId,
    ) -> Result<Vec<Uuid>, vantage::store::StoreError> {
        self.inner.leased_to(instance).await
    }
    async fn record_failure(
        &self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
        retry_after: Duration,
    ) -> Result<bool, vantage::store::StoreError> {
        self.inner
            .record_failure(instance, id, error, retry_after)
            .await
    }
    async fn note_error(
        &self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
    ) -> Result<bool, vantage::store::StoreError> {
        self.inner.note_error(instance, id, error).await
    }
    fn has_dead_letters(&self) -> bool {
        self.inner.has_dead_letters()
    }
    async fn move_to_dead_letters(
        &self,
        instance: InstanceId,
        id: Uuid,
        reason: &str,
        error: &str,
    ) -> Result<vantage::internals::store::MoveOutcome, vantage::store::StoreError> {
        self.inner
            .move_to_dead_letters(instance, id, reason, error)
            .await
    }
    async fn move_many_to_dead_letters(
        &self,
        instance: InstanceId,
        moves: &[(Uuid, String)],
        reason: &str,
    ) -> Result<Vec<(Uuid, Uuid)>, vantage::store::StoreError> {
        self.inner
            .move_many_to_dead_letters(instance, moves, reason)
            .await
    }
    async fn begin_batch(
        &self,
        statement_timeout: Duration,
    ) -> Result<Self::Tx, vantage::store::StoreError> {
        self.inner.begin_batch(statement_timeout).await
    }
    async fn begin_batch_deferred(
        &self,
        statement_timeout: Duration,
    ) -> Result<Self::Tx, vantage::store::StoreError> {
        self.inner.begin_batch_deferred(statement_timeout).await
    }
    async fn cancel_backend(&self, backend: i32) -> Result<bool, vantage::store::StoreError> {
        self.inner.cancel_backend(backend).await
    }
    async fn ping(&self) -> Result<(), vantage::store::StoreError> {
        self.inner.ping().await
    }
}

/// Records the (position, attempts) of what it applies.
#[derive(Default)]
struct Records(std::sync::Mutex<Vec<(i64, i32)>>);

#[async_trait]
impl Perspective for Records {
    fn name(&self) -> &str {
        "records"
    }
    fn event_types(&self) -> Vec<String> {
        vec!["E".into()]
    }
    async fn apply(&self, e: &EventEnvelope, _tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        self.0.lock().unwrap().push((e.global_position, e.attempts));
        Ok(())
    }
}

/// Cause 2 of the 60-minute soak's slow recoveries: a claim that committed on the server but
/// whose answer never reached us (the session terminated, the server restarted) leaves its rows
/// validly leased to this live instance, which knows nothing of them; no claim, ours or
/// another's, takes a live instance's valid lease, so their lanes waited out the whole lease
/// (`worker.lease`, 60 s by default; an hour here). The owner gives such rows back itself once a
/// claim of its failed on its connection, with the refund an unseen row's give-back makes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_of_a_claim_whose_answer_was_lost_are_given_back_by_their_owner() {
    use vantage::internals::perspective::PerspectiveRegistry;
    use vantage::internals::pipeline::Pipeline;

    let env = env().await;
    register(&env, "records", &["E"]).await;
    let stream = Uuid::new_v4();
    append(&env, stream, &["E", "E", "E"]).await;
    let instance = InstanceId::new();
    env.store
        .heartbeat(instance, &InstanceInfo::current("test"))
        .await
        .unwrap();
    let records = std::sync::Arc::new(Records::default());
    let mut registry = PerspectiveRegistry::new();
    registry.add(records.clone()).unwrap();
    let worker = WorkerSettings {
        lease: Duration::from_secs(3600),
        ..WorkerSettings::default()
    };
    let store = LosesFirstClaimAnswer {
        inner: env.store.clone(),
        lost: Default::default(),
    };
    let pipeline = Pipeline::new(store.clone(), instance, registry, None, &worker);

    let first = pipeline.drain_once().await;
    assert!(
        first.as_ref().is_err_and(|e| e.is_database_unavailable()),
        "the first claim's answer is lost: {first:?}"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM wh_perspective_events WHERE instance_id IS NOT NULL")
            .await,
        3,
        "the lost claim leased the lane's rows to us"
    );

    let deadline = Instant::now() + secs(60);
    while records.0.lock().unwrap().len() < 3 {
        assert!(
            Instant::now() < deadline,
            "the rows are still leased to us with nothing in flight: {:?}",
            sqlx::query_as::<_, (Option<Uuid>, i32)>(
                "SELECT instance_id, attempts FROM wh_perspective_events ORDER BY stream_version"
            )
            .fetch_all(env.store.pool())
            .await
        );
        let _ = pipeline.drain_once().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // In stream order, and each seen on its first attempt: the lost claim's bump was refunded
    // with the rows (no handler saw them under that lease).
    let applied = records.0.lock().unwrap().clone();
    let mut sorted = applied.clone();
    sorted.sort();
    assert_eq!(applied, sorted);
    assert!(
        applied.iter().all(|(_, attempts)| *attempts == 1),
        "{applied:?}"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM wh_perspective_events")
            .await,
        0
    );
}

/// Records (position, replay) of what it applies, under a name of the test's choosing.
struct Tally {
    name: &'static str,
    seen: std::sync::Mutex<Vec<(i64, bool)>>,
}

impl Tally {
    fn new(name: &'static str) -> std::sync::Arc<Tally> {
        std::sync::Arc::new(Tally {
            name,
            seen: Default::default(),
        })
    }
    fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
    fn replays(&self) -> usize {
        self.seen.lock().unwrap().iter().filter(|s| s.1).count()
    }
}

#[async_trait]
impl Perspective for Tally {
    fn name(&self) -> &str {
        self.name
    }
    fn event_types(&self) -> Vec<String> {
        vec!["E".into()]
    }
    async fn apply(&self, e: &EventEnvelope, _tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        self.seen
            .lock()
            .unwrap()
            .push((e.global_position, e.replay));
        Ok(())
    }
}

/// A rebuild's history is background work. A perspective replaying history always has rows
/// due, so claims came back full of them and the other perspectives' fresh events waited for a
/// full batch each (the soak's rebuild raised their median lag from 0.04 to 0.32 s). Once a
/// claim has shown a perspective replaying, the first consumer loop takes it and the others
/// claim only the rest, until that loop's claim finds no more history of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_a_perspective_replays_history_only_the_first_loop_claims_it() {
    use vantage::internals::perspective::PerspectiveRegistry;
    use vantage::internals::pipeline::Pipeline;

    let env = env().await;
    register(&env, "hist", &["E"]).await;
    register(&env, "live", &["E"]).await;
    let streams: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
    for s in &streams {
        append(&env, *s, &["E", "E", "E"]).await;
    }
    let instance = InstanceId::new();
    env.store
        .heartbeat(instance, &InstanceInfo::current("test"))
        .await
        .unwrap();
    let (hist, live) = (Tally::new("hist"), Tally::new("live"));
    let mut registry = PerspectiveRegistry::new();
    registry.add(hist.clone()).unwrap();
    registry.add(live.clone()).unwrap();
    // Small batches, so history takes several claims.
    let worker = WorkerSettings {
        batch_size: 4,
        ..WorkerSettings::default()
    };
    let pipeline = Pipeline::new(env.store.clone(), instance, registry, None, &worker);
    while pipeline.drain_once().await.unwrap().claimed > 0 {}
    assert_eq!((hist.count(), live.count()), (12, 12));

    let rebuilt =
        vantage::perspective::rebuild::rebuild(&env.store, hist.as_ref(), secs(30), |_| {})
            .await
            .unwrap();
    assert_eq!(rebuilt.queued, 12);
    for s in &streams {
        append(&env, *s, &["E"]).await;
    }
    let (first, other) = (pipeline.for_consumer(0, 4), pipeline.for_consumer(2, 4));

    // Nobody knows yet: the other loop's first claim takes both, and sees history of hist.
    let outcome = other.drain_once().await.unwrap();
    assert!(outcome.claimed > 0);
    assert!(hist.replays() > 0, "the first claim brought history");
    assert_eq!(pipeline.replaying.names(), ["hist"]);

    // From now on the other loops take only live (its fresh events), while hist has history
    // left.
    let hist_before = hist.count();
    while other.drain_once().await.unwrap().claimed > 0 {}
    assert_eq!(
        live.count(),
        16,
        "live's fresh events were all applied by the other loop"
    );
    assert_eq!(
        hist.count(),
        hist_before,
        "the other loop claimed nothing of hist"
    );
    assert!(hist.replays() < 12, "history was left for the first loop");

    // The first loop takes hist's history, then its fresh events, and gives hist back.
    while first.drain_once().await.unwrap().claimed > 0 {}
    assert_eq!((hist.count(), hist.replays()), (12 + 16, 12));
    assert!(
        pipeline.replaying.names().is_empty(),
        "no more history: every loop takes hist again"
    );
    append(&env, streams[0], &["E"]).await;
    while other.drain_once().await.unwrap().claimed > 0 {}
    assert_eq!((hist.count(), live.count()), (29, 17));
    assert_eq!(
        env.scalar("SELECT count(*) FROM wh_perspective_events")
            .await,
        0
    );
}
