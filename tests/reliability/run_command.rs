//! `vantage run` and `vantage migrate` as an operator meets them: the real binary, its exit codes
//! (docs/cli.md, "Exit codes": 0 graceful, 78 invalid configuration or newer schema, 69 database
//! unreachable) and its messages (docs/operations.md, "Reliability and security"). Every run has a
//! hard timeout, so a hang fails the test instead of hanging CI.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use uuid::Uuid;
use vantage::store::{NewEvent, Store, StoreOptions};

use crate::support;
use crate::support::process::{self, Daemon, Output};

/// Exit codes (docs/cli.md, "Exit codes").
const EXIT_CONFIG: i32 = 78;
const EXIT_UNAVAILABLE: i32 = 69;

/// Generous: only a hang should ever reach it.
const RUN_LIMIT: Duration = Duration::from_secs(60);

/// A valid SQL perspective writing to a table in `public` (which exists before the daemon
/// runs, while the `vantage` schema may not yet).
const GOOD_PERSPECTIVE: &str = r#"
[[perspectives]]
name = "cli_model"
events = ["Tick"]
[perspectives.sql]
Tick = "INSERT INTO public.cli_applied (stream_id, version) VALUES ($2, $6)"
"#;

fn write_config(dir: &Path, name: &str, url: Option<&str>, extra: &str) -> PathBuf {
    let database = match url {
        Some(url) => format!("[database]\nurl = \"{url}\"\n"),
        None => String::new(),
    };
    let path = dir.join(name);
    std::fs::write(&path, format!("{database}{extra}")).expect("write the config file");
    path
}

fn config_arg(path: &Path) -> String {
    path.to_str().expect("temp paths are UTF-8").to_owned()
}

async fn connect(url: &str) -> Store {
    Store::connect(&StoreOptions::for_url(url))
        .await
        .expect("connect to the test database")
}

async fn run_vantage(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let out = process::run(process::vantage(dir, args, env), RUN_LIMIT).await;
    out.assert_no_panic();
    out
}

// ---------------------------------------------------------------------------------------------
// Invalid configuration: 78, the key and the value named, before anything else happens.

#[tokio::test]
async fn invalid_environment_value_exits_78_naming_key_and_value() {
    let dir = tempfile::tempdir().unwrap();
    // The database is never contacted: configuration is validated first.
    let url = format!("postgres://u@127.0.0.1:{}/db", process::closed_port());
    let config = write_config(dir.path(), "vantage.toml", Some(&url), GOOD_PERSPECTIVE);
    let out = run_vantage(
        dir.path(),
        &["--config", &config_arg(&config), "run"],
        &[("VANTAGE__WORKER__CONSUMERS", "abc")],
    )
    .await;
    assert_eq!(out.code, Some(EXIT_CONFIG), "{out:#?}");
    for want in ["worker.consumers", "abc", "VANTAGE__WORKER__CONSUMERS"] {
        assert!(
            out.stderr.contains(want),
            "stderr should name {want:?}: {out:#?}"
        );
    }
    assert!(out.stdout.is_empty(), "{out:#?}");
    assert!(out.elapsed < Duration::from_secs(10), "{out:#?}");

    // A bad duration, the same way.
    let out = run_vantage(
        dir.path(),
        &["--config", &config_arg(&config), "run"],
        &[("VANTAGE__WORKER__LEASE", "soon")],
    )
    .await;
    assert_eq!(out.code, Some(EXIT_CONFIG), "{out:#?}");
    for want in ["worker.lease", "soon", "VANTAGE__WORKER__LEASE"] {
        assert!(
            out.stderr.contains(want),
            "stderr should name {want:?}: {out:#?}"
        );
    }
}

#[tokio::test]
async fn unknown_key_in_the_file_exits_78_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("postgres://u@127.0.0.1:{}/db", process::closed_port());
    let config = write_config(
        dir.path(),
        "typo.toml",
        Some(&url),
        &format!("[worker]\nconsumer = 3\n{GOOD_PERSPECTIVE}"),
    );
    let out = run_vantage(dir.path(), &["--config", &config_arg(&config), "run"], &[]).await;
    assert_eq!(out.code, Some(EXIT_CONFIG), "{out:#?}");
    assert!(
        out.stderr.contains("unknown key worker.consumer"),
        "stderr should name the key: {out:#?}"
    );
    assert!(
        out.stderr.contains("typo.toml"),
        "stderr should name the file it came from: {out:#?}"
    );

    // `vantage migrate` validates the same way.
    let out = run_vantage(
        dir.path(),
        &["--config", &config_arg(&config), "migrate"],
        &[],
    )
    .await;
    assert_eq!(out.code, Some(EXIT_CONFIG), "{out:#?}");
    assert!(
        out.stderr.contains("unknown key worker.consumer"),
        "{out:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// A perspective statement that does not prepare: 78, perspective and event type named, nothing
// written.

#[tokio::test]
async fn unpreparable_statement_exits_78_and_writes_nothing() {
    let db = support::fresh_database().await;
    let store = connect(&db.url).await;
    store.migrate().await.unwrap();
    process::exec(
        &store,
        "CREATE TABLE public.cli_applied (stream_id uuid, version int, PRIMARY KEY (stream_id, version))",
    )
    .await;
    // Work already waiting for the valid perspective: the failed start must not touch it.
    store
        .register_perspective("cli_model", &["Tick".to_string()])
        .await
        .unwrap();
    for _ in 0..3 {
        let events: Vec<NewEvent> = (0..5)
            .map(|i| NewEvent::new("Tick", serde_json::json!({ "i": i })))
            .collect();
        store
            .append_events(Uuid::new_v4(), Some(0), &events)
            .await
            .unwrap();
    }
    let snapshot = work_rows(&store).await;
    let registered = registry(&store).await;
    assert_eq!(snapshot.len(), 15);

    let dir = tempfile::tempdir().unwrap();
    let broken = format!(
        "{GOOD_PERSPECTIVE}
[[perspectives]]
name = \"broken_model\"
events = [\"Tick\", \"Tock\"]
[perspectives.sql]
Tick = \"INSERT INTO public.cli_applied (stream_id, version) VALUES ($2, $6)\"
Tock = \"INSERT INTO public.no_such_table (stream_id) VALUES ($2)\"
"
    );
    let config = write_config(dir.path(), "vantage.toml", Some(&db.url), &broken);
    let out = run_vantage(
        dir.path(),
        &["--config", &config_arg(&config), "run"],
        &[("VANTAGE__HTTP__LISTEN", "127.0.0.1:0")],
    )
    .await;
    assert_eq!(out.code, Some(EXIT_CONFIG), "{out:#?}");
    for want in ["broken_model", "Tock", "no_such_table"] {
        assert!(
            out.stderr.contains(want),
            "stderr should name {want:?}: {out:#?}"
        );
    }

    // Nothing written: no instance registered, no work row claimed or changed, the broken
    // perspective not registered (so the producer fan-out never queues work for it), no read
    // model row, no dead letter.
    assert_eq!(
        process::scalar(&store, "SELECT count(*) FROM wh_service_instances").await,
        0,
        "an instance row was left registered"
    );
    assert_eq!(work_rows(&store).await, snapshot, "work rows were changed");
    assert_eq!(
        registry(&store).await,
        registered,
        "the registry was changed"
    );
    assert_eq!(
        process::scalar(&store, "SELECT count(*) FROM public.cli_applied").await,
        0
    );
    assert_eq!(
        process::scalar(&store, "SELECT count(*) FROM wh_dead_letters").await,
        0
    );
}

type WorkRowSnapshot = (Uuid, i32, i32, Option<Uuid>, Option<String>, String);

async fn work_rows(store: &Store) -> Vec<WorkRowSnapshot> {
    sqlx::query_as(
        "SELECT event_work_id, attempts, failures, instance_id, last_error, \
                coalesce(lease_expiry::text, '') || '/' || scheduled_for::text \
         FROM wh_perspective_events ORDER BY event_work_id",
    )
    .fetch_all(store.pool())
    .await
    .unwrap()
}

async fn registry(store: &Store) -> Vec<(String, Vec<String>, String)> {
    sqlx::query_as(
        "SELECT perspective_name, event_types, updated_at::text FROM wh_perspectives \
         ORDER BY perspective_name",
    )
    .fetch_all(store.pool())
    .await
    .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Unreachable database: 69 once connect_timeout has passed, host:port named, password never.

#[tokio::test]
async fn unreachable_database_exits_69_naming_host_and_port_but_not_the_password() {
    let dir = tempfile::tempdir().unwrap();
    let port = process::closed_port();
    let url = format!("postgres://u:secret@127.0.0.1:{port}/db");
    let config = write_config(dir.path(), "vantage.toml", None, GOOD_PERSPECTIVE);
    let out = run_vantage(
        dir.path(),
        &[
            "--config",
            &config_arg(&config),
            "--database-url",
            &url,
            "run",
        ],
        // http.listen is bound before connecting: a free port, whatever else runs here.
        &[
            ("VANTAGE__DATABASE__CONNECT_TIMEOUT", "2s"),
            ("VANTAGE__HTTP__LISTEN", "127.0.0.1:0"),
        ],
    )
    .await;
    assert_eq!(out.code, Some(EXIT_UNAVAILABLE), "{out:#?}");
    assert!(
        out.stderr.contains(&format!("127.0.0.1:{port}")),
        "stderr should name host:port: {out:#?}"
    );
    assert!(
        !out.stderr.contains("secret") && !out.stdout.contains("secret"),
        "the password leaked: {out:#?}"
    );
    assert!(
        out.elapsed < Duration::from_secs(2) + Duration::from_secs(5),
        "gave up {:?} after start, long after the 2 s connect_timeout: {out:#?}",
        out.elapsed
    );
    // stderr is a pipe here (a file, the journal): log lines carry no colour codes.
    assert!(
        out.stderr.contains("WARN") && !out.stderr.contains('\x1b'),
        "colour codes in a non-terminal stderr: {out:#?}"
    );
}

/// (docs/cli.md, "Exit codes"): 69 "once `database.connect_timeout` has passed (retrying with
/// backoff until then)". Giving up earlier turns a database that takes the whole timeout to come up
/// (a restart under an orchestrator) into a crash loop.
#[tokio::test]
async fn unreachable_database_is_retried_for_the_whole_connect_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "postgres://u:secret@127.0.0.1:{}/db",
        process::closed_port()
    );
    let config = write_config(dir.path(), "vantage.toml", None, GOOD_PERSPECTIVE);
    let out = run_vantage(
        dir.path(),
        &[
            "--config",
            &config_arg(&config),
            "--database-url",
            &url,
            "run",
        ],
        // http.listen is bound before connecting: a free port, whatever else runs here.
        &[
            ("VANTAGE__DATABASE__CONNECT_TIMEOUT", "2s"),
            ("VANTAGE__HTTP__LISTEN", "127.0.0.1:0"),
        ],
    )
    .await;
    assert_eq!(out.code, Some(EXIT_UNAVAILABLE), "{out:#?}");
    assert!(
        out.elapsed >= Duration::from_secs(2),
        "gave up after {:?}, before the 2 s connect_timeout had passed: {}",
        out.elapsed,
        out.stderr
    );
}

// ---------------------------------------------------------------------------------------------
// Graceful: readiness, metrics, SIGTERM → 0, deregistered, no lease held.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_work_deregisters_and_exits_0() {
    let db = support::fresh_database().await;
    // The read model lives in `public`; the daemon creates its own schema (auto_migrate).
    {
        let admin = connect(&db.url).await;
        process::exec(
            &admin,
            "CREATE TABLE public.cli_applied (stream_id uuid, version int, PRIMARY KEY (stream_id, version))",
        )
        .await;
        admin.close().await;
    }
    let dir = tempfile::tempdir().unwrap();
    // A few ms per event, so batches are still in flight when SIGTERM arrives.
    let perspective = r#"
[[perspectives]]
name = "cli_model"
events = ["Tick"]
[perspectives.sql]
Tick = "INSERT INTO public.cli_applied (stream_id, version) SELECT $2, $6 FROM pg_sleep(0.003)"
"#;
    let config = write_config(dir.path(), "vantage.toml", Some(&db.url), perspective);
    let grace = Duration::from_secs(5);
    let mut daemon = Daemon::spawn(
        process::vantage(
            dir.path(),
            &["--config", &config_arg(&config), "run"],
            &[
                ("VANTAGE__HTTP__LISTEN", "127.0.0.1:0"),
                ("VANTAGE__WORKER__SHUTDOWN_GRACE", "5s"),
                ("VANTAGE__LOG__LEVEL", "info"),
            ],
        ),
        dir.path(),
        "graceful",
    );
    let addr = daemon
        .wait_running(Duration::from_secs(30))
        .await
        .unwrap_or_else(|| {
            panic!(
                "the running line names no HTTP address:\n{}",
                daemon.log_tail(20)
            )
        });
    let store = connect(&db.url).await;

    // Phase 1: a small drain, then readiness and metrics.
    let mut total = 0i64;
    for _ in 0..10 {
        append(&store, Uuid::new_v4(), 20).await;
        total += 20;
    }
    wait_for(
        &store,
        "SELECT count(*) FROM wh_perspective_events",
        0,
        Duration::from_secs(60),
        &daemon,
    )
    .await;
    assert_eq!(
        process::scalar(&store, "SELECT count(*) FROM public.cli_applied").await,
        total
    );
    let (status, body) = process::http_get(addr, "/readyz")
        .await
        .expect("GET /readyz");
    assert_eq!(status, 200, "/readyz: {body}");
    let (status, body) = process::http_get(addr, "/healthz")
        .await
        .expect("GET /healthz");
    assert_eq!(status, 200, "/healthz: {body}");
    let (status, metrics) = process::http_get(addr, "/metrics")
        .await
        .expect("GET /metrics");
    assert_eq!(status, 200);
    let applied = process::metric_value(
        &metrics,
        "vantage_events_applied_total",
        &[("perspective", "cli_model")],
    );
    assert_eq!(
        applied, total as f64,
        "every event applied once in this process:\n{metrics}"
    );
    // Counters of things that have not happened are exported at 0 from the start, so a
    // dashboard shows 0 and Prometheus's increase() sees the first move after a start.
    for line in [
        "vantage_dead_letter_moves_total{perspective=\"cli_model\",reason=\"MaxAttemptsExceeded\"} 0",
        "vantage_dead_letter_moves_total{perspective=\"cli_model\",reason=\"PermanentFailure\"} 0",
        "vantage_cooldown_skips_total{perspective=\"cli_model\"} 0",
        "vantage_dead_letter_move_errors_total 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} missing:\n{metrics}");
    }

    let instances: Vec<Uuid> =
        sqlx::query_scalar("SELECT instance_id FROM wh_service_instances WHERE process_id = $1")
            .bind(daemon.pid)
            .fetch_all(store.pool())
            .await
            .unwrap();
    assert_eq!(instances.len(), 1, "the daemon registered itself once");
    let instance = instances[0];

    // Phase 2: a bigger backlog; SIGTERM while batches are in flight.
    for _ in 0..40 {
        append(&store, Uuid::new_v4(), 100).await;
        total += 100;
    }
    let started = Instant::now();
    loop {
        let held = process::scalar(
            &store,
            "SELECT count(*) FROM wh_perspective_events WHERE instance_id IS NOT NULL",
        )
        .await;
        let applied = process::scalar(&store, "SELECT count(*) FROM public.cli_applied").await;
        if held > 0 && applied > 200 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "phase 2 never got going (held {held}, applied {applied}):\n{}",
            daemon.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    daemon.signal(Signal::SIGTERM);
    let sent = Instant::now();
    let code = daemon.wait(Duration::from_secs(60)).await;
    let took = sent.elapsed();
    let log = daemon.log_text();
    assert_eq!(code, Some(0), "graceful shutdown exits 0; log:\n{log}");
    assert!(
        took <= grace,
        "exit took {took:?} after SIGTERM, more than shutdown_grace {grace:?}; log:\n{log}"
    );
    assert!(log.contains("vantage stopped"), "{log}");
    assert!(!log.contains("panicked"), "{log}");

    let registered: i64 =
        sqlx::query_scalar("SELECT count(*) FROM wh_service_instances WHERE instance_id = $1")
            .bind(instance)
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(registered, 0, "the instance is deregistered");
    assert_eq!(
        process::scalar(
            &store,
            "SELECT count(*) FROM wh_perspective_events WHERE instance_id IS NOT NULL OR lease_expiry IS NOT NULL"
        )
        .await,
        0,
        "no lease held after a graceful exit"
    );
    // Rows given back unstarted were refunded: nothing carries a charge.
    assert_eq!(
        process::scalar(
            &store,
            "SELECT count(*) FROM wh_perspective_events WHERE attempts > 0 OR failures > 0"
        )
        .await,
        0,
        "a graceful shutdown charged events"
    );
    // Nothing lost, nothing applied twice (the primary key would have refused it).
    let applied = process::scalar(&store, "SELECT count(*) FROM public.cli_applied").await;
    let remaining = process::scalar(&store, "SELECT count(*) FROM wh_perspective_events").await;
    assert_eq!(
        applied + remaining,
        total,
        "applied {applied} + queued {remaining}"
    );
    assert!(remaining > 0, "the shutdown was meant to interrupt a drain");
    assert_eq!(
        process::scalar(
            &store,
            "SELECT count(*) FROM wh_perspective_events pe JOIN public.cli_applied a \
             ON a.stream_id = pe.stream_id AND a.version = pe.stream_version"
        )
        .await,
        0,
        "a queued event is also in the read model"
    );
    assert_eq!(
        process::scalar(&store, "SELECT count(*) FROM wh_dead_letters").await,
        0
    );
    eprintln!("graceful: SIGTERM → exit 0 in {took:?}; {applied} applied, {remaining} left queued");
}

async fn append(store: &Store, stream: Uuid, n: usize) {
    let events: Vec<NewEvent> = (1..=n)
        .map(|v| NewEvent::new("Tick", serde_json::json!({ "v": v })))
        .collect();
    store
        .append_events(stream, Some(0), &events)
        .await
        .expect("append");
}

async fn wait_for(store: &Store, sql: &str, want: i64, limit: Duration, daemon: &Daemon) {
    let started = Instant::now();
    loop {
        let got = process::scalar(store, sql).await;
        if got == want {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "timed out waiting for `{sql}` = {want} (still {got}); log:\n{}",
            daemon.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Migrations: idempotent, and a schema newer than the binary is refused with 78.

#[tokio::test]
async fn migrate_twice_then_a_newer_schema_is_refused() {
    let db = support::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "vantage.toml", Some(&db.url), GOOD_PERSPECTIVE);
    let args = ["--config", &config_arg(&config), "migrate"];

    let first = run_vantage(dir.path(), &args, &[]).await;
    assert_eq!(first.code, Some(0), "{first:#?}");
    assert!(first.stdout.contains("Applied migration"), "{first:#?}");

    let second = run_vantage(dir.path(), &args, &[]).await;
    assert_eq!(second.code, Some(0), "{second:#?}");
    assert!(
        second.stdout.contains("nothing to apply") && !second.stdout.contains("Applied migration"),
        "the second migrate should say nothing was applied: {second:#?}"
    );

    // A later vantage has migrated this database.
    let store = connect(&db.url).await;
    process::exec(
        &store,
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (999999, 'from the future', true, '\\x00'::bytea, 0)",
    )
    .await;
    process::exec(
        &store,
        "CREATE TABLE public.cli_applied (stream_id uuid, version int, PRIMARY KEY (stream_id, version))",
    )
    .await;

    let out = run_vantage(dir.path(), &args, &[]).await;
    assert_eq!(out.code, Some(EXIT_CONFIG), "migrate: {out:#?}");
    assert_newer_schema_message(&out);

    let run_args = ["--config", &config_arg(&config), "run"];
    for auto_migrate in ["true", "false"] {
        let out = run_vantage(
            dir.path(),
            &run_args,
            &[
                ("VANTAGE__DATABASE__AUTO_MIGRATE", auto_migrate),
                ("VANTAGE__HTTP__LISTEN", "127.0.0.1:0"),
            ],
        )
        .await;
        assert_eq!(
            out.code,
            Some(EXIT_CONFIG),
            "run (auto_migrate = {auto_migrate}): {out:#?}"
        );
        assert_newer_schema_message(&out);
    }
    assert_eq!(
        process::scalar(&store, "SELECT count(*) FROM wh_service_instances").await,
        0,
        "a refused start registered an instance"
    );
    assert_eq!(
        process::scalar(&store, "SELECT count(*) FROM wh_perspectives").await,
        0,
        "a refused start registered perspectives"
    );
}

#[track_caller]
fn assert_newer_schema_message(out: &Output) {
    assert!(
        out.stderr.contains("newer than this binary") && out.stderr.contains("999999"),
        "stderr should say the schema is newer than the binary: {out:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Signals: handled from the first moment, SIGHUP ignored, a second signal has its own code.

/// README: a second SIGTERM/SIGINT exits at once with 130 (leases left to lapse).
const EXIT_FORCED: i32 = 130;

/// SIGTERM while the daemon still retries an unreachable database: a log line, exit 0.
#[tokio::test]
async fn sigterm_while_connecting_exits_0_with_a_log_line() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("postgres://u@127.0.0.1:{}/db", process::closed_port());
    let config = write_config(dir.path(), "vantage.toml", Some(&url), GOOD_PERSPECTIVE);
    let mut daemon = Daemon::spawn(
        process::vantage(
            dir.path(),
            &["--config", &config_arg(&config), "run"],
            &[
                ("VANTAGE__HTTP__LISTEN", "127.0.0.1:0"),
                ("VANTAGE__DATABASE__CONNECT_TIMEOUT", "60s"),
                ("VANTAGE__LOG__LEVEL", "info"),
            ],
        ),
        dir.path(),
        "connecting",
    );
    wait_for_log(
        &mut daemon,
        "database not reachable yet",
        Duration::from_secs(20),
    )
    .await;
    daemon.signal(Signal::SIGTERM);
    let code = daemon.wait(Duration::from_secs(10)).await;
    let log = daemon.log_text();
    assert_eq!(code, Some(0), "log:\n{log}");
    assert!(
        log.contains("during start-up"),
        "no log line says why it stopped:\n{log}"
    );
}

/// SIGTERM while the daemon waits inside a migration (the schema is being created by another
/// session that holds it): a log line, exit 0.
#[tokio::test]
async fn sigterm_while_migrating_exits_0_with_a_log_line() {
    use sqlx::Connection;
    let db = support::fresh_database().await;
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; CREATE SCHEMA vantage;")
        .execute(&mut holder)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "vantage.toml", Some(&db.url), GOOD_PERSPECTIVE);
    let mut daemon = Daemon::spawn(
        process::vantage(
            dir.path(),
            &["--config", &config_arg(&config), "run"],
            &[
                ("VANTAGE__HTTP__LISTEN", "127.0.0.1:0"),
                ("VANTAGE__LOG__LEVEL", "info"),
            ],
        ),
        dir.path(),
        "migrating",
    );
    let store = connect(&db.url).await;
    let started = Instant::now();
    loop {
        let waiting = process::scalar(
            &store,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND application_name LIKE 'vantage %' AND wait_event_type = 'Lock'",
        )
        .await;
        if waiting > 0 {
            break;
        }
        if let Some(code) = daemon.try_exit() {
            panic!("exited ({code:?}) before it waited:\n{}", daemon.log_text());
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the daemon never waited on the schema:\n{}",
            daemon.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    daemon.signal(Signal::SIGTERM);
    let code = daemon.wait(Duration::from_secs(10)).await;
    let log = daemon.log_text();
    // Its statement may still be queued behind our lock: end it before letting go. Only in
    // this test's database: the suite's other tests run their daemons on the same server (one
    // of them was killed at start-up by this statement, exit 69).
    process::exec(
        &store,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name LIKE 'vantage %'",
    )
    .await;
    let _ = sqlx::raw_sql("ROLLBACK").execute(&mut holder).await;
    assert_eq!(code, Some(0), "log:\n{log}");
    assert!(
        log.contains("during start-up"),
        "no log line says why it stopped:\n{log}"
    );
}

/// SIGHUP is ignored (logged); the daemon keeps running and still stops gracefully.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_is_ignored_and_the_daemon_keeps_running() {
    let db = support::fresh_database().await;
    let admin = connect(&db.url).await;
    process::exec(&admin, CLI_APPLIED).await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "vantage.toml", Some(&db.url), GOOD_PERSPECTIVE);
    let mut daemon = spawn_running(dir.path(), &config_arg(&config), &[], "sighup").await;
    let addr = daemon
        .wait_running(Duration::from_secs(30))
        .await
        .expect("HTTP address");
    daemon.signal(Signal::SIGHUP);
    wait_for_log(&mut daemon, "SIGHUP", Duration::from_secs(10)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        daemon.try_exit(),
        None,
        "SIGHUP ended the daemon:\n{}",
        daemon.log_text()
    );
    let (status, body) = process::http_get(addr, "/healthz")
        .await
        .expect("GET /healthz");
    assert_eq!(status, 200, "{body}");
    let log = drain_then_stop(&admin, &mut daemon).await;
    assert!(log.contains("vantage stopped"), "{log}");
    assert_eq!(
        process::scalar(&admin, "SELECT count(*) FROM wh_service_instances").await,
        0
    );
}

/// A second SIGTERM during the drain exits at once, with the forced-exit code (not 1, the code
/// of an internal error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_exits_at_once_with_its_own_code() {
    let db = support::fresh_database().await;
    let admin = connect(&db.url).await;
    process::exec(&admin, CLI_APPLIED).await;
    let slow = r#"
[[perspectives]]
name = "cli_model"
events = ["Tick"]
[perspectives.sql]
Tick = "INSERT INTO public.cli_applied (stream_id, version) SELECT $2, $6 FROM pg_sleep(20)"
"#;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "vantage.toml", Some(&db.url), slow);
    let mut daemon = spawn_running(
        dir.path(),
        &config_arg(&config),
        &[("VANTAGE__WORKER__SHUTDOWN_GRACE", "30s")],
        "second-signal",
    )
    .await;
    daemon.wait_running(Duration::from_secs(30)).await;
    append(&admin, Uuid::new_v4(), 1).await;
    let started = Instant::now();
    // The handler is running (a claim not yet applied would just be given back at once). Its
    // statement may be the top-level query or run inside the call that applies a batch
    // set-wise, so wait for the sleep itself rather than for a query text.
    while process::scalar(
        &admin,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'vantage %' \
         AND state = 'active' AND wait_event = 'PgSleep'",
    )
    .await
        == 0
    {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{}",
            daemon.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    daemon.signal(Signal::SIGTERM);
    wait_for_log(&mut daemon, "shutting down", Duration::from_secs(10)).await;
    daemon.signal(Signal::SIGTERM);
    let sent = Instant::now();
    let code = daemon.wait(Duration::from_secs(10)).await;
    let log = daemon.log_text();
    assert_eq!(code, Some(EXIT_FORCED), "log:\n{log}");
    assert!(
        sent.elapsed() < Duration::from_secs(5),
        "not at once: {:?}",
        sent.elapsed()
    );
    assert!(log.contains("second signal"), "{log}");
}

// ---------------------------------------------------------------------------------------------
// Least privilege: the daemon role of deploy/postgres/privileges.sql starts with the default
// auto_migrate = true when the schema is current, and is told what to do when it is not.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_role_starts_on_a_current_schema_and_gets_a_hint_otherwise() {
    // Roles are global to the server: only on the throwaway one.
    let db = support::fresh_database().await;
    if tokio::task::spawn_blocking(support::throwaway_server)
        .await
        .unwrap()
        .is_none()
    {
        eprintln!("DATABASE_URL is set: this test creates roles, so it needs the throwaway server");
        return;
    }
    let admin = connect(&db.url).await;
    admin.migrate().await.unwrap();
    process::exec(&admin, CLI_APPLIED).await;
    let privileges = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/postgres/privileges.sql"),
    )
    .unwrap();
    process::exec(&admin, &privileges).await;
    process::exec(
        &admin,
        "GRANT SELECT, INSERT ON public.cli_applied TO vantage_daemon",
    )
    .await;

    let mut url = url::Url::parse(&db.url).unwrap();
    url.set_username("vantage_daemon").unwrap();
    let url = url.to_string();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "vantage.toml", Some(&url), GOOD_PERSPECTIVE);
    let mut daemon = spawn_running(dir.path(), &config_arg(&config), &[], "daemon-role").await;
    let addr = daemon
        .wait_running(Duration::from_secs(30))
        .await
        .expect("HTTP address");
    process::wait_http_status(addr, "/readyz", 200, Duration::from_secs(10)).await;
    let log = drain_then_stop(&admin, &mut daemon).await;
    // Nothing was created, so the server had nothing to skip (and nothing to log at INFO).
    assert!(!log.contains("already exists, skipping"), "{log}");

    // A migration still to apply: the daemon role cannot, and is told how to proceed.
    process::exec(
        &admin,
        "DELETE FROM _sqlx_migrations WHERE version = (SELECT max(version) FROM _sqlx_migrations)",
    )
    .await;
    let out = run_vantage(
        dir.path(),
        &["--config", &config_arg(&config), "run"],
        &[("VANTAGE__HTTP__LISTEN", "127.0.0.1:0")],
    )
    .await;
    assert_eq!(out.code, Some(EXIT_CONFIG), "{out:#?}");
    for want in [
        "permission denied",
        "vantage migrate",
        "auto_migrate = false",
    ] {
        assert!(
            out.stderr.contains(want),
            "stderr should say {want:?}: {out:#?}"
        );
    }
    assert_eq!(
        process::scalar(&admin, "SELECT count(*) FROM wh_service_instances").await,
        0
    );
}

/// A start on a schema that is already current logs no "already exists, skipping" notice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_on_a_current_schema_logs_no_skipping_notice() {
    let db = support::fresh_database().await;
    let admin = connect(&db.url).await;
    admin.migrate().await.unwrap();
    process::exec(&admin, CLI_APPLIED).await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "vantage.toml", Some(&db.url), GOOD_PERSPECTIVE);
    let mut daemon = spawn_running(dir.path(), &config_arg(&config), &[], "current").await;
    daemon.wait_running(Duration::from_secs(30)).await;
    daemon.signal(Signal::SIGTERM);
    let code = daemon.wait(Duration::from_secs(30)).await;
    let log = daemon.log_text();
    assert_eq!(code, Some(0), "log:\n{log}");
    assert!(!log.contains("already exists, skipping"), "{log}");
}

/// The read model of [`GOOD_PERSPECTIVE`].
const CLI_APPLIED: &str =
    "CREATE TABLE public.cli_applied (stream_id uuid, version int, PRIMARY KEY (stream_id, version))";

/// Three events drained by `daemon`, then SIGTERM: exit 0. Returns its log.
async fn drain_then_stop(admin: &Store, daemon: &mut Daemon) -> String {
    append(admin, Uuid::new_v4(), 3).await;
    wait_for(
        admin,
        "SELECT count(*) FROM public.cli_applied",
        3,
        Duration::from_secs(30),
        daemon,
    )
    .await;
    daemon.signal(Signal::SIGTERM);
    let code = daemon.wait(Duration::from_secs(30)).await;
    let log = daemon.log_text();
    assert_eq!(code, Some(0), "log:\n{log}");
    log
}

async fn spawn_running(dir: &Path, config: &str, env: &[(&str, &str)], name: &str) -> Daemon {
    let mut all = vec![
        ("VANTAGE__HTTP__LISTEN", "127.0.0.1:0"),
        ("VANTAGE__LOG__LEVEL", "info"),
    ];
    all.extend_from_slice(env);
    Daemon::spawn(
        process::vantage(dir, &["--config", config, "run"], &all),
        dir,
        name,
    )
}

async fn wait_for_log(daemon: &mut Daemon, needle: &str, limit: Duration) {
    let started = Instant::now();
    loop {
        if daemon.log_text().contains(needle) {
            return;
        }
        if let Some(code) = daemon.try_exit() {
            panic!(
                "exited ({code:?}) before logging {needle:?}:\n{}",
                daemon.log_text()
            );
        }
        assert!(
            started.elapsed() < limit,
            "no {needle:?} in the log after {limit:?}:\n{}",
            daemon.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
