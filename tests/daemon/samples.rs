//! The chart history (docs/operations.md, "The metric history"): running daemons write one row
//! per minute and perspective into `wh_metric_samples`, two daemons' applied counts sum to the
//! events applied (never doubled), and the table stays bounded: minutes older than 24 hours
//! are trimmed by the same sampler round.

use std::time::Duration;

use uuid::Uuid;
use vantage::daemon::DaemonBuilder;
use vantage::store::NewEvent;

use crate::support::{self, Env};

const PERSPECTIVE: &str = r#"
[[perspectives]]
name = "counted"
events = ["Placed"]
[perspectives.sql]
Placed = "INSERT INTO counted_rows (position) VALUES ($5)"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemons_write_a_bounded_history_and_never_double_the_applied_count() {
    let env = Env::migrated().await;
    env.exec("CREATE TABLE counted_rows (position bigint PRIMARY KEY)")
        .await;
    env.exec("SELECT register_perspective('counted', ARRAY['Placed'])")
        .await;
    // 48 hours of old minutes (and one of a perspective gone since): twice the bound.
    env.exec(
        "INSERT INTO wh_metric_samples (minute, perspective_name, applied, backlog, lag_seconds) \
         SELECT date_trunc('minute', now()) - make_interval(mins => m), p, 0, 0, 0 \
         FROM generate_series(1, 2880) AS m, unnest(ARRAY['counted', 'gone']) AS p",
    )
    .await;

    let start = || async {
        DaemonBuilder::new(support::fast_settings(&env.url, PERSPECTIVE))
            .store(env.store.clone())
            .without_http()
            .start()
            .await
            .expect("daemon starts")
    };
    let (a, b) = (start().await, start().await);

    // The first sampler round trims: nothing older than 24 h, at most 1 440 minutes each.
    env.wait_until(
        "SELECT count(*) FROM wh_metric_samples \
         WHERE minute <= date_trunc('minute', now()) - interval '24 hours'",
        0,
        Duration::from_secs(30),
    )
    .await;
    let most = env
        .scalar(
            "SELECT max(n) FROM (SELECT count(*) AS n FROM wh_metric_samples \
             GROUP BY perspective_name) c",
        )
        .await;
    assert!(most <= 1440, "{most} rows for one perspective");

    let events: Vec<NewEvent> = (0..50)
        .map(|i| NewEvent::new("Placed", serde_json::json!({ "i": i })))
        .collect();
    for chunk in events.chunks(5) {
        env.store
            .append_events(Uuid::new_v4(), None, chunk)
            .await
            .unwrap();
    }
    env.wait_until(
        "SELECT count(*) FROM counted_rows",
        50,
        Duration::from_secs(60),
    )
    .await;
    // Both daemons' counts land in the history within a sampler round or two: 50 in all, each
    // applied event counted once by the daemon that applied it.
    env.wait_until(
        "SELECT coalesce(sum(applied), 0)::bigint FROM wh_metric_samples \
         WHERE perspective_name = 'counted'",
        50,
        Duration::from_secs(60),
    )
    .await;
    // The current minute's gauges were written too.
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM wh_metric_samples WHERE perspective_name = 'counted' \
             AND minute >= date_trunc('minute', now()) - interval '1 minute' AND backlog IS NOT NULL"
        )
        .await
        .min(1),
        1
    );
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}
