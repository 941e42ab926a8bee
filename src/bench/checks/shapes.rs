//! Stream shapes: 200 long streams (also against the crash-safe limit) and one-event streams.

use super::{payload, CheckOutcome, Target};
use crate::bench::drain::{self, DrainRun};
use crate::bench::limit;
use crate::bench::seed::{self, Seed};
use crate::bench::{Bench, BenchError, Check};

pub(super) async fn run(bench: &Bench, main: &DrainRun) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::Shapes);
    let n = bench.config.events;
    let few = Seed::healthy(n, 200.min(n), 1, payload(bench));
    seed::apply(bench, &few).await?;
    let long = drain::drain(bench, &few, "200 long streams").await?;
    out.drain_line(&long);
    seed::apply(bench, &few).await?;
    let limit = limit::crash_safe(bench, &few.perspective_names(), few.rows()).await?;
    out.details.push(format!(
        "{} at 200 streams: {} rows in {:.2} s = {:.0} rows/s",
        limit.what,
        limit.rows,
        limit.elapsed.as_secs_f64(),
        limit.rate()
    ));
    out.ratio(
        "drain/limit at 200 streams",
        long.rate() / limit.rate().max(1e-9),
        Some(Target::AtLeast(0.8)),
    );
    out.ratio(
        "200 streams / main drain (rows/s)",
        long.rate() / main.rate().max(1e-9),
        None,
    );

    let many = Seed::healthy(n, n, 1, payload(bench));
    seed::apply(bench, &many).await?;
    let short = drain::drain(bench, &many, "one-event streams").await?;
    out.drain_line(&short);
    out.ratio(
        format!("{n} streams of 1 event / main drain (rows/s)"),
        short.rate() / main.rate().max(1e-9),
        None,
    );
    Ok(out)
}
