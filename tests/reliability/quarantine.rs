//! Automatic quarantine (issue 11, `perspectives[].quarantine_after`): two real `vantage run`
//! processes on one database; a perspective whose poison events are dead-lettered pauses itself
//! once three are, with one WARN line (of the daemon whose update paused it), the counter and
//! the pause reason in `status` and the console, while the other perspective keeps draining. A
//! resume is not undone by the old dead letters; three new ones quarantine it again.

use std::path::Path;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use nix::sys::signal::Signal;
use serde_json::{json, Value};
use tower::ServiceExt as _;
use uuid::Uuid;
use vantage::internals::store::StoreInternals as _;
use vantage::store::NewEvent;

use crate::support::process::{self, Daemon};
use crate::support::{self, Env};

const LIMIT: Duration = Duration::from_secs(60);
/// What every WARN line of a quarantine says.
const WARN_TEXT: &str = "perspective quarantined";

/// `fragile` fails on an event whose `n` is not a number (and, with one attempt, dead-letters
/// it on the next claim); `healthy` applies everything.
const PERSPECTIVES: &str = r#"
[[perspectives]]
name = "fragile"
events = ["Tick"]
quarantine_after = "3 in 10m"
[perspectives.sql]
Tick = "INSERT INTO public.q_fragile (event_id, n) VALUES ($3, ($1->>'n')::int)"

[[perspectives]]
name = "healthy"
events = ["Tick"]
[perspectives.sql]
Tick = "INSERT INTO public.q_healthy (event_id) VALUES ($3)"
"#;

fn start(dir: &Path, config: &Path, name: &str) -> Daemon {
    Daemon::spawn(
        process::vantage(
            dir,
            &["--config", config.to_str().unwrap(), "run"],
            &[
                ("VANTAGE__WORKER__MAX_PERSPECTIVE_EVENT_ATTEMPTS", "1"),
                ("VANTAGE__WORKER__CONSUMERS", "1"),
                ("VANTAGE__HTTP__LISTEN", "127.0.0.1:0"),
                ("VANTAGE__LOG__LEVEL", "info"),
            ],
        ),
        dir,
        name,
    )
}

/// Events in a stream each, so no poison event holds another behind it.
async fn append(db: &Env, n: Value, count: usize) {
    for _ in 0..count {
        db.store
            .append_events(
                Uuid::new_v4(),
                None,
                &[NewEvent::new("Tick", json!({ "n": n }))],
            )
            .await
            .expect("append");
    }
}

/// The WARN lines of quarantines, in both logs.
fn warn_lines(daemons: &[&Daemon]) -> Vec<String> {
    daemons
        .iter()
        .flat_map(|d| {
            d.log_text()
                .lines()
                .filter(|l| l.contains(WARN_TEXT))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

async fn metric_sum(addrs: &[std::net::SocketAddr], name: &str, perspective: &str) -> f64 {
    let mut sum = 0.0;
    for addr in addrs {
        let (status, body) = process::http_get(*addr, "/metrics").await.expect("scrape");
        assert_eq!(status, 200, "{body}");
        assert!(
            body.lines()
                .any(|l| l.starts_with(name)
                    && l.contains(&format!("perspective=\"{perspective}\""))),
            "{name}{{perspective={perspective}}} is not exported (registered at zero): {body}"
        );
        sum += process::metric_value(&body, name, &[("perspective", perspective)]);
    }
    sum
}

async fn paused(db: &Env) -> i64 {
    db.scalar(
        "SELECT count(*) FROM wh_perspectives WHERE perspective_name = 'fragile' \
         AND paused_at IS NOT NULL",
    )
    .await
}

#[tokio::test]
async fn a_perspective_quarantines_itself_once_and_a_resume_is_not_undone_by_old_dead_letters() {
    let db = Env::migrated().await;
    db.exec(
        "CREATE TABLE public.q_fragile (event_id uuid PRIMARY KEY, n int NOT NULL); \
         CREATE TABLE public.q_healthy (event_id uuid PRIMARY KEY)",
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("vantage.toml");
    std::fs::write(&config, support::fast_daemon_toml(&db.url, PERSPECTIVES)).unwrap();
    let mut a = start(dir.path(), &config, "a");
    let mut b = start(dir.path(), &config, "b");
    let addr_a = a.wait_running(LIMIT).await.expect("a's HTTP address");
    let addr_b = b.wait_running(LIMIT).await.expect("b's HTTP address");
    let addrs = [addr_a, addr_b];
    let q_total = vantage::telemetry::metrics::PERSPECTIVE_QUARANTINES_TOTAL;
    assert_eq!(metric_sum(&addrs, q_total, "fragile").await, 0.0);

    // Three poison events: each fails once and is dead-lettered on its next claim.
    append(&db, json!(1), 1).await;
    db.wait_until("SELECT count(*) FROM public.q_fragile", 1, LIMIT)
        .await;
    append(&db, json!("poison"), 3).await;
    db.wait_until(
        "SELECT count(*) FROM wh_dead_letters WHERE perspective_name = 'fragile'",
        3,
        LIMIT,
    )
    .await;
    db.wait_until(
        "SELECT count(*) FROM wh_perspectives WHERE perspective_name = 'fragile' \
         AND paused_at IS NOT NULL",
        1,
        LIMIT,
    )
    .await;
    let (reason, by): (String, String) = sqlx::query_as(
        "SELECT paused_reason, paused_by FROM wh_perspectives WHERE perspective_name = 'fragile'",
    )
    .fetch_one(db.store.pool())
    .await
    .unwrap();
    assert_eq!(reason, "quarantined: 3 dead letters in 10m");
    assert_eq!(by, "vantage quarantine");
    assert_eq!(
        db.scalar(
            "SELECT count(*) FROM wh_perspectives WHERE perspective_name = 'healthy' \
             AND paused_at IS NOT NULL"
        )
        .await,
        0
    );

    // The healthy perspective keeps draining; the quarantined one claims nothing.
    append(&db, json!(2), 4).await;
    db.wait_until("SELECT count(*) FROM public.q_healthy", 8, LIMIT)
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(db.scalar("SELECT count(*) FROM public.q_fragile").await, 1);
    assert_eq!(
        db.scalar(
            "SELECT count(*) FROM wh_perspective_events WHERE perspective_name = 'fragile' \
             AND instance_id IS NULL AND attempts = 0"
        )
        .await,
        4
    );

    // One WARN line, from the daemon whose update paused it; counted once, by that daemon.
    let lines = warn_lines(&[&a, &b]);
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(
        lines[0].contains("WARN")
            && lines[0].contains("fragile")
            && lines[0].contains("quarantined: 3 dead letters in 10m"),
        "{lines:#?}"
    );
    assert_eq!(metric_sum(&addrs, q_total, "fragile").await, 1.0);
    assert_eq!(metric_sum(&addrs, q_total, "healthy").await, 0.0);

    // `status` and the console show the pause with its reason.
    let status = process::run(
        process::vantage(
            dir.path(),
            &["--config", config.to_str().unwrap(), "status"],
            &[],
        ),
        LIMIT,
    )
    .await;
    assert_eq!(status.code, Some(0), "{status:#?}");
    assert!(
        status.stdout.contains("Paused: 'fragile' since ",)
            && status
                .stdout
                .contains(" by vantage quarantine: quarantined: 3 dead letters in 10m."),
        "{status:#?}"
    );
    let settings =
        vantage::config::Settings::from_toml_str(&support::fast_daemon_toml(&db.url, PERSPECTIVES))
            .unwrap();
    let console = vantage::internals::console::router(
        vantage::internals::console::ConsoleState::new(db.store.clone(), &settings),
    );
    let response = console
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let page = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let page = String::from_utf8_lossy(&page);
    assert!(
        page.contains(" by vantage quarantine: quarantined: 3 dead letters in 10m"),
        "{page}"
    );

    // Resumed: its waiting events drain, and the three dead letters of the window (still in
    // it) do not pause it again, round after round of both daemons' checks.
    let resume = process::run(
        process::vantage(
            dir.path(),
            &[
                "--config",
                config.to_str().unwrap(),
                "perspectives",
                "resume",
                "fragile",
            ],
            &[],
        ),
        LIMIT,
    )
    .await;
    assert_eq!(resume.code, Some(0), "{resume:#?}");
    db.wait_until("SELECT count(*) FROM public.q_fragile", 5, LIMIT)
        .await;
    let resumed = Instant::now();
    while resumed.elapsed()
        < vantage::internals::daemon::QUARANTINE_PERIOD * 2 + Duration::from_secs(1)
    {
        assert_eq!(paused(&db).await, 0, "re-paused by the old dead letters");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(
        db.scalar(
            "SELECT count(*) FROM wh_dead_letters WHERE perspective_name = 'fragile' \
             AND dead_lettered_at > now() - interval '10 minutes'"
        )
        .await,
        3,
        "the old dead letters are still in the window"
    );
    assert_eq!(warn_lines(&[&a, &b]).len(), 1);

    // Three new ones after the resume: quarantined again, once more.
    append(&db, json!("again"), 3).await;
    db.wait_until(
        "SELECT count(*) FROM wh_perspectives WHERE perspective_name = 'fragile' \
         AND paused_at IS NOT NULL",
        1,
        LIMIT,
    )
    .await;
    let lines = warn_lines(&[&a, &b]);
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert_eq!(metric_sum(&addrs, q_total, "fragile").await, 2.0);

    for d in [&mut a, &mut b] {
        d.signal(Signal::SIGTERM);
        let code = d.wait(LIMIT).await;
        assert_eq!(code, Some(0), "{}", d.log_tail(30));
    }
}

/// `n` dead letters of `perspective`, dead-lettered `ago` ago (as the daemon writes them,
/// minus the work row).
async fn dead_letters(db: &Env, perspective: &str, n: i64, ago: &str) {
    db.exec(&format!(
        "INSERT INTO wh_dead_letters (dead_letter_id, source_table, source_id, stream_id, \
             event_id, global_position, stream_version, event_type, perspective_name, \
             failure_reason, error_text, attempts_when_dlq, failures_when_dlq, dead_lettered_at) \
         SELECT gen_random_uuid(), 'wh_perspective_events', gen_random_uuid(), gen_random_uuid(), \
                gen_random_uuid(), g, 1, 'Tick', '{perspective}', 'MaxAttemptsExceeded', 'boom', \
                2, 1, now() - interval '{ago}' \
         FROM generate_series(1, {n}) AS g"
    ))
    .await;
}

/// The statement itself: the window, the threshold, the fence (of two callers at once only
/// one pauses), an unknown or paused perspective, and the resume's new baseline.
#[tokio::test]
async fn the_quarantine_statement_counts_the_window_since_the_resume_and_pauses_once() {
    let db = Env::migrated().await;
    for name in ["fragile", "other"] {
        db.store
            .register_perspective(name, &["Tick".to_owned()])
            .await
            .unwrap();
    }
    let window = Duration::from_secs(600);
    let reason = "quarantined: 3 dead letters in 10m";
    let quarantine = |name: &'static str| {
        let store = db.store.clone();
        async move {
            store
                .quarantine_perspective(name, 3, window, reason)
                .await
                .expect("the statement runs")
        }
    };
    // Outside the window, or of another perspective: they do not count.
    dead_letters(&db, "fragile", 5, "11 minutes").await;
    dead_letters(&db, "other", 5, "1 minute").await;
    dead_letters(&db, "fragile", 2, "1 minute").await;
    assert_eq!(quarantine("fragile").await, None);
    assert_eq!(paused(&db).await, 0);
    assert_eq!(quarantine("nobody").await, None);

    // The third: of two callers at once, exactly one pauses it.
    dead_letters(&db, "fragile", 1, "1 second").await;
    let (first, second) = tokio::join!(quarantine("fragile"), quarantine("fragile"));
    assert!(
        first.is_some() != second.is_some(),
        "{first:?} / {second:?}"
    );
    let state = db
        .store
        .pause_states()
        .await
        .unwrap()
        .into_iter()
        .find(|s| s.perspective_name == "fragile")
        .unwrap();
    assert_eq!(state.paused_at, first.or(second));
    assert_eq!(state.paused_reason.as_deref(), Some(reason));
    assert_eq!(
        state.paused_by.as_deref(),
        Some(vantage::internals::store::QUARANTINE_BY)
    );
    // Paused already: nothing changes.
    assert_eq!(quarantine("fragile").await, None);

    // Resumed: the three of the window are before the resume and no longer count.
    assert_eq!(
        db.store.resume_perspective("fragile").await.unwrap(),
        Some(true)
    );
    assert_eq!(quarantine("fragile").await, None);
    dead_letters(&db, "fragile", 2, "0 seconds").await;
    assert_eq!(quarantine("fragile").await, None);
    dead_letters(&db, "fragile", 1, "0 seconds").await;
    assert!(quarantine("fragile").await.is_some());
}
