//! A producer's transaction held open over streams with work, and the drain beside it.

use super::{payload, CheckOutcome, Target};
use crate::bench::drain;
use crate::bench::seed::{self, Seed};
use crate::bench::{Bench, BenchError, Check};

/// A producer's transaction held open over streams with work (a stalled bulk import that
/// appended once to each of 300 backlog streams): the daemon drains every other row at the rate
/// it drains them without it (target: at least 0.8 of it), and the held events are applied as
/// soon as the producer commits.
pub(super) async fn run(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    const HELD: i64 = 300;
    let mut out = CheckOutcome::new(Check::HeldAppend);
    let n = (bench.config.events / 4).clamp(1_000, 50_000);
    let streams = bench.config.streams.clamp(HELD as u64, n);
    let seed = Seed::healthy(n, streams, 1, payload(bench));
    seed::apply(bench, &seed).await?;
    let free = drain::drain(bench, &seed, "drain, nothing held").await?;
    out.drain_line(&free);

    seed::apply(bench, &seed).await?;
    let held_streams = bench.db.stream_ids("main", HELD).await?;
    let mut producer = bench
        .db
        .store()
        .pool()
        .begin()
        .await
        .map_err(crate::store::StoreError::from)?;
    for s in &held_streams {
        crate::store::append_events_in(
            &mut producer,
            *s,
            None,
            &[crate::store::NewEvent::new(
                crate::store::bench::BENCH_EVENT_TYPE,
                serde_json::json!({ "held": true }),
            )],
        )
        .await?;
    }
    let held_since = std::time::Instant::now();
    let beside = drain::drain(bench, &seed, "drain, 300 streams' appends held open").await?;
    out.drain_line(&beside);
    let held_for = held_since.elapsed();

    // The commit, with a daemon running: how soon are the held events applied?
    let daemons = drain::start(bench, &seed).await?;
    let daemons_started = daemons.started();
    producer
        .commit()
        .await
        .map_err(crate::store::StoreError::from)?;
    let committed = std::time::Instant::now();
    let after = drain::watch(
        bench,
        &seed,
        "the held events, after the commit",
        HELD as u64,
        daemons,
        None,
    )
    .await?;
    // (from the commit to the moment the last held event was applied: `after.elapsed` counts
    // from the daemons' start and ends there, before they are stopped and the run measured)
    let applied_in = (daemons_started + after.elapsed).saturating_duration_since(committed);
    out.details.push(format!(
        "held open {:.1} s over {HELD} streams with work; after the commit its {} events were applied in {:.0} ms",
        held_for.as_secs_f64(),
        after.rows,
        applied_in.as_secs_f64() * 1e3
    ));
    out.ratio(
        "drain beside a held append / without (rows/s)",
        beside.rate() / free.rate().max(1e-9),
        Some(Target::AtLeast(0.8)),
    );
    Ok(out)
}
