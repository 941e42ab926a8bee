//! The claim's latency with unprunable dead tuples behind an open snapshot, against clean.

use super::claim_timing::{claim_samples, plans, LANE};
use super::{payload, CheckOutcome, Target};
use crate::bench::seed::{self, Seed};
use crate::bench::{Bench, BenchError, Check};

pub(super) async fn run(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::DeadTuples);
    let small_rows = 10_000;
    let small = Seed::healthy(small_rows, small_rows / LANE, 1, payload(bench));
    let names = small.perspective_names();
    seed::apply(bench, &small).await?;
    let clean = claim_samples(bench, &names).await?;

    let dead = bench.config.dead_tuples;
    let last_live = bench.db.max_position().await?;
    let snapshot = bench.db.hold_snapshot().await?;
    let result = async {
        bench
            .db
            .seed(
                "dead",
                (dead / LANE).max(1) as i64,
                LANE as i64,
                crate::store::bench::BENCH_EVENT_TYPE,
                payload(bench) as i32,
                false,
            )
            .await?;
        let deleted = bench.db.delete_work_after(last_live).await?;
        let held = claim_samples(bench, &names).await?;
        plans(
            bench,
            &mut out,
            &names,
            &format!("10 000 live rows, {deleted} unprunable dead tuples"),
        )
        .await?;
        Ok::<_, BenchError>((deleted, held))
    }
    .await;
    let _ = snapshot.rollback().await;
    let (deleted, held) = result?;
    out.details.push(format!(
        "claim round p50/p99: {:.2}/{:.2} ms clean, {:.2}/{:.2} ms with {deleted} dead tuples behind an open snapshot",
        clean.p50_ms, clean.p99_ms, held.p50_ms, held.p99_ms
    ));
    out.ratio(
        "claim p50 with unprunable dead tuples / clean",
        held.p50_ms / clean.p50_ms.max(1e-9),
        Some(Target::AtMost(3.0)),
    );
    Ok(out)
}
