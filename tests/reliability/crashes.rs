//! Reliability (docs/operations.md, "Reliability and security"): crashes (SIGKILL), a PostgreSQL
//! restart, and poison events, against a real PostgreSQL. Every test has a hard deadline and fails
//! with what it saw instead of hanging.
//!
//! The read models are plain INSERTs with a primary key on (stream_id, version), so a second
//! apply of any event fails loudly (a failed apply is recorded on the work row, and its error
//! text shows up in the PostgreSQL log), and a sequence number records the apply order.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use uuid::Uuid;
use vantage::config::Settings;
use vantage::daemon::DaemonBuilder;
use vantage::store::{NewEvent, Store, StoreOptions};
use vantage::throwaway::ThrowawayPostgres;

use crate::support;
use crate::support::process::{self, Daemon};

pub(super) async fn connect(url: &str) -> Store {
    Store::connect(&StoreOptions::for_url(url))
        .await
        .expect("connect to the test database")
}

/// `applied_<name>`: one row per apply; the primary key refuses a second apply of one event.
async fn create_read_model(store: &Store, name: &str) {
    process::exec(
        store,
        &format!(
            "CREATE SEQUENCE {name}_seq; \
             CREATE TABLE {name}_applied (stream_id uuid NOT NULL, version int NOT NULL, \
                 position bigint NOT NULL, seq bigint NOT NULL, \
                 CONSTRAINT {name}_applied_pkey PRIMARY KEY (stream_id, version))"
        ),
    )
    .await;
}

/// The SQL perspective `name` on event type `Tick`, writing `<name>_applied`.
fn perspective_toml(name: &str) -> String {
    format!(
        r#"
[[perspectives]]
name = "{name}"
events = ["Tick"]
[perspectives.sql]
Tick = "INSERT INTO {name}_applied (stream_id, version, position, seq) VALUES ($2, $6, $5, nextval('{name}_seq'))"
"#
    )
}

/// Appends `per_stream` events to each of `streams` new streams, `tasks` streams at a time.
pub(super) async fn append_backlog(store: &Store, streams: usize, per_stream: usize, tasks: usize) {
    let per_task = streams.div_ceil(tasks);
    let mut handles = Vec::new();
    for t in 0..tasks {
        let store = store.clone();
        let n = per_task.min(streams.saturating_sub(t * per_task));
        handles.push(tokio::spawn(async move {
            for _ in 0..n {
                let events: Vec<NewEvent> = (1..=per_stream)
                    .map(|v| NewEvent::new("Tick", serde_json::json!({ "v": v })))
                    .collect();
                store
                    .append_events(Uuid::new_v4(), Some(0), &events)
                    .await
                    .expect("append");
            }
        }));
    }
    for h in handles {
        h.await.expect("append task");
    }
}

/// What the monitor saw of the queue.
#[derive(Debug, Default)]
struct Seen {
    /// Highest `attempts` seen on any work row.
    max_attempts: i32,
    /// Work rows seen with attempts > 1 (taken over at least once), summed over polls.
    taken_over_rows: i64,
}

/// One look at the queue; panics at once on a recorded apply failure or a dead letter, which
/// in these tests can only mean a double apply or a charged healthy event.
async fn check_queue(store: &Store, name: &str, seen: &mut Seen) -> (i64, i64) {
    let (remaining, failed, max_attempts, retried, last_error): (
        i64,
        i64,
        i32,
        i64,
        Option<String>,
    ) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE failures > 0), coalesce(max(attempts), 0), \
                    count(*) FILTER (WHERE attempts > 1), max(last_error) \
             FROM wh_perspective_events",
    )
    .fetch_one(store.pool())
    .await
    .expect("poll the queue");
    assert_eq!(
        failed, 0,
        "an apply failed ({failed} row(s) with failures > 0); last_error: {last_error:?}"
    );
    let dead: i64 = process::scalar(store, "SELECT count(*) FROM wh_dead_letters").await;
    assert_eq!(dead, 0, "a healthy event was dead-lettered");
    seen.max_attempts = seen.max_attempts.max(max_attempts);
    seen.taken_over_rows += retried;
    let applied = process::scalar(store, &format!("SELECT count(*) FROM {name}_applied")).await;
    (remaining, applied)
}

/// The read model holds every event of the store exactly once, applied in stream order, and
/// nothing is left queued or dead-lettered.
async fn assert_exactly_once_in_order(store: &Store, name: &str, total: i64) {
    let t = format!("{name}_applied");
    assert_eq!(
        process::scalar(store, &format!("SELECT count(*) FROM {t}")).await,
        total,
        "{name}: every event applied exactly once"
    );
    assert_eq!(
        process::scalar(
            store,
            &format!(
                "SELECT count(*) FROM wh_event_store e LEFT JOIN {t} a \
                 ON a.stream_id = e.stream_id AND a.version = e.stream_version \
                 WHERE a.stream_id IS NULL OR a.position <> e.global_position"
            )
        )
        .await,
        0,
        "{name}: an event is missing from the read model (or recorded at the wrong position)"
    );
    assert_eq!(
        process::scalar(
            store,
            &format!(
                "SELECT count(*) FROM (SELECT seq < lag(seq) OVER (PARTITION BY stream_id ORDER BY version) AS bad \
                 FROM {t}) x WHERE bad"
            )
        )
        .await,
        0,
        "{name}: events applied out of stream order"
    );
    assert_eq!(
        process::scalar(store, "SELECT count(*) FROM wh_perspective_events").await,
        0,
        "{name}: work left queued"
    );
    assert_eq!(
        process::scalar(store, "SELECT count(*) FROM wh_dead_letters").await,
        0,
        "{name}: healthy events dead-lettered"
    );
}

/// Occurrences of `needle` in the log of the shared throwaway server (`None` when the tests
/// run against `DATABASE_URL`, whose log we cannot read).
async fn server_log_count(needle: &'static str) -> Option<usize> {
    tokio::task::spawn_blocking(move || {
        let server = support::throwaway_server()?;
        let log = std::fs::read_to_string(server.log_path()).ok()?;
        Some(log.matches(needle).count())
    })
    .await
    .expect("read the server log")
}

// ---------------------------------------------------------------------------------------------
// 1. Crash: three daemon processes, one SIGKILLed every 2-4 s.

const CRASH_STREAMS: usize = 1_000;
const CRASH_EVENTS_PER_STREAM: usize = 100;
const CRASH_DEADLINE: Duration = Duration::from_secs(300);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_three_daemons_sigkilled_every_few_seconds_apply_100k_events_exactly_once() {
    let name = "crash";
    let db = support::fresh_database().await;
    let store = connect(&db.url).await;
    store.migrate().await.unwrap();
    create_read_model(&store, name).await;
    store
        .register_perspective(name, &["Tick".to_string()])
        .await
        .unwrap();

    let total = (CRASH_STREAMS * CRASH_EVENTS_PER_STREAM) as i64;
    let started = Instant::now();
    append_backlog(&store, CRASH_STREAMS, CRASH_EVENTS_PER_STREAM, 4).await;
    let appended_in = started.elapsed();
    assert_eq!(
        process::scalar(&store, "SELECT count(*) FROM wh_perspective_events").await,
        total
    );

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("vantage.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[database]
url = "{url}"
[worker]
consumers = 2
lease = "5s"
# Small batches (50): more claims and lease changes for the kills to land in (with
# set-wise applies, batches of 500 drain the backlog in a few seconds).
batch_size = 50
[orphans]
heartbeat_interval = "500ms"
stale_after = "3s"
[http]
listen = "127.0.0.1:0"
[log]
level = "warn"
{perspective}"#,
            url = db.url,
            perspective = perspective_toml(name)
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap().to_owned();
    let mut generation = 0;
    let spawn = |generation: &mut usize| {
        *generation += 1;
        Daemon::spawn(
            process::vantage(dir.path(), &["--config", &config, "run"], &[]),
            dir.path(),
            &format!("vantage-{generation}"),
        )
    };
    let mut daemons: Vec<Daemon> = (0..3).map(|_| spawn(&mut generation)).collect();

    let drain_started = Instant::now();
    // Kills land at points of the drain's progress, each on a daemon that holds leases at that
    // moment: whether the crash path is exercised depends neither on the machine's speed (a
    // drain faster than a fixed kill schedule once met too few kills) nor on luck (a random
    // victim between two batches holds nothing: three such kills once exercised nothing).
    const KILL_AT: [i64; 3] = [5, 35, 65];
    let mut kills = 0;
    let mut kills_holding_leases = 0;
    let mut leases_at_kill = 0i64;
    let mut seen = Seen::default();
    loop {
        for d in daemons.iter_mut() {
            if let Some(code) = d.try_exit() {
                panic!(
                    "{} exited on its own ({code:?}); log:\n{}",
                    d.name,
                    d.log_tail(40)
                );
            }
        }
        let (remaining, applied) = check_queue(&store, name, &mut seen).await;
        if remaining == 0 && applied == total {
            break;
        }
        assert!(
            drain_started.elapsed() < CRASH_DEADLINE,
            "not drained after {CRASH_DEADLINE:?}: {applied} of {total} applied, {remaining} queued, \
             {kills} kills; logs:\n{}",
            daemons
                .iter()
                .map(|d| format!("== {}\n{}", d.name, d.log_tail(15)))
                .collect::<Vec<_>>()
                .join("\n")
        );
        if kills < KILL_AT.len() && applied * 100 >= KILL_AT[kills] * total {
            // The first daemon found holding leases (asked again every 10 ms, for at most 5 s;
            // then the first one, holding or not, and the assertion below says so).
            let asked = Instant::now();
            let (victim, held) = loop {
                let mut found = None;
                for (i, d) in daemons.iter().enumerate() {
                    let held: i64 = sqlx::query_scalar(
                        "SELECT count(*) FROM wh_perspective_events WHERE instance_id IN \
                         (SELECT instance_id FROM wh_service_instances WHERE process_id = $1)",
                    )
                    .bind(d.pid)
                    .fetch_one(store.pool())
                    .await
                    .unwrap();
                    if held > 0 {
                        found = Some((i, held));
                        break;
                    }
                }
                match found {
                    Some(f) => break f,
                    None if asked.elapsed() > Duration::from_secs(5) => break (0, 0),
                    None => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            };
            daemons[victim].kill9().await;
            kills += 1;
            leases_at_kill += held;
            if held > 0 {
                kills_holding_leases += 1;
            }
            // The two others keep running while the replacement starts.
            daemons[victim] = spawn(&mut generation);
            continue;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let drained_in = drain_started.elapsed();

    // The survivors stop gracefully.
    for d in daemons.iter_mut() {
        if d.try_exit().is_none() {
            d.signal(Signal::SIGTERM);
        }
    }
    for d in daemons.iter_mut() {
        let code = d.wait(Duration::from_secs(60)).await;
        assert_eq!(
            code,
            Some(0),
            "{} did not exit 0 after SIGTERM; log:\n{}",
            d.name,
            d.log_tail(40)
        );
    }
    eprintln!(
        "crash: {total} events appended in {appended_in:?}, drained in {drained_in:?} \
         ({:.0} events/s) by {generation} processes; {kills} SIGKILLs ({kills_holding_leases} \
         while holding leases, {leases_at_kill} leases in total); max attempts seen {}, \
         rows seen with attempts > 1 (summed over polls) {}",
        total as f64 / drained_in.as_secs_f64(),
        seen.max_attempts,
        seen.taken_over_rows
    );
    // No process of any generation panicked or hit an unexpected error.
    for g in 1..=generation {
        let log = std::fs::read_to_string(dir.path().join(format!("vantage-{g}.log")))
            .unwrap_or_default();
        assert!(!log.contains("panicked"), "vantage-{g} panicked:\n{log}");
        assert!(
            !log.contains("drain pass failed"),
            "vantage-{g} had a failed drain pass:\n{log}"
        );
    }

    assert_exactly_once_in_order(&store, name, total).await;
    assert_eq!(
        process::scalar(
            &store,
            "SELECT count(*) FROM wh_perspective_events WHERE instance_id IS NOT NULL"
        )
        .await,
        0
    );
    // The primary key never refused a second apply (the server log would name it).
    if let Some(refusals) = server_log_count("crash_applied_pkey").await {
        assert_eq!(refusals, 0, "a double apply was refused by the primary key");
    }
    assert!(
        kills >= 2,
        "only {kills} kill(s): the drain was too short to test anything"
    );
    assert!(
        kills_holding_leases >= 1,
        "no kill hit a process holding leases: the crash path was not exercised"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. PostgreSQL restarted mid-drain.

/// Longer than the longest liveness limit of a daemon loop (30 s).
const OUTAGE: Duration = Duration::from_secs(35);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_mid_drain_is_survived_and_the_drain_completes_exactly_once() {
    let name = "restart";
    // Our own server, never the shared one nor DATABASE_URL: we stop it.
    let server = tokio::task::spawn_blocking(ThrowawayPostgres::start)
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("cannot start a throwaway PostgreSQL: {e}"));
    let server = Arc::new(server);
    let url = server.url();
    let store = connect(&url).await;
    store.migrate().await.unwrap();
    create_read_model(&store, name).await;

    let settings = Settings::from_toml_str(&format!(
        r#"
[database]
url = "{url}"
connect_timeout = "30s"
[worker]
consumers = 2
lease = "10s"
poll_interval = "30s"
shutdown_grace = "5s"
[orphans]
heartbeat_interval = "500ms"
stale_after = "10s"
{perspective}"#,
        perspective = perspective_toml(name)
    ))
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let daemon = DaemonBuilder::new(settings)
        .http_listener(listener)
        .start()
        .await
        .expect("daemon starts");
    let addr = daemon.http_addr().expect("http is on");
    process::wait_http_status(addr, "/readyz", 200, Duration::from_secs(10)).await;

    let total = 20_000i64;
    append_backlog(&store, 200, 100, 4).await;

    let mut seen = Seen::default();
    let started = Instant::now();
    loop {
        let (_, applied) = check_queue(&store, name, &mut seen).await;
        if applied >= 1_000 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the drain never started ({applied} applied)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let applied_before =
        process::scalar(&store, &format!("SELECT count(*) FROM {name}_applied")).await;
    assert!(
        applied_before < total,
        "drained before the restart: nothing tested"
    );

    let (status, body) = process::http_get(addr, "/readyz")
        .await
        .expect("GET /readyz");
    assert_eq!(status, 200, "/readyz before the outage: {body}");

    // Down for longer than any loop's liveness limit (30 s), as a real restart or failover may be.
    // /readyz must report it (the sampler pings every second); /healthz must not, or an
    // orchestrator would restart the daemon for a database outage (docs/operations.md,
    // "Configuration": a lost database is not fatal). Promptness and liveness are asserted at the
    // end, so the rest of the test still runs and reports.
    {
        let server = Arc::clone(&server);
        tokio::task::spawn_blocking(move || server.stop())
            .await
            .unwrap()
            .expect("stop PostgreSQL");
    }
    let down_at = Instant::now();
    let mut readyz_503_after = None;
    let mut readyz_back_to_200 = Vec::new();
    let mut healthz_failures = Vec::new();
    while down_at.elapsed() < OUTAGE {
        let t = down_at.elapsed();
        let (readyz, body) = process::http_get(addr, "/readyz")
            .await
            .expect("GET /readyz");
        if readyz == 503 {
            readyz_503_after.get_or_insert(t);
        } else if readyz_503_after.is_some() {
            readyz_back_to_200.push(format!("{t:.1?}: {readyz} {body}"));
        }
        let (healthz, body) = process::http_get(addr, "/healthz")
            .await
            .expect("GET /healthz");
        if healthz != 200 {
            healthz_failures.push(format!("{t:.1?}: {healthz} {body}"));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let readyz_503_after = readyz_503_after
        .unwrap_or_else(|| panic!("/readyz never reported the database outage in {OUTAGE:?}"));
    {
        let server = Arc::clone(&server);
        tokio::task::spawn_blocking(move || server.start_again())
            .await
            .unwrap()
            .expect("start PostgreSQL again");
    }
    let up_at = Instant::now();
    process::wait_http_status(addr, "/readyz", 200, Duration::from_secs(30)).await;
    let readyz_200_after = up_at.elapsed();

    // The drain resumes and completes.
    loop {
        let (remaining, applied) = check_queue(&store, name, &mut seen).await;
        if remaining == 0 && applied == total {
            break;
        }
        assert!(
            up_at.elapsed() < Duration::from_secs(120),
            "not drained 120 s after the restart: {applied} of {total} applied, {remaining} queued"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drained_after = up_at.elapsed();

    // New work is picked up at once: the LISTEN connection came back too (the poll interval
    // is 30 s, so only a notification can wake the idle consumers this fast).
    let idle_since = Instant::now();
    while idle_since.elapsed() < Duration::from_secs(2) {
        check_queue(&store, name, &mut seen).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    append_backlog(&store, 1, 10, 1).await;
    let appended_at = Instant::now();
    let grand_total = total + 10;
    loop {
        let (remaining, applied) = check_queue(&store, name, &mut seen).await;
        if remaining == 0 && applied == grand_total {
            break;
        }
        assert!(
            appended_at.elapsed() < Duration::from_secs(40),
            "events appended after the restart were not applied within 40 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let woken_after = appended_at.elapsed();
    daemon.shutdown().await.expect("graceful shutdown");

    assert_exactly_once_in_order(&store, name, grand_total).await;
    if let Ok(log) = std::fs::read_to_string(server.log_path()) {
        assert_eq!(
            log.matches("restart_applied_pkey").count(),
            0,
            "a double apply was refused by the primary key"
        );
    }
    eprintln!(
        "restart: {applied_before} of {total} applied before the stop; /readyz 503 after \
         {readyz_503_after:?}, 200 {readyz_200_after:?} after the start; drained \
         {drained_after:?} after the start; new work applied {woken_after:?} after its append; \
         max attempts seen {}; /healthz failed {} time(s) while down",
        seen.max_attempts,
        healthz_failures.len()
    );
    // The sampler pings every second: an outage shows on /readyz within a few seconds, and
    // recovery likewise; liveness holds throughout. Reported together.
    let mut problems = Vec::new();
    if readyz_503_after > Duration::from_secs(3) {
        problems.push(format!(
            "/readyz still answered 200 {readyz_503_after:?} after the database went down"
        ));
    }
    if readyz_200_after > Duration::from_secs(3) {
        problems.push(format!(
            "/readyz still answered 503 {readyz_200_after:?} after the database came back"
        ));
    }
    if woken_after > Duration::from_secs(5) {
        problems.push(format!(
            "events appended after the restart waited {woken_after:?} (the 30 s poll?): the \
             LISTEN connection did not come back"
        ));
    }
    if !readyz_back_to_200.is_empty() {
        problems.push(format!(
            "/readyz answered 200 again while the database was still down: {readyz_back_to_200:?}"
        ));
    }
    if let (Some(first), Some(last)) = (healthz_failures.first(), healthz_failures.last()) {
        let loops: BTreeSet<&str> = healthz_failures
            .iter()
            .filter_map(|f| f.split("loop ").nth(1)?.split(' ').next())
            .collect();
        problems.push(format!(
            "/healthz failed {} time(s) while only the database was down (an orchestrator \
             would restart the daemon), blaming loops {loops:?}; first: {first}; last: {last}",
            healthz_failures.len()
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// 3. Poison events.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_events_are_dead_lettered_after_exactly_max_plus_one_claims_and_streams_go_on() {
    const MAX: i32 = 3;
    const STREAMS: usize = 16;
    const PER_STREAM: i32 = 10;
    let name = "poison";
    let db = support::fresh_database().await;
    let store = connect(&db.url).await;
    store.migrate().await.unwrap();
    process::exec(
        &store,
        "CREATE SEQUENCE poison_seq; \
         CREATE TABLE poison_applied (stream_id uuid NOT NULL, version int NOT NULL, \
             n int NOT NULL, seq bigint NOT NULL, PRIMARY KEY (stream_id, version))",
    )
    .await;
    store
        .register_perspective(name, &["Counted".to_string()])
        .await
        .unwrap();

    // Poison versions per stream: first, last, middle, two apart, two adjacent, first and
    // last; the remaining streams are healthy.
    let poison_at: [&[i32]; 6] = [
        &[1],
        &[PER_STREAM],
        &[5],
        &[2, 8],
        &[4, 5],
        &[1, PER_STREAM],
    ];
    let streams: Vec<Uuid> = (0..STREAMS).map(|_| Uuid::new_v4()).collect();
    let mut poison = BTreeSet::new();
    let mut healthy = BTreeSet::new();
    for (i, stream) in streams.iter().enumerate() {
        let bad = poison_at.get(i).copied().unwrap_or(&[]);
        let events: Vec<NewEvent> = (1..=PER_STREAM)
            .map(|v| {
                let n = if bad.contains(&v) {
                    poison.insert((*stream, v));
                    serde_json::json!("poison")
                } else {
                    healthy.insert((*stream, v));
                    serde_json::json!(v)
                };
                NewEvent::new("Counted", serde_json::json!({ "n": n }))
            })
            .collect();
        store
            .append_events(*stream, Some(0), &events)
            .await
            .unwrap();
    }

    let mut settings = support::fast_settings(
        &db.url,
        &format!(
            r#"
[[perspectives]]
name = "{name}"
events = ["Counted"]
[perspectives.sql]
Counted = "INSERT INTO poison_applied (stream_id, version, n, seq) VALUES ($2, $6, ($1->>'n')::int, nextval('poison_seq'))"
"#
        ),
    );
    settings.worker.max_perspective_event_attempts = Some(MAX as u32);
    let daemon = DaemonBuilder::new(settings)
        .store(store.clone())
        .without_http()
        .start()
        .await
        .expect("daemon starts");
    let started = Instant::now();
    while process::scalar(&store, "SELECT count(*) FROM wh_perspective_events").await > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "poison test not drained after 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let drained_in = started.elapsed();
    daemon.shutdown().await.expect("graceful shutdown");

    type DeadRow = (Uuid, i32, i32, i32, String, String, String, i64);
    let dead: Vec<DeadRow> = sqlx::query_as(
        "SELECT d.stream_id, d.stream_version, d.attempts_when_dlq, d.failures_when_dlq, \
                d.failure_reason, coalesce(d.error_text, ''), d.status, \
                (SELECT count(*) FROM wh_dead_letter_history h \
                 WHERE h.dead_letter_id = d.dead_letter_id AND h.kind = 'Exhausted') \
         FROM wh_dead_letters d WHERE d.perspective_name = $1",
    )
    .bind(name)
    .fetch_all(store.pool())
    .await
    .unwrap();
    let dead_set: BTreeSet<(Uuid, i32)> = dead.iter().map(|r| (r.0, r.1)).collect();
    assert_eq!(
        dead_set, poison,
        "exactly the poison events are dead-lettered"
    );
    assert_eq!(dead.len(), poison.len(), "one dead letter per poison event");
    for (stream, version, attempts, failures, reason, error_text, status, exhausted) in &dead {
        let at = format!("stream {stream} version {version}");
        assert_eq!(*attempts, MAX + 1, "{at}: dead-lettered on claim max + 1");
        assert_eq!(
            *failures, MAX,
            "{at}: applied and failed on each of claims 1..=max, no more, no less"
        );
        assert_eq!(reason, "MaxAttemptsExceeded", "{at}");
        assert!(
            error_text.contains("invalid input syntax for type integer"),
            "{at}: the real error is kept: {error_text}"
        );
        assert_eq!(status, "exhausted", "{at}");
        assert_eq!(*exhausted, 1, "{at}: one Exhausted history record");
    }

    let applied: Vec<(Uuid, i32, i32)> =
        sqlx::query_as("SELECT stream_id, version, n FROM poison_applied")
            .fetch_all(store.pool())
            .await
            .unwrap();
    let applied_set: BTreeSet<(Uuid, i32)> = applied.iter().map(|r| (r.0, r.1)).collect();
    assert_eq!(
        applied_set, healthy,
        "every healthy event applied, and only those"
    );
    assert!(
        applied.iter().all(|(_, v, n)| v == n),
        "payloads applied as sent"
    );
    assert_eq!(
        process::scalar(
            &store,
            "SELECT count(*) FROM (SELECT seq < lag(seq) OVER (PARTITION BY stream_id ORDER BY version) AS bad \
             FROM poison_applied) x WHERE bad"
        )
        .await,
        0,
        "healthy events applied out of stream order"
    );
    let moves = process::metric_value(
        &vantage::internals::telemetry::recorder::render(),
        "vantage_dead_letter_moves_total",
        &[("perspective", name), ("reason", "MaxAttemptsExceeded")],
    );
    assert_eq!(moves, poison.len() as f64, "dead-letter moves counted");
    eprintln!(
        "poison: {} poison and {} healthy events settled in {drained_in:?}",
        poison.len(),
        healthy.len()
    );
}
