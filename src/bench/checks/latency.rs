//! Append-to-applied latency under a steady 1 000 events/s.

use std::time::Duration;

use super::{payload, CheckOutcome, Target};
use crate::bench::drain;
use crate::bench::seed::{self, Seed};
use crate::bench::{Bench, BenchError, Check};

pub(super) async fn run(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    const RATE: u64 = 1_000;
    const TICK: Duration = Duration::from_millis(10);
    const SECONDS: u64 = 10;
    const STREAMS: i64 = 100;
    let mut out = CheckOutcome::new(Check::Latency);
    let empty = Seed {
        parts: Vec::new(),
        ..Seed::healthy(1, 1, 1, payload(bench))
    };
    seed::apply(bench, &empty).await?;
    let per_tick = (RATE * TICK.as_millis() as u64 / 1_000) as i32;
    let ticks = SECONDS * 1_000 / TICK.as_millis() as u64;
    let expected = ticks * per_tick as u64;
    let daemons = drain::start(bench, &empty).await?;
    let db = bench.db.clone();
    let producer = tokio::spawn(async move {
        let mut interval = tokio::time::interval(TICK);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut versions = vec![0i32; STREAMS as usize];
        for t in 0..ticks {
            interval.tick().await;
            let s = (t % STREAMS as u64) as usize;
            db.append_ticks("steady", s as i64, versions[s], per_tick)
                .await?;
            versions[s] += per_tick;
        }
        Ok::<_, BenchError>(expected)
    });
    let run = drain::watch(
        bench,
        &empty,
        "steady 1000 events/s",
        expected,
        daemons,
        Some(producer),
    )
    .await?;
    let lat = bench.db.apply_latency("bench_0", 0).await?;
    out.details.push(format!(
        "{} events appended at {RATE}/s for {SECONDS} s over {STREAMS} streams; append -> applied p50 {:.1} ms, p99 {:.1} ms",
        lat.count, lat.p50, lat.p99
    ));
    out.details.push(format!(
        "apply p50/p99 {:.2}/{:.2} ms, claim p50/p99 {:.2}/{:.2} ms",
        run.apply.p50_ms, run.apply.p99_ms, run.claim.p50_ms, run.claim.p99_ms
    ));
    out.ratio(
        "append -> applied p99 / 100 ms",
        lat.p99 / 100.0,
        Some(Target::AtMost(1.0)),
    );
    Ok(out)
}
