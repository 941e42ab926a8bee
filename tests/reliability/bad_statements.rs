//! Perspective statements that can never work, refused before anything is written (issue 7,
//! defects 10 and 11): a parameter beyond `$7`, a statement that ends or controls the
//! transaction, a subscribed type with no statement to run. And the `"*"` catch-all statement
//! really runs; an event that still has no statement is dead-lettered, never completed silently.
//!
//! The real binary, as an operator meets it: `vantage config check` (no database), `run`,
//! `status` and `perspectives list` all exit 78 naming the key, the perspective and the type.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use uuid::Uuid;
use vantage::config::{DatabaseUrl, PerspectiveSettings, Settings};
use vantage::daemon::DaemonBuilder;
use vantage::store::{NewEvent, Store, StoreOptions};

use crate::support;
use crate::support::process::{self, Daemon, Output};

const EXIT_CONFIG: i32 = 78;
const RUN_LIMIT: Duration = Duration::from_secs(60);

/// perspectives[0]: valid, so the bad one is perspectives[1] and the index in messages shows.
const GOOD: &str = r#"
[[perspectives]]
name = "good"
events = ["Tick"]
[perspectives.sql]
Tick = "INSERT INTO public.applied (perspective, event_id) VALUES ('good', $3)"
"#;

const READ_MODELS: &str = "
CREATE TABLE public.applied (perspective text NOT NULL, event_id uuid NOT NULL, event_type text);
CREATE TABLE public.special (event_id uuid NOT NULL);
";

fn write_config(dir: &Path, url: &str, perspectives: &str) -> PathBuf {
    let path = dir.join("vantage.toml");
    std::fs::write(
        &path,
        format!("[database]\nurl = \"{url}\"\n{perspectives}"),
    )
    .expect("write the config file");
    path
}

async fn vantage(dir: &Path, config: &Path, args: &[&str]) -> Output {
    let mut all = vec!["--config", config.to_str().unwrap()];
    all.extend_from_slice(args);
    let out = process::run(
        process::vantage(dir, &all, &[("VANTAGE__HTTP__LISTEN", "127.0.0.1:0")]),
        RUN_LIMIT,
    )
    .await;
    out.assert_no_panic();
    out
}

async fn connect(url: &str) -> Store {
    Store::connect(&StoreOptions::for_url(url))
        .await
        .expect("connect to the test database")
}

/// A migrated database with the read-model tables.
async fn database() -> (support::TestDatabase, Store) {
    let db = support::fresh_database().await;
    let store = connect(&db.url).await;
    store.migrate().await.unwrap();
    process::exec(&store, READ_MODELS).await;
    (db, store)
}

/// `bad` perspective entry: `events`, then the `[perspectives.sql]` lines, then `extra` keys.
fn bad(events: &str, sql: &str, extra: &str) -> String {
    format!("{GOOD}\n[[perspectives]]\nname = \"bad\"\nevents = {events}\n{extra}\n[perspectives.sql]\n{sql}\n")
}

struct Case {
    what: String,
    toml: String,
    /// The key, and what else the message must name (the event type, the keyword, …).
    key: &'static str,
    names: Vec<&'static str>,
}

fn cases() -> Vec<Case> {
    let tick = "INSERT INTO public.applied (perspective, event_id) VALUES ('bad', $3)";
    let mut cases = vec![
        Case {
            what: "a parameter beyond $7".into(),
            toml: bad(
                "[\"Tick\"]",
                "Tick = \"INSERT INTO public.applied (perspective, event_id, event_type) VALUES ('bad', $3, $8)\"",
                "",
            ),
            key: "perspectives[1].sql.Tick",
            names: vec!["'bad'", "'Tick'", "$8", "$1 to $7"],
        },
        Case {
            what: "a parameter beyond $7 after a comment and a literal holding $1".into(),
            toml: bad(
                "[\"Tick\"]",
                "Tick = \"SELECT '$1' -- $2\\n, $12\"",
                "",
            ),
            key: "perspectives[1].sql.Tick",
            names: vec!["'bad'", "'Tick'", "$12"],
        },
        Case {
            what: "a reset that uses a parameter".into(),
            toml: bad(
                "[\"Tick\"]",
                &format!("Tick = \"{tick}\""),
                "reset = \"DELETE FROM public.applied WHERE event_id = $1\"",
            ),
            key: "perspectives[1].reset",
            names: vec!["'bad'", "reset statement", "$1", "no parameters"],
        },
        Case {
            what: "a subscription to '*' without a '*' statement".into(),
            toml: bad("[\"*\"]", &format!("Tick = \"{tick}\""), ""),
            key: "perspectives[1].sql",
            names: vec!["'bad'", "'*'", "no \"*\" statement"],
        },
        Case {
            what: "a subscription to '*' and another type, neither with a statement".into(),
            toml: bad("[\"*\", \"Tock\"]", &format!("Tick = \"{tick}\""), ""),
            key: "perspectives[1].sql",
            names: vec!["'bad'", "'*'"],
        },
        Case {
            // Refused before this issue too; kept as a row of the table.
            what: "a listed type without a statement".into(),
            toml: bad("[\"Tick\", \"Tock\"]", &format!("Tick = \"{tick}\""), ""),
            key: "perspectives[1].sql",
            names: vec!["'bad'", "'Tock'"],
        },
    ];
    for (statement, keyword) in [
        ("COMMIT", "COMMIT"),
        ("  -- finish early\\n /* really */ commit", "COMMIT"),
        ("END", "END"),
        ("ROLLBACK", "ROLLBACK"),
        ("ABORT", "ABORT"),
        ("BEGIN", "BEGIN"),
        ("START TRANSACTION", "START TRANSACTION"),
        ("SAVEPOINT s", "SAVEPOINT"),
        ("RELEASE SAVEPOINT s", "RELEASE"),
        ("PREPARE TRANSACTION 'x'", "PREPARE TRANSACTION"),
        ("COMMIT PREPARED 'x'", "COMMIT PREPARED"),
        ("ROLLBACK PREPARED 'x'", "ROLLBACK PREPARED"),
    ] {
        cases.push(Case {
            what: format!("the statement {statement:?}"),
            toml: bad("[\"Tick\"]", &format!("Tick = \"{statement}\""), ""),
            key: "perspectives[1].sql.Tick",
            names: vec![
                "'bad'",
                "'Tick'",
                "ends or controls the transaction",
                keyword,
            ],
        });
    }
    for (statement, keyword) in [("COMMIT", "COMMIT"), ("/* */ Rollback", "ROLLBACK")] {
        cases.push(Case {
            what: format!("the reset {statement:?}"),
            toml: bad(
                "[\"Tick\"]",
                &format!("Tick = \"{tick}\""),
                &format!("reset = \"{statement}\""),
            ),
            key: "perspectives[1].reset",
            names: vec!["'bad'", "reset statement", keyword],
        });
    }
    cases
}

#[track_caller]
fn assert_refused(out: &Output, case: &Case, command: &str) {
    let label = format!("`{command}` with {} ({})", case.what, case.key);
    assert_eq!(out.code, Some(EXIT_CONFIG), "{label}: {out:#?}");
    let want_prefix = format!("invalid configuration: {}: perspective 'bad'", case.key);
    assert!(
        out.stderr.contains(&want_prefix),
        "{label}: stderr should name the key and the perspective ({want_prefix:?}): {out:#?}"
    );
    for want in &case.names {
        assert!(
            out.stderr.contains(want),
            "{label}: stderr should name {want:?}: {out:#?}"
        );
    }
    assert!(out.stdout.is_empty(), "{label}: {out:#?}");
}

/// Every bad input: `config check` (no database), then `run`, `status` and `perspectives list`
/// against a real one: 78, the key, perspective and type named, and nothing written.
#[tokio::test]
async fn bad_statements_are_refused_by_every_command_and_nothing_is_written() {
    let (db, store) = database().await;
    let dir = tempfile::tempdir().unwrap();
    for case in cases() {
        let config = write_config(dir.path(), &db.url, &case.toml);
        for command in [
            &["config", "check"][..],
            &["run"],
            &["status"],
            &["perspectives", "list"],
        ] {
            let out = vantage(dir.path(), &config, command).await;
            assert_refused(&out, &case, &command.join(" "));
        }
        // Nothing written: no perspective registered (so no work is ever queued for it), no
        // instance, no read-model row.
        for (what, sql) in [
            ("perspectives", "SELECT count(*) FROM wh_perspectives"),
            ("instances", "SELECT count(*) FROM wh_service_instances"),
            ("work rows", "SELECT count(*) FROM wh_perspective_events"),
            ("read-model rows", "SELECT count(*) FROM public.applied"),
        ] {
            assert_eq!(
                process::scalar(&store, sql).await,
                0,
                "{} left {what} behind",
                case.what
            );
        }
    }
}

/// The shipped configurations keep passing the new rules.
#[tokio::test]
async fn shipped_configurations_still_pass_config_check() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    for file in [
        "config/demo.toml",
        "config/vantage.example.toml",
        "deploy/systemd/vantage.toml.example",
    ] {
        let path = root.join(file);
        let out = process::run(
            process::vantage(
                dir.path(),
                &["--config", path.to_str().unwrap(), "config", "check"],
                &[],
            ),
            RUN_LIMIT,
        )
        .await;
        assert_eq!(out.code, Some(0), "{file}: {out:#?}");
    }
}

// ---------------------------------------------------------------------------------------------
// The start-up check: settings built in code skip file validation, so the daemon itself must
// refuse, after preparing, what PostgreSQL would accept and every apply would then reject.

fn settings(url: &str, perspective: PerspectiveSettings) -> Settings {
    let mut s = Settings::default();
    s.database.url = Some(DatabaseUrl::new(url));
    s.perspectives.push(perspective);
    s
}

fn perspective(events: &[&str], sql: &[(&str, &str)], reset: Option<&str>) -> PerspectiveSettings {
    PerspectiveSettings {
        name: "wide".into(),
        events: events.iter().map(|e| e.to_string()).collect(),
        sql: sql
            .iter()
            .map(|(t, s)| (t.to_string(), s.to_string()))
            .collect(),
        reset: reset.map(String::from),
        quarantine_after: None,
        ..Default::default()
    }
}

#[tokio::test]
async fn the_daemon_refuses_after_preparing_what_needs_unbound_parameters() {
    let (db, store) = database().await;
    let cases = [
        (
            // PostgreSQL infers $8 (text) and the statement prepares.
            perspective(
                &["Tick"],
                &[(
                    "Tick",
                    "INSERT INTO public.applied (perspective, event_id, event_type) VALUES ('wide', $3, $8)",
                )],
                None,
            ),
            "perspectives[0].sql.Tick: perspective 'wide', event type 'Tick': ",
            "$8",
        ),
        (
            perspective(
                &["Tick"],
                &[("Tick", "SELECT 1")],
                Some("DELETE FROM public.applied WHERE event_id = $1"),
            ),
            "perspectives[0].reset: perspective 'wide', reset statement: ",
            "$1",
        ),
        (
            perspective(&["Tick"], &[("Tick", "COMMIT")], None),
            "perspectives[0].sql.Tick: perspective 'wide', event type 'Tick': ",
            "COMMIT",
        ),
        (
            perspective(&["*"], &[("Tick", "SELECT 1")], None),
            "perspectives[0].sql: perspective 'wide', event type '*': ",
            "\"*\"",
        ),
    ];
    for (p, want, also) in cases {
        let started = DaemonBuilder::new(settings(&db.url, p))
            .store(store.clone())
            .without_http()
            .start()
            .await;
        let e = match started {
            Ok(daemon) => {
                let _ = daemon.shutdown().await;
                panic!("the daemon started with a statement that can never run ({want})");
            }
            Err(e) => e,
        };
        assert_eq!(e.exit_code(), EXIT_CONFIG, "{e}");
        let message = e.to_string();
        assert!(
            message.contains(want) && message.contains(also),
            "{message:?} should contain {want:?} and {also:?}"
        );
        assert_eq!(
            process::scalar(&store, "SELECT count(*) FROM wh_perspectives").await,
            0,
            "registered despite {message}"
        );
        assert_eq!(
            process::scalar(&store, "SELECT count(*) FROM wh_service_instances").await,
            0
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Running daemons

async fn append(store: &Store, events: &[&str]) -> usize {
    let events: Vec<NewEvent> = events
        .iter()
        .map(|t| NewEvent::new(*t, serde_json::json!({})))
        .collect();
    store
        .append_events(Uuid::new_v4(), Some(0), &events)
        .await
        .unwrap();
    events.len()
}

/// Waits (bounded) until no work row is left, i.e. every event was applied or dead-lettered.
async fn wait_drained(store: &Store, daemon: &Daemon) {
    let started = Instant::now();
    loop {
        let left = process::scalar(store, "SELECT count(*) FROM wh_perspective_events").await;
        if left == 0 {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{left} work row(s) left after 60 s:\n{}",
            daemon.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn spawn_daemon(dir: &Path, config: &Path, name: &str) -> Daemon {
    let mut daemon = Daemon::spawn(
        process::vantage(
            dir,
            &["--config", config.to_str().unwrap(), "run"],
            &[
                ("VANTAGE__HTTP__LISTEN", "127.0.0.1:0"),
                ("VANTAGE__WORKER__POLL_INTERVAL", "100ms"),
                ("VANTAGE__LOG__LEVEL", "info"),
            ],
        ),
        dir,
        name,
    );
    daemon.wait_running(Duration::from_secs(30)).await;
    daemon
}

async fn stop(mut daemon: Daemon) {
    daemon.signal(Signal::SIGTERM);
    let code = daemon.wait(Duration::from_secs(30)).await;
    assert_eq!(code, Some(0), "{}", daemon.log_tail(30));
}

/// `events = ["*"]` with a `"*"` statement: the catch-all runs for every event whose type has
/// no statement of its own, the exact statement for the others. Before issue 7 every event was
/// completed and nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catch_all_statement_runs_for_every_event() {
    let (db, store) = database().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &db.url,
        r#"
[[perspectives]]
name = "everything"
events = ["*"]
[perspectives.sql]
"*" = "INSERT INTO public.applied (perspective, event_id, event_type) VALUES ('everything', $3, $4)"
Special = "INSERT INTO public.special (event_id) VALUES ($3)"
"#,
    );
    let out = vantage(dir.path(), &config, &["config", "check"]).await;
    assert_eq!(out.code, Some(0), "{out:#?}");
    let daemon = spawn_daemon(dir.path(), &config, "catch_all").await;

    let mut caught = 0;
    let mut special = 0;
    for _ in 0..3 {
        caught += append(&store, &["Tick", "Tock", "Special", "Tick.Other"]).await - 1;
        special += 1;
    }
    wait_drained(&store, &daemon).await;
    stop(daemon).await;

    assert_eq!(
        process::scalar(
            &store,
            "SELECT count(*) FROM public.applied WHERE perspective = 'everything'"
        )
        .await,
        caught as i64,
        "the catch-all must run once for every event without its own statement"
    );
    assert_eq!(
        process::scalar(
            &store,
            "SELECT count(*) FROM public.applied WHERE event_type = 'Special'"
        )
        .await,
        0,
        "an exact statement wins over the catch-all"
    );
    assert_eq!(
        process::scalar(&store, "SELECT count(*) FROM public.special").await,
        special as i64
    );
    assert_eq!(
        process::scalar(&store, "SELECT count(*) FROM wh_dead_letters").await,
        0
    );
}

/// Work queued under another subscription (the registry said `*`, this configuration lists
/// `Tick` only): the `Tock` event has no statement here. It is dead-lettered as a permanent
/// failure naming perspective and type, never completed as if applied; `Tick` is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_without_a_statement_is_dead_lettered_not_completed() {
    let (db, store) = database().await;
    store
        .register_perspective("good", &["*".to_string()])
        .await
        .unwrap();
    append(&store, &["Tick", "Tick"]).await;
    append(&store, &["Tock"]).await;
    assert_eq!(
        process::scalar(&store, "SELECT count(*) FROM wh_perspective_events").await,
        3
    );

    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &db.url, GOOD);
    let daemon = spawn_daemon(dir.path(), &config, "drift").await;
    wait_drained(&store, &daemon).await;
    stop(daemon).await;

    assert_eq!(
        process::scalar(&store, "SELECT count(*) FROM public.applied").await,
        2
    );
    let letters: Vec<(Option<String>, String, Option<String>)> = sqlx::query_as(
        "SELECT event_type, failure_reason, error_text FROM wh_dead_letters \
         WHERE perspective_name = 'good'",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    let (event_type, reason, error) = &letters[0];
    assert_eq!(event_type.as_deref(), Some("Tock"));
    assert_eq!(reason, "PermanentFailure");
    let error = error.as_deref().unwrap_or_default();
    assert!(
        error.contains("'good'") && error.contains("'Tock'") && error.contains("no statement"),
        "{error}"
    );
}
