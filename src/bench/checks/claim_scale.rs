//! The claim's latency on a large backlog against a 10 000-row one.

use super::claim_timing::{claim_samples, plans, LANE, SAMPLES};
use super::{payload, CheckOutcome, Target};
use crate::bench::seed::{self, Seed};
use crate::bench::{Bench, BenchError, Check};

pub(super) async fn run(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::ClaimScale);
    let small_rows = 10_000;
    let small = Seed::healthy(small_rows, small_rows / LANE, 1, payload(bench));
    let names = small.perspective_names();
    seed::apply(bench, &small).await?;
    let at_small = claim_samples(bench, &names).await?;
    plans(bench, &mut out, &names, "10 000-row backlog").await?;

    let large_rows = bench.config.large_backlog.max(small_rows);
    let large = Seed::healthy(large_rows, large_rows / LANE, 1, payload(bench));
    let started = std::time::Instant::now();
    seed::apply(bench, &large).await?;
    out.details.push(format!(
        "seeded {large_rows} rows in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    let at_large = claim_samples(bench, &names).await?;
    plans(
        bench,
        &mut out,
        &names,
        &format!("{large_rows}-row backlog"),
    )
    .await?;
    out.details.push(format!(
        "claim (get_stream_events, {SAMPLES} samples) p50/p99: {:.2}/{:.2} ms at {small_rows} rows, {:.2}/{:.2} ms at {large_rows} rows",
        at_small.p50_ms, at_small.p99_ms, at_large.p50_ms, at_large.p99_ms
    ));
    out.ratio(
        format!("claim p50 at {large_rows} / at {small_rows} rows"),
        at_large.p50_ms / at_small.p50_ms.max(1e-9),
        Some(Target::AtMost(1.5)),
    );
    Ok(out)
}
