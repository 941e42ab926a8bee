//! The physical limit: the same database effects as the drain, for the same batch size, issued
//! as directly as SQL allows — K connections (consumers × instances), one hand-written
//! statement per transaction, no Rust per event (the ids leased in transaction 1 are handed
//! back as one array).
//!
//! - Crash-safe shape: transaction 1 leases up to batch_size due rows with attempts + 1 and
//!   commits; transaction 2 runs the perspective's upsert for each of them, set-based, and
//!   deletes them. Measured on a trigger-free copy of the work table (same columns, its best
//!   index, none of vantage's lane bookkeeping): the physical limit, which the drain's ratio is
//!   against; and, for comparison, on vantage's own table, which pays the lane triggers.
//! - Single-transaction floor: claim, upsert and delete in one statement.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::measure::{self, PerEvent};
use super::{Bench, BenchError};
use crate::store::bench::LimitTable;

/// The figures of one limit run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LimitRun {
    /// Which shape.
    pub what: String,
    /// Rows applied and deleted.
    pub rows: u64,
    /// Wall time.
    pub elapsed: Duration,
    /// Database cost per row.
    pub per_event: PerEvent,
}

impl LimitRun {
    /// Rows per second.
    pub fn rate(&self) -> f64 {
        self.rows as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// The crash-safe shape over the seeded rows of `perspectives`, moved into the trigger-free
/// copy of the work table first: the physical limit.
pub async fn crash_safe(
    bench: &Bench,
    perspectives: &[String],
    expected: u64,
) -> Result<LimitRun, BenchError> {
    bench.db.move_work_to_limit_copy().await?;
    let shape = Some(LimitTable::TriggerFree);
    run(bench, perspectives, expected, "limit, crash-safe", shape).await
}

/// The crash-safe shape on vantage's own work table (its lane triggers included).
pub async fn crash_safe_on_own_table(
    bench: &Bench,
    perspectives: &[String],
    expected: u64,
) -> Result<LimitRun, BenchError> {
    let shape = Some(LimitTable::Vantage);
    run(
        bench,
        perspectives,
        expected,
        "limit, on vantage's table",
        shape,
    )
    .await
}

/// The single-transaction floor over the seeded rows of `perspectives`.
pub async fn floor(
    bench: &Bench,
    perspectives: &[String],
    expected: u64,
) -> Result<LimitRun, BenchError> {
    run(
        bench,
        perspectives,
        expected,
        "limit, one transaction",
        None,
    )
    .await
}

async fn run(
    bench: &Bench,
    perspectives: &[String],
    expected: u64,
    what: &str,
    crash_safe: Option<LimitTable>,
) -> Result<LimitRun, BenchError> {
    let connections = (bench.config.consumers * bench.config.instances).max(1);
    let batch = bench.config.batch_size.clamp(1, i32::MAX as u32) as i32;
    // Connections of their own, closed at the end: a session flushes its statistics when it
    // exits, so the transaction count after the run is complete.
    let mut options = bench.daemon_options.clone();
    options.max_connections = connections as u32;
    options.application_name = "vantage bench limit".into();
    let clients =
        crate::store::bench::BenchStore::new(crate::store::Store::connect(&options).await?);
    bench.db.settle_stats(bench.config.settle).await;
    let before = measure::Counters::read(&bench.db, bench.statement_stats).await?;
    let bar = bench.progress.bar(what, expected);
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let db = clients.clone();
        let names = perspectives.to_vec();
        let done = Arc::clone(&done);
        let bar = bar.clone();
        tasks.push(tokio::spawn(async move {
            let holder = Uuid::new_v4();
            loop {
                let n = match crash_safe {
                    Some(table) => {
                        let ids = db.limit_lease(table, holder, &names, batch).await?;
                        if ids.is_empty() {
                            0
                        } else {
                            db.limit_apply(table, holder, &ids).await?
                        }
                    }
                    None => db.limit_floor(&names, batch).await?,
                };
                if n == 0 {
                    return Ok::<_, BenchError>(());
                }
                let total = done.fetch_add(n, Ordering::Relaxed) + n;
                bar.set_position(total.min(expected));
            }
        }));
    }
    for t in tasks {
        match t.await {
            Ok(r) => r?,
            Err(e) => {
                return Err(BenchError::Incorrect(format!(
                    "{what}: a client crashed: {e}"
                )));
            }
        }
    }
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    let rows = done.load(Ordering::Relaxed);
    clients.store().close().await;
    bench.db.settle_stats(bench.config.settle).await;
    let after = measure::Counters::read(&bench.db, bench.statement_stats).await?;
    let own = if bench.statement_stats { 2 } else { 1 };
    let mut check = bench.db.check_drain(perspectives).await?;
    if crash_safe == Some(LimitTable::TriggerFree) {
        check.remaining += bench.db.limit_copy_remaining().await?;
    }
    if check.remaining > 0 || check.duplicates > 0 || rows < expected {
        return Err(BenchError::Incorrect(format!(
            "{what}: {rows} of {expected} rows done, {} left, {} applied twice",
            check.remaining, check.duplicates
        )));
    }
    Ok(LimitRun {
        what: what.into(),
        rows,
        elapsed,
        per_event: PerEvent::between(&before, &after, rows, own),
    })
}
