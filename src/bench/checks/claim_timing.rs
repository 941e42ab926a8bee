//! Timing the claim statement and keeping the plans of the claim and the limit's lease, for the
//! checks that compare claims at two sizes of backlog.

use super::CheckOutcome;
use crate::bench::measure::{percentiles, Percentiles};
use crate::bench::{Bench, BenchError};

/// Events per lane of the backlogs these checks seed.
pub(super) const LANE: u64 = 100;
/// Claims timed per backlog.
pub(super) const SAMPLES: usize = 40;

/// The claim's latency over [`SAMPLES`] claims, after one to warm up.
pub(super) async fn claim_samples(
    bench: &Bench,
    names: &[String],
) -> Result<Percentiles, BenchError> {
    let max_streams = bench.base_settings.worker.max_streams_per_claim as i32;
    let batch = bench.config.batch_size as i32;
    // One warm-up claim, then the samples.
    bench.db.timed_claim(names, max_streams, batch).await?;
    let mut samples = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let (_, took) = bench.db.timed_claim(names, max_streams, batch).await?;
        samples.push(took);
    }
    Ok(percentiles(&mut samples))
}

/// Keeps the plans of the claim and of the limit's lease, titled with `at`.
pub(super) async fn plans(
    bench: &Bench,
    out: &mut CheckOutcome,
    names: &[String],
    at: &str,
) -> Result<(), BenchError> {
    let max_streams = bench.base_settings.worker.max_streams_per_claim as i32;
    let batch = bench.config.batch_size as i32;
    let claim = bench.db.explain_claim(names, max_streams, batch).await?;
    out.plans.push((format!("get_stream_events, {at}"), claim));
    let lease = bench.db.explain_limit_lease(names, batch).await?;
    out.plans
        .push((format!("the limit's lease statement, {at}"), lease));
    Ok(())
}
