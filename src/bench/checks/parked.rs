//! A healthy perspective's drain beside 2 000 parked lanes against the same drain alone.

use super::{payload, small_n, CheckOutcome, Target};
use crate::bench::drain;
use crate::bench::seed::{self, Part, PerspectiveSpec, Seed};
use crate::bench::{Bench, BenchError, Check};

pub(super) async fn run(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::Parked);
    let n = small_n(bench);
    let streams = (bench.config.streams / 10).clamp(1, n);
    let solo = Seed::healthy(n, streams, 1, payload(bench));
    seed::apply(bench, &solo).await?;
    let alone = drain::drain(bench, &solo, "healthy alone").await?;
    out.drain_line(&alone);

    let mut beside = solo.clone();
    beside.perspectives.push(PerspectiveSpec {
        name: "bench_parked".into(),
        event_type: "Parked".into(),
        parked: true,
        exhausted: false,
        failing: false,
    });
    beside.parts.push(Part {
        salt: "parked".into(),
        streams: 2_000,
        per_stream: 1,
        event_type: "Parked".into(),
    });
    seed::apply(bench, &beside).await?;
    let with = drain::drain(bench, &beside, "healthy beside 2000 parked").await?;
    out.drain_line(&with);
    out.ratio(
        "healthy beside 2 000 parked lanes / alone (rows/s)",
        with.rate() / alone.rate().max(1e-9),
        Some(Target::AtLeast(0.8)),
    );
    Ok(out)
}
