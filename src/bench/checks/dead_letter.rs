//! Dead-lettering a poisoned backlog against applying the same backlog healthy.

use super::{payload, small_n, CheckOutcome, Target};
use crate::bench::drain;
use crate::bench::seed::{self, Seed};
use crate::bench::{Bench, BenchError, Check};

pub(super) async fn run(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::DeadLetter);
    let n = small_n(bench);
    let streams = bench.config.streams.min(n).max(1);
    let healthy = Seed::healthy(n, streams, 1, payload(bench));
    seed::apply(bench, &healthy).await?;
    let apply = drain::drain(bench, &healthy, "apply N healthy").await?;
    out.drain_line(&apply);

    let mut poison = healthy.clone();
    poison.perspectives[0].exhausted = true;
    seed::apply(bench, &poison).await?;
    let dlq = drain::drain(bench, &poison, "dead-letter N poison").await?;
    out.drain_line(&dlq);
    out.details.push(format!(
        "dead-lettered {} of {} rows",
        dlq.dead_lettered, dlq.rows
    ));
    out.ratio(
        "dead-letter time / apply time",
        dlq.elapsed.as_secs_f64() / apply.elapsed.as_secs_f64().max(1e-9),
        Some(Target::AtMost(2.0)),
    );
    Ok(out)
}
