//! Smoke test of the benchmark harness (`vantage bench`): a few hundred events through the
//! daemon drain and both limit runs, on a fresh database; the report ends with its three lines.
//! No figure is asserted (performance is never asserted in tests), only that every run
//! finished exactly once and in order.

use std::time::Duration;

use vantage::internals::bench::progress::Progress;
use vantage::internals::bench::{BenchConfig, Check};

use crate::support;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_drains_a_small_backlog_and_prints_the_three_lines() {
    let db = support::fresh_database().await;
    let config = BenchConfig {
        events: 300,
        streams: 30,
        consumers: 2,
        batch_size: 50,
        // The statements check drains with each perspective's statement replaced: its three
        // drains must each apply every event once and in order (drain_with checks it).
        checks: vec![Check::DeadLetter, Check::Statements],
        // Two rounds of the main pair: the median-round path runs too.
        rounds: 2,
        drain_timeout: Duration::from_secs(60),
        // Figures are not asserted: no need to wait for exact statistics.
        settle: Duration::from_millis(100),
        ..BenchConfig::default()
    };
    let report = vantage::internals::bench::run(&db.url, config, Progress::hidden())
        .await
        .expect("the bench runs");

    let vantage = report.vantage.as_ref().expect("a vantage drain");
    assert_eq!(vantage.rows, 300);
    assert_eq!(vantage.check.applied, 300);
    assert_eq!(vantage.check.duplicates, 0);
    assert_eq!(vantage.check.out_of_order, 0);
    assert_eq!(vantage.check.remaining, 0);
    assert_eq!(report.crash_safe.as_ref().map(|l| l.rows), Some(300));
    assert_eq!(report.rounds.len(), 2, "one ratio per round");
    assert_eq!(report.floor.as_ref().map(|l| l.rows), Some(300));
    assert_eq!(report.checks.len(), 2);
    assert_eq!(report.checks[0].ratios.len(), 1);
    assert_eq!(
        report.checks[1].ratios.len(),
        2,
        "WITH / plain, EXECUTE / plain"
    );

    let text = report.to_string();
    let last: Vec<&str> = text.lines().rev().take(3).collect();
    assert!(last[2].starts_with("limit: "), "{text}");
    assert!(last[1].starts_with("vantage: "), "{text}");
    assert!(last[0].starts_with("drain/limit ratio: "), "{text}");
    let ratio: f64 = last[0]["drain/limit ratio: ".len()..]
        .parse()
        .expect("a number");
    assert!(ratio > 0.0, "{text}");
}
