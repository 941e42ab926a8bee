//! Versioned perspectives under crashes (docs/versions.md, "Backfill"): daemons SIGKILLed again
//! and again while a new version backfills, with a producer appending throughout. Each kill
//! leaves the position of the last committed batch; the next daemon continues there. At the end
//! the version holds every event exactly once (a primary key refuses a second apply, and a
//! failed apply would stop the backfill), in stream order, and it went live by itself.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use uuid::Uuid;
use vantage::store::{NewEvent, Store};

use crate::crashes::{append_backlog, connect};
use crate::support;
use crate::support::process::{self, Daemon};

const STREAMS: usize = 400;
const PER_STREAM: usize = 50;

fn config(url: &str) -> String {
    format!(
        r#"
[database]
url = "{url}"
[worker]
consumers = 2
lease = "5s"
batch_size = 50
# Small batches, so the kills land in the middle of the backfill.
backfill_batch_size = 40
[orphans]
heartbeat_interval = "500ms"
stale_after = "3s"
[http]
listen = "127.0.0.1:0"
[log]
level = "warn"

[[perspectives]]
name = "ledger"
read_schema = "rm"
tables = ["applied"]
setup = "CREATE SEQUENCE applied_seq; CREATE TABLE applied (stream_id uuid NOT NULL, version int NOT NULL, position bigint NOT NULL, seq bigint NOT NULL, PRIMARY KEY (stream_id, version))"
events = ["Tick"]
[perspectives.sql]
Tick = "INSERT INTO applied (stream_id, version, position, seq) VALUES ($2, $6, $5, nextval('applied_seq'))"
"#
    )
}

async fn backfill(store: &Store) -> (String, i64) {
    sqlx::query_as(
        "SELECT state, backfill_position FROM wh_perspective_versions WHERE perspective_name = 'ledger'",
    )
    .fetch_optional(store.pool())
    .await
    .unwrap()
    .unwrap_or_else(|| ("unregistered".to_owned(), 0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backfill_sigkilled_again_and_again_resumes_where_it_was_and_applies_history_once() {
    let db = support::fresh_database().await;
    let store = connect(&db.url).await;
    store.migrate().await.unwrap();
    append_backlog(&store, STREAMS, PER_STREAM, 4).await;

    // New events keep coming (new streams, and more events on the old ones' successors).
    let producer = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut appended = 0i64;
            for _ in 0..60 {
                let events: Vec<NewEvent> = (0..5)
                    .map(|v| NewEvent::new("Tick", serde_json::json!({ "v": v })))
                    .collect();
                store
                    .append_events(Uuid::new_v4(), Some(0), &events)
                    .await
                    .expect("append");
                appended += 5;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            appended
        })
    };

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vantage.toml");
    std::fs::write(&path, config(&db.url)).unwrap();
    let path = path.to_str().unwrap().to_owned();
    let spawn = |generation: usize| {
        Daemon::spawn(
            process::vantage(dir.path(), &["--config", &path, "run"], &[]),
            dir.path(),
            &format!("vantage-{generation}"),
        )
    };

    let started = Instant::now();
    let mut kills_mid_backfill = 0;
    let mut positions = Vec::new();
    let mut generation = 0;
    let mut daemon = loop {
        generation += 1;
        let mut d = spawn(generation);
        // Wait for this daemon to make progress (or for the backfill to be done).
        let (state, before) = backfill(&store).await;
        if state != "building" && state != "unregistered" {
            break d;
        }
        loop {
            if let Some(code) = d.try_exit() {
                panic!("{} exited ({code:?}):\n{}", d.name, d.log_tail(40));
            }
            let (state, at) = backfill(&store).await;
            if (state == "building" && at > before)
                || (state != "building" && state != "unregistered")
            {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(240),
                "no backfill progress (at {at}, {state}):\n{}",
                d.log_tail(40)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(process::random_below(200))).await;
        let (state, at) = backfill(&store).await;
        d.signal(Signal::SIGKILL);
        let _ = d.wait(Duration::from_secs(10)).await;
        if state == "building" {
            kills_mid_backfill += 1;
            positions.push(at);
        } else {
            // Done before the kill: one more daemon finishes the drain.
            generation += 1;
            break spawn(generation);
        }
    };
    let appended = producer.await.unwrap();
    let total = (STREAMS * PER_STREAM) as i64 + appended;
    assert!(
        kills_mid_backfill >= 2,
        "only {kills_mid_backfill} kill(s) landed during the backfill"
    );
    // Each kill kept what was committed: the positions seen at the kills only grow.
    assert!(positions.windows(2).all(|w| w[0] <= w[1]), "{positions:?}");

    // The version went live by itself, and the drain finishes what was queued meanwhile.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(code) = daemon.try_exit() {
            panic!(
                "the last daemon exited ({code:?}):\n{}",
                daemon.log_tail(40)
            );
        }
        let applied = process::scalar(&store, "SELECT count(*) FROM ledger_v1.applied").await;
        let queued = process::scalar(&store, "SELECT count(*) FROM wh_perspective_events").await;
        if applied == total && queued == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "applied {applied} of {total}, {queued} queued:\n{}",
            daemon.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(backfill(&store).await.0, "live");
    assert_eq!(
        process::scalar(&store, "SELECT count(*) FROM rm.applied").await,
        total
    );
    // Every event at its own position, in stream order, nothing dead-lettered or failed.
    assert_eq!(
        process::scalar(
            &store,
            "SELECT count(*) FROM wh_event_store e LEFT JOIN ledger_v1.applied a \
             ON a.stream_id = e.stream_id AND a.version = e.stream_version \
             WHERE a.stream_id IS NULL OR a.position <> e.global_position"
        )
        .await,
        0
    );
    assert_eq!(
        process::scalar(
            &store,
            "SELECT count(*) FROM (SELECT seq < lag(seq) OVER (PARTITION BY stream_id ORDER BY version) AS bad \
             FROM ledger_v1.applied) x WHERE bad"
        )
        .await,
        0
    );
    assert_eq!(
        process::scalar(&store, "SELECT count(*) FROM wh_dead_letters").await,
        0
    );
    daemon.signal(Signal::SIGTERM);
    let _ = daemon.wait(Duration::from_secs(30)).await;
    eprintln!(
        "{kills_mid_backfill} kills mid-backfill at positions {positions:?}; {total} events applied once"
    );
}
