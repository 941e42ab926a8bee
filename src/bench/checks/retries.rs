//! Retrying poison rows until the attempt limit dead-letters them, against applying the same
//! rows healthy: what one failed claim costs (the claim, a savepoint, the failure recorded and
//! the lane parked for its backoff) against one healthy apply. A requeue of thousands of dead
//! letters that still fail pays it max + 1 times each, beside the live work.

use std::time::Duration;

use super::{payload, small_n, CheckOutcome};
use crate::bench::drain;
use crate::bench::seed::{self, Seed};
use crate::bench::{Bench, BenchError, Check};

/// The attempt limit of the retried run (the default).
const ATTEMPTS: u32 = 10;

pub(super) async fn run(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::Retries);
    let n = small_n(bench);
    // One row per lane: the shape of a requeue, where every dead letter is its lane's head.
    let healthy = Seed::healthy(n, n, 1, payload(bench));
    seed::apply(bench, &healthy).await?;
    let apply = drain::drain(bench, &healthy, "apply N healthy").await?;
    out.drain_line(&apply);

    let mut failing = healthy.clone();
    failing.perspectives[0].failing = true;
    seed::apply(bench, &failing).await?;
    let retried = drain::drain_with(bench, &failing, "retry N poison", |s| {
        s.worker.max_perspective_event_attempts = Some(ATTEMPTS);
        // The backoff out of the way: the check measures the work, not the wait.
        s.worker.retry_backoff_base = Duration::from_millis(1);
        s.worker.retry_backoff_max = Duration::from_millis(1);
    })
    .await?;
    out.drain_line(&retried);
    let claims = n * u64::from(ATTEMPTS + 1);
    out.details.push(format!(
        "dead-lettered {} of {n} rows, each after {} claims ({} failed applies)",
        retried.dead_lettered,
        ATTEMPTS + 1,
        n * u64::from(ATTEMPTS)
    ));
    let per_claim = retried.elapsed.as_secs_f64() / claims as f64;
    let per_apply = apply.elapsed.as_secs_f64() / n.max(1) as f64;
    out.ratio(
        "time per failed claim / time per healthy apply",
        per_claim / per_apply.max(1e-12),
        None,
    );
    Ok(out)
}
