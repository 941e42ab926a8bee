//! A consumer loop: drain while there is work, then wait for a notification, the poll tick, or
//! shutdown. A database error never ends the loop: it backs off and tries again. A notification
//! wakes one idle loop, not every one (`daemon::wake`).
//!
//! A claim that found nothing is not repeated at the rate notifications arrive: producers
//! appending behind parked or leased heads notify on every commit, and claiming again for each
//! of them would spend the machine's CPU (the producers' too) on claims that cannot succeed.
//! After an empty claim a notification is acted on no sooner than [`EMPTY_CLAIM_COOLDOWN`]
//! after that claim began (River's fetch cooldown); a claim that found work claims again at
//! once.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::wake::Waiter;
use crate::pipeline::Pipeline;

/// The least time between an empty claim and the next one a notification triggers.
pub const EMPTY_CLAIM_COOLDOWN: Duration = Duration::from_millis(25);

/// Runs one consumer loop until `shutdown`. A batch in progress is finished before it returns.
pub async fn run(
    id: usize,
    pipeline: Pipeline,
    mut wake: Waiter,
    poll_interval: Duration,
    shutdown: CancellationToken,
    beat: impl Fn() + Send,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        beat();
        if shutdown.is_cancelled() {
            break;
        }
        // Seen before claiming: a notification from now on wakes the wait below at once.
        wake.before_claim();
        let claimed_at = tokio::time::Instant::now();
        match pipeline.drain_once_unless(&shutdown).await {
            Ok(outcome) if outcome.claimed > 0 => {
                backoff = Duration::from_millis(100);
                tracing::debug!(consumer = id, ?outcome, "batch done");
                // Let other tasks (renewal, HTTP) in between busy batches.
                tokio::task::yield_now().await;
            }
            Ok(_) => {
                backoff = Duration::from_millis(100);
                let every = pipeline.claims_every_perspective();
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = wake.wait(every) => {
                        tokio::select! {
                            _ = shutdown.cancelled() => break,
                            _ = tokio::time::sleep_until(claimed_at + EMPTY_CLAIM_COOLDOWN) => {}
                        }
                    }
                    _ = tokio::time::sleep(poll_interval) => {}
                }
            }
            Err(error) => {
                if error.is_database_unavailable() {
                    tracing::warn!(consumer = id, %error, retry_in = ?backoff, "database unavailable; backing off");
                } else {
                    tracing::error!(consumer = id, %error, retry_in = ?backoff, "drain pass failed; backing off");
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
    tracing::debug!(consumer = id, "consumer loop stopped");
}
