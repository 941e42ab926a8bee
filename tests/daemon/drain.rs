//! The daemon, in-process, against a real PostgreSQL (docs/pipeline.md, docs/sql-contract.md "SQL
//! perspectives"; issue "The daemon").

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use uuid::Uuid;
use vantage::config::Settings;
use vantage::daemon::{DaemonBuilder, RunningDaemon};
use vantage::internals::pipeline::cooldown::CooldownCache;
use vantage::perspective::{ApplyError, ApplyTx, EventEnvelope, Perspective};
use vantage::store::NewEvent;

use crate::support::{self, Env};

async fn env() -> Env {
    Env::migrated().await
}

/// Settings for a test daemon: fast timings, the given extra TOML appended.
fn settings(env: &Env, extra: &str) -> Settings {
    support::fast_settings(&env.url, extra)
}

async fn start(env: &Env, s: Settings) -> RunningDaemon {
    DaemonBuilder::new(s)
        .store(env.store.clone())
        .without_http()
        .start()
        .await
        .expect("daemon starts")
}

/// Waits until no work row is left, or panics after `limit`.
async fn wait_drained(env: &Env, limit: Duration) {
    env.wait_until("SELECT count(*) FROM wh_perspective_events", 0, limit)
        .await;
}

async fn append(env: &Env, stream: Uuid, events: Vec<NewEvent>) {
    env.store
        .append_events(stream, None, &events)
        .await
        .unwrap();
}

fn ev(event_type: &str, data: serde_json::Value) -> NewEvent {
    NewEvent::new(event_type, data)
}

/// A SQL perspective that records every apply with a global sequence number; the primary key
/// makes a second apply of the same event fail loudly.
fn recording_perspective(name: &str, events: &[&str]) -> String {
    let list = events
        .iter()
        .map(|e| format!("\"{e}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let stmts = events
        .iter()
        .map(|e| {
            format!(
                "{e} = \"INSERT INTO applied_{name} (stream_id, version, position, seq) \
                 VALUES ($2, $6, $5, nextval('apply_seq'))\""
            )
        })
        .collect::<Vec<_>>()
        .join("\n");
    format!(
        "[[perspectives]]\nname = \"{name}\"\nevents = [{list}]\nreset = \"TRUNCATE applied_{name}\"\n[perspectives.sql]\n{stmts}\n"
    )
}

async fn create_applied_table(env: &Env, name: &str) {
    env.exec(&format!(
            "CREATE SEQUENCE IF NOT EXISTS apply_seq; \
             CREATE TABLE applied_{name} (stream_id uuid, version int, position bigint, seq bigint, \
             PRIMARY KEY (stream_id, version))"
        ),
    )
    .await;
}

/// Every stream's rows, applied in version order: seq grows with version.
async fn assert_in_stream_order(env: &Env, name: &str) {
    let out_of_order = env.scalar(&format!(
            "SELECT count(*) FROM (SELECT seq < lag(seq) OVER (PARTITION BY stream_id ORDER BY version) AS bad \
             FROM applied_{name}) x WHERE bad"
        ),
    )
    .await;
    assert_eq!(
        out_of_order, 0,
        "{name}: events applied out of stream order"
    );
}

fn metric_value(rendered: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    rendered
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drains_2000_events_over_50_streams_exactly_once_in_order() {
    let env = env().await;
    create_applied_table(&env, "alpha").await;
    create_applied_table(&env, "beta").await;
    let s = settings(
        &env,
        &format!(
            "{}{}",
            recording_perspective("alpha", &["Placed", "Shipped"]),
            recording_perspective("beta", &["Placed"])
        ),
    );
    let daemon = start(&env, s).await;
    let streams: Vec<Uuid> = (0..50).map(|_| Uuid::new_v4()).collect();
    for round in 0..40 {
        for (i, s) in streams.iter().enumerate() {
            let t = if (round + i) % 2 == 0 {
                "Placed"
            } else {
                "Shipped"
            };
            append(&env, *s, vec![ev(t, serde_json::json!({"round": round}))]).await;
        }
    }
    wait_drained(&env, Duration::from_secs(60)).await;
    daemon.shutdown().await.unwrap();

    assert_eq!(env.scalar("SELECT count(*) FROM applied_alpha").await, 2000);
    let placed = env
        .scalar("SELECT count(*) FROM wh_event_store WHERE event_type = 'Placed'")
        .await;
    assert_eq!(
        env.scalar("SELECT count(*) FROM applied_beta").await,
        placed
    );
    assert_in_stream_order(&env, "alpha").await;
    assert_in_stream_order(&env, "beta").await;
    assert_eq!(env.scalar("SELECT count(*) FROM wh_dead_letters").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_events_are_dead_lettered_after_max_plus_one_claims() {
    let env = env().await;
    env.exec("CREATE TABLE poison_model (stream_id uuid, version int, n int, PRIMARY KEY (stream_id, version))",
    )
    .await;
    let mut s = settings(
        &env,
        r#"
[[perspectives]]
name = "poison_counts"
events = ["Counted"]
[perspectives.sql]
Counted = "INSERT INTO poison_model (stream_id, version, n) VALUES ($2, $6, ($1->>'n')::int)"
"#,
    );
    s.worker.max_perspective_event_attempts = Some(2);
    let daemon = start(&env, s).await;

    let streams: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
    // Stream 0 and 1 carry a poison event in the middle; the rest are healthy.
    for (i, s) in streams.iter().enumerate() {
        let mut events = Vec::new();
        for v in 1..=6 {
            let n = if i < 2 && v == 3 {
                serde_json::json!("not a number")
            } else {
                serde_json::json!(v)
            };
            events.push(ev("Counted", serde_json::json!({ "n": n })));
        }
        append(&env, *s, events).await;
    }
    wait_drained(&env, Duration::from_secs(60)).await;
    daemon.shutdown().await.unwrap();

    let rows: Vec<(i32, String, String, i32)> = sqlx::query_as(
        "SELECT attempts_when_dlq, failure_reason, coalesce(error_text, ''), stream_version \
         FROM wh_dead_letters ORDER BY stream_id",
    )
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    assert_eq!(rows.len(), 2, "exactly the poison events are dead-lettered");
    for (attempts, reason, error_text, version) in &rows {
        assert_eq!(*attempts, 3, "dead-lettered on claim max + 1");
        assert_eq!(reason, "MaxAttemptsExceeded");
        assert_eq!(*version, 3);
        assert!(
            error_text.contains("invalid input syntax"),
            "the real error is kept: {error_text}"
        );
    }
    // Every other event applied, including those behind the poison ones.
    assert_eq!(env.scalar("SELECT count(*) FROM poison_model").await, 28);
    let rendered = vantage::internals::telemetry::recorder::render();
    assert_eq!(
        metric_value(
            &rendered,
            "vantage_dead_letter_moves_total",
            &[
                ("perspective", "poison_counts"),
                ("reason", "MaxAttemptsExceeded")
            ]
        ),
        2.0
    );
}

/// Appends one event per stream for perspective `name` before any daemon runs, so tests can
/// preset work rows.
async fn preset_rows(env: &Env, name: &str, n: usize) -> Vec<Uuid> {
    env.store
        .register_perspective(name, &["Marked".to_string()])
        .await
        .unwrap();
    let mut streams = Vec::new();
    for _ in 0..n {
        let s = Uuid::new_v4();
        append(env, s, vec![ev("Marked", serde_json::json!({}))]).await;
        streams.push(s);
    }
    streams
}

fn marker_perspective(name: &str) -> String {
    format!(
        r#"
[[perspectives]]
name = "{name}"
events = ["Marked"]
[perspectives.sql]
Marked = "INSERT INTO marked (stream_id) VALUES ($2)"
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_at_max_are_applied_and_one_more_is_dead_lettered() {
    let env = env().await;
    env.exec("CREATE TABLE marked (stream_id uuid PRIMARY KEY)")
        .await;
    let streams = preset_rows(&env, "boundary", 2).await;
    sqlx::query("UPDATE wh_perspective_events SET attempts = 9 WHERE stream_id = $1")
        .bind(streams[0])
        .execute(env.store.pool())
        .await
        .unwrap();
    sqlx::query("UPDATE wh_perspective_events SET attempts = 10 WHERE stream_id = $1")
        .bind(streams[1])
        .execute(env.store.pool())
        .await
        .unwrap();
    let daemon = start(&env, settings(&env, &marker_perspective("boundary"))).await;
    wait_drained(&env, Duration::from_secs(30)).await;
    daemon.shutdown().await.unwrap();

    let applied: Vec<Uuid> = sqlx::query_scalar("SELECT stream_id FROM marked")
        .fetch_all(env.store.pool())
        .await
        .unwrap();
    assert_eq!(
        applied,
        vec![streams[0]],
        "attempts 9 + this claim = 10: applied"
    );
    let dead: Vec<(Uuid, i32)> =
        sqlx::query_as("SELECT stream_id, attempts_when_dlq FROM wh_dead_letters")
            .fetch_all(env.store.pool())
            .await
            .unwrap();
    assert_eq!(
        dead,
        vec![(streams[1], 11)],
        "attempts 10 + this claim = 11: dead-lettered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_keeps_poison_rows_forever() {
    let env = env().await;
    env.exec("CREATE TABLE strict_model (n int NOT NULL)").await;
    let mut s = settings(
        &env,
        r#"
[[perspectives]]
name = "forever"
events = ["Bad"]
[perspectives.sql]
Bad = "INSERT INTO strict_model (n) VALUES (($1->>'n')::int)"
"#,
    );
    s.worker.max_perspective_event_attempts = None;
    let daemon = start(&env, s).await;
    append(
        &env,
        Uuid::new_v4(),
        vec![ev("Bad", serde_json::json!({"n": "x"}))],
    )
    .await;
    // Well past max + 1 claims with the default max of 10.
    env.wait_until(
        "SELECT count(*) FROM wh_perspective_events WHERE attempts >= 12",
        1,
        Duration::from_secs(60),
    )
    .await;
    daemon.shutdown().await.unwrap();
    assert_eq!(env.scalar("SELECT count(*) FROM wh_dead_letters").await, 0);
    assert_eq!(
        env.scalar("SELECT count(*) FROM wh_perspective_events")
            .await,
        1
    );
    assert!(
        env.scalar("SELECT max(failures)::bigint FROM wh_perspective_events")
            .await
            >= 11
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_move_keeps_the_row_in_the_apply_set() {
    let env = env().await;
    env.exec("CREATE TABLE marked (stream_id uuid PRIMARY KEY)")
        .await;
    env.exec(
        "CREATE FUNCTION refuse_dead_letters() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RAISE EXCEPTION 'dead-letter store is broken'; END $$; \
         CREATE TRIGGER refuse BEFORE INSERT ON wh_dead_letters \
         FOR EACH ROW EXECUTE FUNCTION refuse_dead_letters();",
    )
    .await;
    let streams = preset_rows(&env, "movefail", 1).await;
    env.exec("UPDATE wh_perspective_events SET attempts = 10")
        .await;
    let before = metric_value(
        &vantage::internals::telemetry::recorder::render(),
        "vantage_dead_letter_move_errors_total",
        &[],
    );
    let daemon = start(&env, settings(&env, &marker_perspective("movefail"))).await;
    wait_drained(&env, Duration::from_secs(30)).await;
    daemon.shutdown().await.unwrap();

    let applied: Vec<Uuid> = sqlx::query_scalar("SELECT stream_id FROM marked")
        .fetch_all(env.store.pool())
        .await
        .unwrap();
    assert_eq!(
        applied, streams,
        "the over-the-limit row was applied and completed"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM wh_dead_letters").await, 0);
    let after = metric_value(
        &vantage::internals::telemetry::recorder::render(),
        "vantage_dead_letter_move_errors_total",
        &[],
    );
    assert!(
        after >= before + 1.0,
        "move errors counted ({before} -> {after})"
    );
}

/// Records every delivery with the attempts it carried, and fails if another transaction is
/// applying the same (stream, perspective) at the same moment.
#[derive(Default)]
struct Recorder {
    name: String,
    delay: Duration,
    /// Work ids handed to `apply` (outside any transaction, so it survives a rollback).
    seen: Arc<std::sync::Mutex<std::collections::HashSet<Uuid>>>,
}

#[async_trait]
impl Perspective for Recorder {
    fn name(&self) -> &str {
        &self.name
    }
    fn event_types(&self) -> Vec<String> {
        vec!["*".into()]
    }
    async fn apply(&self, e: &EventEnvelope, tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        self.seen.lock().unwrap().insert(e.event_work_id);
        let exclusive: bool =
            sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtext($1 || ':' || $2::text))")
                .bind(&self.name)
                .bind(e.stream_id)
                .fetch_one(tx.connection()?)
                .await
                .map_err(ApplyError::from_sqlx)?;
        if !exclusive {
            return Err(ApplyError::Retryable("concurrent apply of one lane".into()));
        }
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        sqlx::query(
            "INSERT INTO deliveries (perspective, event_id, stream_id, version, attempts, seq) \
             VALUES ($1, $2, $3, $4, $5, nextval('delivery_seq'))",
        )
        .bind(&self.name)
        .bind(e.event_id)
        .bind(e.stream_id)
        .bind(e.stream_version)
        .bind(e.attempts)
        .execute(tx.connection()?)
        .await
        .map_err(ApplyError::from_sqlx)?;
        Ok(())
    }
}

async fn create_deliveries(env: &Env) {
    env.exec(
        "CREATE SEQUENCE delivery_seq; \
         CREATE TABLE deliveries (perspective text, event_id uuid, stream_id uuid, version int, \
         attempts int, seq bigint, PRIMARY KEY (perspective, event_id))",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cooled_rows_are_completed_without_a_second_apply_per_perspective() {
    let env = env().await;
    create_deliveries(&env).await;
    for p in ["cool_a", "cool_b"] {
        env.store
            .register_perspective(p, &["*".to_string()])
            .await
            .unwrap();
    }
    let stream = Uuid::new_v4();
    append(&env, stream, vec![ev("Anything", serde_json::json!({}))]).await;
    let a_row: Uuid = sqlx::query_scalar(
        "SELECT event_work_id FROM wh_perspective_events WHERE perspective_name = 'cool_a'",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    // As if cool_a's row had been applied a moment ago and its completion lost.
    let cache = Arc::new(CooldownCache::new(Duration::from_secs(300), 1000));
    cache.mark(a_row);

    let s = settings(&env, "");
    let builder = DaemonBuilder::new(s)
        .store(env.store.clone())
        .without_http();
    let daemon = vantage::internals::daemon::cooldown_cache(builder, Arc::clone(&cache))
        .perspective(Recorder {
            name: "cool_a".into(),
            delay: Duration::ZERO,
            ..Recorder::default()
        })
        .perspective(Recorder {
            name: "cool_b".into(),
            delay: Duration::ZERO,
            ..Recorder::default()
        })
        .start()
        .await
        .unwrap();
    wait_drained(&env, Duration::from_secs(30)).await;
    daemon.shutdown().await.unwrap();

    let applied: Vec<String> = sqlx::query_scalar("SELECT perspective FROM deliveries")
        .fetch_all(env.store.pool())
        .await
        .unwrap();
    assert_eq!(
        applied,
        vec!["cool_b".to_string()],
        "only the uncooled perspective applied"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_daemons_share_the_work_without_overlap_and_hand_over_gracefully() {
    let env = env().await;
    create_deliveries(&env).await;
    let build = |instance_settings: Settings| {
        DaemonBuilder::new(instance_settings)
            .store(env.store.clone())
            .without_http()
            .perspective(Recorder {
                name: "shared_a".into(),
                delay: Duration::from_millis(1),
                ..Recorder::default()
            })
            .perspective(Recorder {
                name: "shared_b".into(),
                delay: Duration::from_millis(1),
                ..Recorder::default()
            })
    };
    let first = build(settings(&env, "")).start().await.unwrap();
    let second = build(settings(&env, "")).start().await.unwrap();

    let streams: Vec<Uuid> = (0..30).map(|_| Uuid::new_v4()).collect();
    for round in 0..20 {
        for s in &streams {
            append(
                &env,
                *s,
                vec![ev("Tick", serde_json::json!({ "round": round }))],
            )
            .await;
        }
    }
    // Let both work for a while, then stop one gracefully mid-drain.
    env.wait_until(
        "SELECT (count(*) > 200)::int::bigint FROM deliveries",
        1,
        Duration::from_secs(30),
    )
    .await;
    let first_id = first.instance_id();
    first.shutdown().await.unwrap();
    let held: i64 =
        sqlx::query_scalar("SELECT count(*) FROM wh_perspective_events WHERE instance_id = $1")
            .bind(first_id.0)
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    assert_eq!(held, 0, "a stopped daemon holds no lease");

    wait_drained(&env, Duration::from_secs(60)).await;
    second.shutdown().await.unwrap();

    assert_eq!(env.scalar("SELECT count(*) FROM deliveries").await, 2 * 600);
    let retried = env
        .scalar("SELECT count(*) FROM deliveries WHERE attempts <> 1")
        .await;
    assert_eq!(
        retried, 0,
        "no delivery needed a second claim: no overlap, no attempts growth"
    );
    let out_of_order = env.scalar("SELECT count(*) FROM (SELECT seq < lag(seq) OVER (PARTITION BY perspective, stream_id ORDER BY version) AS bad \
         FROM deliveries) x WHERE bad",
    )
    .await;
    assert_eq!(out_of_order, 0);
    assert_eq!(env.scalar("SELECT count(*) FROM wh_dead_letters").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_returns_within_the_grace_and_leaves_no_lease() {
    let env = env().await;
    create_deliveries(&env).await;
    let mut s = settings(&env, "");
    s.worker.shutdown_grace = Duration::from_secs(2);
    let seen: Arc<std::sync::Mutex<std::collections::HashSet<Uuid>>> = Default::default();
    let daemon = DaemonBuilder::new(s)
        .store(env.store.clone())
        .without_http()
        .perspective(Recorder {
            name: "slow".into(),
            delay: Duration::from_millis(20),
            seen: Arc::clone(&seen),
        })
        .start()
        .await
        .unwrap();
    let instance = daemon.instance_id();
    for _ in 0..20 {
        let events = (0..20)
            .map(|i| ev("Slow", serde_json::json!({ "i": i })))
            .collect();
        append(&env, Uuid::new_v4(), events).await;
    }
    env.wait_until(
        "SELECT (count(*) > 0)::int::bigint FROM deliveries",
        1,
        Duration::from_secs(30),
    )
    .await;
    let started = Instant::now();
    daemon.shutdown().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2) + Duration::from_secs(4),
        "shutdown took {:?}",
        started.elapsed()
    );
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM wh_perspective_events WHERE instance_id IS NOT NULL",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    assert_eq!(held, 0, "no lease left behind");
    let registered: i64 =
        sqlx::query_scalar("SELECT count(*) FROM wh_service_instances WHERE instance_id = $1")
            .bind(instance.0)
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    assert_eq!(registered, 0, "deregistered");
    // Rows never started were given back with a refund: none carries a charge. (Rows whose
    // handler had started in an abandoned batch keep theirs: issue #7, defect 7.)
    let charged: Vec<Uuid> =
        sqlx::query_scalar("SELECT event_work_id FROM wh_perspective_events WHERE attempts > 0")
            .fetch_all(env.store.pool())
            .await
            .unwrap();
    let seen = seen.lock().unwrap();
    let unstarted_charged: Vec<&Uuid> = charged.iter().filter(|id| !seen.contains(id)).collect();
    assert!(
        unstarted_charged.is_empty(),
        "rows no handler saw still carry a charge: {unstarted_charged:?}"
    );
}

/// Loop 1 still holds a lane's reservation (finishing its batch) when a row it failed becomes
/// due again; loop 2's claim acquires that head. Loop 1 will never fetch it, so loop 2 must give
/// it back: a kept head would sit leased to nobody until expiry, and, since claims never take a
/// row validly leased to us, stall the whole lane with it.
#[tokio::test]
async fn a_head_acquired_for_a_stream_another_loop_holds_is_given_back() {
    use vantage::internals::pipeline::claim::{claim_batch, ClaimLimits};
    use vantage::internals::pipeline::inflight::InFlight;
    use vantage::internals::store::{InstanceInfo, StoreInternals as _};
    use vantage::store::InstanceId;

    let env = env().await;
    let stream = preset_rows(&env, "handoff", 1).await[0];
    let instance = InstanceId::new();
    env.store
        .heartbeat(instance, &InstanceInfo::current("test"))
        .await
        .unwrap();
    let inflight = InFlight::new();
    let names = vec!["handoff".to_string()];
    let limits = ClaimLimits {
        lease: Duration::from_secs(60),
        max_streams: 10,
        batch_size: 100,
    };

    // Loop 1 claims the row, its apply fails, the row is due again at once.
    let mut first = claim_batch(&env.store, instance, &names, &limits, &inflight, None)
        .await
        .unwrap();
    assert_eq!(first.lanes().len(), 1);
    assert_eq!(first.lanes()[0].stream_id, stream);
    let row = first.rows()[0].event_work_id;
    // (through loop 1's lease handle, the one door of its rows)
    assert!(first.fail_now(row, "boom", Duration::ZERO).await.unwrap());

    // Loop 2 claims while loop 1 still holds the stream.
    let second = claim_batch(&env.store, instance, &names, &limits, &inflight, None)
        .await
        .unwrap();
    assert!(
        second.rows().is_empty(),
        "loop 2 must not work on a stream loop 1 holds"
    );
    let leased: Option<Uuid> = sqlx::query_scalar(
        "SELECT instance_id FROM wh_perspective_events WHERE event_work_id = $1",
    )
    .bind(row)
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    assert_eq!(
        leased, None,
        "the head went back instead of leaking a lease"
    );
    let attempts: i32 =
        sqlx::query_scalar("SELECT attempts FROM wh_perspective_events WHERE event_work_id = $1")
            .bind(row)
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    assert_eq!(attempts, 1, "and its attempt was refunded");
    drop(first);
    drop(second);
}

/// A work row whose event has vanished from the event store is not claimed forever: it is
/// dead-lettered at once, with a reason and a message that say what happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_whose_event_vanished_is_dead_lettered_not_retried() {
    let env = env().await;
    env.exec("CREATE TABLE marked (stream_id uuid PRIMARY KEY)")
        .await;
    let streams = preset_rows(&env, "vanished", 2).await;
    sqlx::query("DELETE FROM wh_event_store WHERE stream_id = $1")
        .bind(streams[0])
        .execute(env.store.pool())
        .await
        .unwrap();
    let daemon = start(&env, settings(&env, &marker_perspective("vanished"))).await;
    wait_drained(&env, Duration::from_secs(30)).await;
    daemon.shutdown().await.unwrap();

    let dead: Vec<(Uuid, String, i32, Option<String>)> = sqlx::query_as(
        "SELECT stream_id, failure_reason, attempts_when_dlq, error_text FROM wh_dead_letters",
    )
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    assert_eq!(dead.len(), 1);
    let (stream, reason, attempts, error) = &dead[0];
    assert_eq!(*stream, streams[0]);
    assert_eq!(reason, "PermanentFailure");
    assert_eq!(*attempts, 1, "dead-lettered on its first claim");
    assert!(
        error.as_deref().unwrap_or("").contains("no longer exists"),
        "{error:?}"
    );
    let applied: Vec<Uuid> = sqlx::query_scalar("SELECT stream_id FROM marked")
        .fetch_all(env.store.pool())
        .await
        .unwrap();
    assert_eq!(applied, vec![streams[1]]);
}

/// A handler that never finishes cannot hold shutdown hostage: after the grace its batch is
/// abandoned (rolled back), its rows are given back (not refunded: its handler had started),
/// and the daemon stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_handler_is_abandoned_after_the_grace() {
    let env = env().await;
    create_deliveries(&env).await;
    let mut s = settings(&env, "");
    s.worker.shutdown_grace = Duration::from_secs(1);
    let seen = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    let daemon = DaemonBuilder::new(s)
        .store(env.store.clone())
        .without_http()
        .perspective(Recorder {
            name: "stuck".into(),
            delay: Duration::from_secs(600),
            seen: seen.clone(),
        })
        .start()
        .await
        .unwrap();
    append(
        &env,
        Uuid::new_v4(),
        vec![ev("Stuck", serde_json::json!({}))],
    )
    .await;
    // The handler has been handed the event (and sleeps): it has started. (Not read off the
    // server's advisory locks: a claim holds exclusive ones too, its lane-insert buckets, for
    // a moment before any handler runs.)
    let waited = Instant::now();
    while seen.lock().unwrap().is_empty() {
        assert!(
            waited.elapsed() < Duration::from_secs(30),
            "the handler was never called"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let started = Instant::now();
    daemon.shutdown().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(1) + Duration::from_secs(5),
        "shutdown took {:?} with a 1 s grace",
        started.elapsed()
    );
    assert_eq!(env.scalar("SELECT count(*) FROM deliveries").await, 0);
    let (leased, attempts): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE instance_id IS NOT NULL), coalesce(sum(attempts), 0)::bigint \
         FROM wh_perspective_events",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    // Issue #7, defect 7: the handler had started, so its claim is not refunded (before, every
    // give-back refunded one attempt and attempts undercounted).
    assert_eq!(
        (leased, attempts),
        (0, 1),
        "given back, and the attempt its handler used kept"
    );
    // The abandoned batch's transaction is rolled back, not left open on the server.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let open = env
            .scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND state LIKE 'idle in transaction%'",
            )
            .await;
        if open == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the stuck batch still holds an open transaction"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A producer's append held open (a bulk import that touched a stream with work, then stalled)
/// stops nothing: every other stream keeps being applied while it is open, the held stream's
/// earlier events are applied too, and its held event is applied right after the commit, on
/// its first claim. Catches: lane bookkeeping the producer writes (a completion or give-back of
/// that lane then waits for the producer, and the consumer loop with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_holding_an_append_open_does_not_freeze_the_drain() {
    let env = env().await;
    create_applied_table(&env, "alpha").await;
    let mut s = settings(&env, &recording_perspective("alpha", &["Placed"]));
    s.worker.consumers = 1;
    let daemon = start(&env, s).await;

    let held = Uuid::new_v4();
    append(&env, held, vec![ev("Placed", serde_json::json!({}))]).await;
    let mut producer = env.store.pool().begin().await.unwrap();
    sqlx::query("SELECT * FROM append_events($1, NULL, $2)")
        .bind(held)
        .bind(serde_json::json!([{ "event_type": "Placed" }]))
        .execute(&mut *producer)
        .await
        .unwrap();

    // While it is open: 50 new streams, and more events on the held stream's lane before it.
    let others: Vec<Uuid> = (0..50).map(|_| Uuid::new_v4()).collect();
    for s in &others {
        append(&env, *s, vec![ev("Placed", serde_json::json!({}))]).await;
    }
    env.wait_until(
        "SELECT count(*) FROM applied_alpha",
        51,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        env.scalar("SELECT count(*) FROM applied_alpha WHERE version = 2")
            .await,
        0,
        "the held event is not visible yet"
    );

    producer.commit().await.unwrap();
    wait_drained(&env, Duration::from_secs(30)).await;
    assert_eq!(env.scalar("SELECT count(*) FROM applied_alpha").await, 52);
    assert_in_stream_order(&env, "alpha").await;
    daemon.shutdown().await.unwrap();
}

/// Work rows restored with triggers disabled (a data-only restore) have no lane in the index
/// and no wake-up; the daemon's reconciliation finds them at start-up, repairs the lanes
/// (counted in vantage_lanes_repaired_total) and the events are applied. Catches: no safety
/// net (such rows stay pending forever, "Pending" with no reason).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_restored_without_its_lanes_is_repaired_and_applied() {
    let env = env().await;
    create_applied_table(&env, "alpha").await;
    env.store
        .register_perspective("alpha", &["Placed".to_string()])
        .await
        .unwrap();
    let streams: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
    // The restore: events and work rows written with every trigger off.
    let mut restore = env.store.pool().begin().await.unwrap();
    sqlx::query("SET LOCAL session_replication_role = replica")
        .execute(&mut *restore)
        .await
        .unwrap();
    for s in &streams {
        for v in 1..=2 {
            sqlx::query(
                "WITH e AS (INSERT INTO wh_event_store (stream_id, stream_version, event_type) \
                            VALUES ($1, $2, 'Placed') RETURNING *) \
                 INSERT INTO wh_perspective_events \
                     (stream_id, event_id, global_position, stream_version, perspective_name) \
                 SELECT stream_id, event_id, global_position, stream_version, 'alpha' FROM e",
            )
            .bind(s)
            .bind(v)
            .execute(&mut *restore)
            .await
            .unwrap();
        }
    }
    restore.commit().await.unwrap();

    let daemon = start(
        &env,
        settings(&env, &recording_perspective("alpha", &["Placed"])),
    )
    .await;
    wait_drained(&env, Duration::from_secs(30)).await;
    assert_eq!(env.scalar("SELECT count(*) FROM applied_alpha").await, 10);
    assert_in_stream_order(&env, "alpha").await;
    daemon.shutdown().await.unwrap();
}

/// Counts its calls per event and fails one event on every call.
struct FailsOne {
    poison: i64,
    calls: std::sync::Mutex<std::collections::HashMap<i64, u32>>,
}

impl FailsOne {
    fn calls(&self, position: i64) -> u32 {
        self.calls
            .lock()
            .unwrap()
            .get(&position)
            .copied()
            .unwrap_or(0)
    }
}

#[async_trait]
impl Perspective for FailsOne {
    fn name(&self) -> &str {
        "fails_one"
    }

    fn event_types(&self) -> Vec<String> {
        vec!["E".into()]
    }

    async fn apply(&self, e: &EventEnvelope, _tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        *self
            .calls
            .lock()
            .unwrap()
            .entry(e.global_position)
            .or_default() += 1;
        if e.global_position == self.poison {
            return Err(ApplyError::Retryable("fails every time".into()));
        }
        Ok(())
    }
}

/// A row that failed before usually fails again. When such a retry shared a batch with healthy
/// rows, its failure rolled back the optimistic pass and every healthy row of the batch was
/// applied a second time in the careful pass: during the soak's requeue of 7 500 dead letters
/// nearly every batch held a retry, and the other perspectives' lag stayed at 1–3 s for
/// minutes. A lane holding a retry goes straight to the careful pass; the others apply once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_in_a_batch_does_not_make_its_healthy_rows_apply_twice() {
    use vantage::config::WorkerSettings;
    use vantage::internals::perspective::PerspectiveRegistry;
    use vantage::internals::pipeline::Pipeline;
    use vantage::internals::store::{InstanceInfo, StoreInternals as _};
    use vantage::store::InstanceId;

    let env = env().await;
    sqlx::query("SELECT register_perspective($1, $2)")
        .bind("fails_one")
        .bind(vec!["E".to_string()])
        .execute(env.store.pool())
        .await
        .unwrap();
    let poison = env
        .append(Uuid::new_v4(), &[("E", serde_json::json!({}))])
        .await[0]
        .global_position;
    let perspective = Arc::new(FailsOne {
        poison,
        calls: Default::default(),
    });
    let instance = InstanceId::new();
    env.store
        .heartbeat(instance, &InstanceInfo::current("test"))
        .await
        .unwrap();
    let mut registry = PerspectiveRegistry::new();
    registry.add(perspective.clone()).unwrap();
    let worker = WorkerSettings {
        retry_backoff_base: Duration::from_millis(10),
        retry_backoff_max: Duration::from_millis(10),
        ..WorkerSettings::default()
    };
    let pipeline = Pipeline::new(env.store.clone(), instance, registry, None, &worker);

    // The poison event fails alone: now it is a retry.
    let first = pipeline.drain_once().await.unwrap();
    assert_eq!((first.claimed, first.batch.failed), (1, 1));
    // Healthy events on other streams, and the retry due again: one batch takes them all.
    let mut healthy = Vec::new();
    for _ in 0..5 {
        let appended = env
            .append(Uuid::new_v4(), &[("E", serde_json::json!({}))])
            .await;
        healthy.push(appended[0].global_position);
    }
    env.wait_until(
        "SELECT count(*) FROM wh_perspective_events WHERE failures = 1 AND scheduled_for <= now()",
        1,
        Duration::from_secs(10),
    )
    .await;
    let calls_before = perspective.calls(poison);
    let second = pipeline.drain_once().await.unwrap();
    assert_eq!(
        (second.claimed, second.batch.applied, second.batch.failed),
        (6, 5, 1)
    );
    for p in &healthy {
        assert_eq!(perspective.calls(*p), 1, "healthy event {p} applied once");
    }
    assert_eq!(
        perspective.calls(poison) - calls_before,
        1,
        "the retry is tried once, carefully"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM wh_perspective_events")
            .await,
        1,
        "only the retry is left"
    );
}
