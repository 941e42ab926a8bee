//! Fifty perspectives reading one backlog, against the main drain.

use super::{payload, CheckOutcome};
use crate::bench::drain::{self, DrainRun};
use crate::bench::seed::{self, Seed};
use crate::bench::{Bench, BenchError, Check};

pub(super) async fn run(bench: &Bench, main: &DrainRun) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::Perspectives);
    let events = (bench.config.events / 50).max(100);
    let streams = (bench.config.streams / 10).clamp(1, events);
    let fifty = Seed::healthy(events, streams, 50, payload(bench));
    seed::apply(bench, &fifty).await?;
    let run = drain::drain(bench, &fifty, "50 perspectives").await?;
    out.drain_line(&run);
    out.ratio(
        "50 perspectives / main drain (rows/s)",
        run.rate() / main.rate().max(1e-9),
        None,
    );
    Ok(out)
}
