//! The drain by the real daemon: [`DaemonBuilder`] with the seed's SQL perspectives, its own
//! connections, no HTTP, `--instances` of it side by side, until every expected row is applied
//! or dead-lettered. Progress is read from the daemon's own counters, in this process, so
//! watching the drain costs the database nothing.

use std::time::{Duration, Instant};

use crate::config::Settings;
use crate::daemon::{DaemonBuilder, RunningDaemon};
use crate::store::bench::DrainCheck;
use crate::store::Store;

use super::measure::{self, PerEvent, Percentiles};
use super::seed::Seed;
use super::{Bench, BenchError};

/// The figures of one drain.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DrainRun {
    /// Which run.
    pub what: String,
    /// Rows finished (applied or dead-lettered).
    pub rows: u64,
    /// Rows dead-lettered among them.
    pub dead_lettered: u64,
    /// Wall time from daemon start to the last row.
    pub elapsed: Duration,
    /// Apply latency (the daemon's histogram, interpolated).
    pub apply: Percentiles,
    /// Claim latency of one claim round (the daemon's histogram, interpolated).
    pub claim: Percentiles,
    /// Database cost per row.
    pub per_event: PerEvent,
    /// Peak resident memory of this process during the drain, KiB.
    pub peak_rss_kib: u64,
    /// Resident memory at the end of the drain, KiB.
    pub rss_kib: u64,
    /// Entries in the first daemon's cooldown cache at the end.
    pub cooldown_entries: usize,
    /// The read model's verdict.
    pub check: DrainCheck,
}

impl DrainRun {
    /// Rows per second.
    pub fn rate(&self) -> f64 {
        self.rows as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Starts the daemons for `seed` (already applied) and waits until its rows are done.
pub async fn drain(bench: &Bench, seed: &Seed, what: &str) -> Result<DrainRun, BenchError> {
    drain_with(bench, seed, what, |_| {}).await
}

/// [`drain`] with the daemons' settings changed by `tune` (after the seed's perspectives are set).
pub async fn drain_with(
    bench: &Bench,
    seed: &Seed,
    what: &str,
    tune: impl FnOnce(&mut Settings),
) -> Result<DrainRun, BenchError> {
    let expected = seed.rows();
    let daemons = start_with(bench, seed, tune).await?;
    let run = watch(bench, seed, what, expected, daemons, None).await?;
    if run.check.duplicates > 0 || run.check.out_of_order > 0 {
        return Err(BenchError::Incorrect(format!(
            "{what}: {} rows applied more than once, {} out of order",
            run.check.duplicates, run.check.out_of_order
        )));
    }
    Ok(run)
}

/// Running daemons and their own stores.
pub struct Daemons {
    running: Vec<(RunningDaemon, Store)>,
    started: Instant,
    before: measure::Counters,
    metrics_before: measure::MetricsReading,
}

impl Daemons {
    /// When they were started: a run's `elapsed` counts from here.
    pub fn started(&self) -> Instant {
        self.started
    }
}

/// Starts `--instances` daemons for `seed`, after reading the counters the run is measured from.
pub async fn start(bench: &Bench, seed: &Seed) -> Result<Daemons, BenchError> {
    start_with(bench, seed, |_| {}).await
}

/// [`start`] with the daemons' settings changed by `tune`.
pub async fn start_with(
    bench: &Bench,
    seed: &Seed,
    tune: impl FnOnce(&mut Settings),
) -> Result<Daemons, BenchError> {
    bench.db.settle_stats(bench.config.settle).await;
    let before = measure::Counters::read(&bench.db, bench.statement_stats).await?;
    let metrics_before = bench.metrics.read();
    measure::reset_peak_rss();
    let mut settings = bench.base_settings.clone();
    settings.perspectives = seed.settings();
    tune(&mut settings);
    let started = Instant::now();
    let mut running = Vec::new();
    for _ in 0..bench.config.instances.max(1) {
        let store = Store::connect(&bench.daemon_options).await?;
        let daemon = DaemonBuilder::new(settings.clone())
            .store(store.clone())
            .without_http()
            .start()
            .await?;
        running.push((daemon, store));
    }
    Ok(Daemons {
        running,
        started,
        before,
        metrics_before,
    })
}

/// Waits until `expected` rows of the seed's perspectives are applied or dead-lettered (as
/// the daemons' counters say), with a progress bar; then stops the daemons and measures.
/// `during` runs alongside (a producer), and the drain also waits for it.
pub async fn watch(
    bench: &Bench,
    seed: &Seed,
    what: &str,
    expected: u64,
    daemons: Daemons,
    during: Option<tokio::task::JoinHandle<Result<u64, BenchError>>>,
) -> Result<DrainRun, BenchError> {
    let bar = bench.progress.bar(what, expected);
    let before = &daemons.metrics_before.clone();
    let names = seed.perspective_names();
    let filter: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    let done_rows = |reading: &measure::MetricsReading| -> (u64, u64) {
        let mut applied = 0.0;
        let mut dead = 0.0;
        for f in &filter {
            applied += reading.applied(Some(f)) - before.applied(Some(f));
            dead += reading.dead_lettered(Some(f)) - before.dead_lettered(Some(f));
        }
        ((applied + dead).max(0.0) as u64, dead.max(0.0) as u64)
    };
    let mut during = during;
    let mut produced_ok = true;
    let (rows, dead, elapsed) = loop {
        let reading = bench.metrics.read();
        let (rows, dead) = done_rows(&reading);
        bar.set_position(rows.min(expected));
        let producing = during.as_ref().map(|h| !h.is_finished()).unwrap_or(false);
        if rows >= expected && !producing {
            break (rows, dead, daemons.started.elapsed());
        }
        if daemons.started.elapsed() > bench.config.drain_timeout {
            bar.abandon();
            stop(daemons).await?;
            return Err(BenchError::Timeout {
                what: what.into(),
                done: rows,
                expected,
                waited: bench.config.drain_timeout,
            });
        }
        if let Some(h) = during.take() {
            if h.is_finished() {
                produced_ok = matches!(h.await, Ok(Ok(_)));
            } else {
                during = Some(h);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    bar.finish_and_clear();
    if let Some(h) = during.take() {
        produced_ok = matches!(h.await, Ok(Ok(_)));
    }
    if !produced_ok {
        return Err(BenchError::Incorrect(format!(
            "{what}: the producer failed"
        )));
    }

    let after_metrics = bench.metrics.read();
    let (rss_kib, peak_rss_kib) = measure::rss_kib();
    let cooldown_entries = daemons
        .running
        .first()
        .and_then(|(d, _)| d.cooldown().map(|c| c.len()))
        .unwrap_or(0);
    let counters_before = daemons.before;
    stop(daemons).await?;
    bench.db.settle_stats(bench.config.settle).await;
    let after = measure::Counters::read(&bench.db, bench.statement_stats).await?;
    let own = if bench.statement_stats { 2 } else { 1 };
    let check = bench.db.check_drain(&names).await?;
    Ok(DrainRun {
        what: what.into(),
        rows,
        dead_lettered: dead,
        elapsed,
        apply: after_metrics.apply().since(&before.apply()).percentiles(),
        claim: after_metrics.claim().since(&before.claim()).percentiles(),
        per_event: PerEvent::between(&counters_before, &after, rows, own),
        peak_rss_kib,
        rss_kib,
        cooldown_entries,
        check,
    })
}

/// Shuts every daemon down gracefully and closes its connections (which flushes their
/// statistics to the server).
pub async fn stop(daemons: Daemons) -> Result<(), BenchError> {
    for (daemon, store) in daemons.running {
        daemon.shutdown().await?;
        store.close().await;
    }
    Ok(())
}
