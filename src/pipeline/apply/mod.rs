//! The apply stage: run handlers in stream order per lane, and complete the work rows in the
//! same transaction as the handlers' writes (exactly-once effects for SQL perspectives).
//!
//! A batch is first applied optimistically in one transaction with no savepoints: the
//! statements of every SQL-perspective event in one call (`apply_perspective_statements`),
//! Rust perspectives one call per event, then complete and commit, so a batch of SQL events
//! costs a handful of round trips, not one per event. If any handler fails, that transaction is rolled
//! back and the batch is applied again carefully, one savepoint per event (lanes holding a row
//! that failed before, which usually fails again, skip the optimistic pass and are applied
//! carefully in a transaction of their own, so that one retry does not make the whole batch run
//! twice), so that in one pass:
//! - a retryable failure charges only the failing row (failures + 1, parked for the backoff)
//!   and gives the rows behind it in its lane back unstarted, with a refund;
//! - a permanent failure dead-letters the row at once (`PermanentFailure`) and the lane goes on;
//! - every other row is applied and completed.
//!
//! Every apply has a deadline (`worker.apply_timeout`; SQL statements also get it as their
//! `statement_timeout`). A failure that takes the whole transaction down with it (a handler
//! that timed out, a statement that killed its own connection) is charged to its row on its own
//! statement, and the careful pass runs again without the rest of that lane.
//!
//! Whether "the database is unavailable" (give everything back, charge nobody) is decided by
//! asking the database, never from the SQLSTATE a statement returned: a statement that fails
//! the same way every time is eventually charged and dead-lettered, whatever its code. Lock
//! conflicts are retried uncharged a few times, then charged too.
//!
//! The apply stage *decides* (per event: applied, failed with a backoff, dead-letter, skip);
//! the settle stage ([`crate::pipeline::settle`]) hands each pass's decisions to the lease
//! handle ([`LeasedBatch`]) in the pass's transaction, which reports them once durable.
//!
//! Which rows to skip (cooled) the cooldown stage said before; a successful apply is marked in
//! the cache right after it. For perspectives whose effects all go through the transaction, a
//! rolled-back mark is forgotten again (their effects were rolled back too); an effect outside
//! it stays done, so a later pass of the batch skips its row.
//!
//! The files: [`fast`](self) (the optimistic pass), `careful` (a savepoint per event), `judge`
//! (a handler call and what its failure means); this one holds the strategy between them.

mod careful;
mod context;
mod fast;
mod judge;

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use self::careful::{apply_careful, Careful};
pub use self::context::ApplyContext;
use self::context::{lanes, Lane};
use self::fast::apply_fast;
use super::backoff::retry_delay;
use super::envelope::EventEnvelope;
use super::lease::LeasedBatch;
use super::settle::Abort;
pub use super::settle::{ApplyBatchError, BatchOutcome};
use crate::store::WorkStore;

/// How many batches run one lane per transaction after a lock conflict before whole-batch
/// transactions are tried again.
const SMALL_TRANSACTION_BATCHES: u32 = 20;

/// How many times a lane is run before a lock conflict is charged to the row that hit it.
const CONFLICT_ROUNDS: u64 = 4;

/// Applies one batch of typed events (all leased to us through `lease`, ordered by stream,
/// perspective, stream_version); the rows of `skip` (cooled) are completed without applying.
/// Every row of `events` is settled (completed, failed, dead-lettered or given back) when this
/// returns Ok.
pub async fn apply_batch<S: WorkStore>(
    ctx: &ApplyContext<S>,
    lease: &mut LeasedBatch<S>,
    events: Vec<EventEnvelope>,
    mut skip: HashSet<Uuid>,
) -> Result<BatchOutcome, ApplyBatchError> {
    let skip = &mut skip;
    let (lanes, unhandled) = lanes(ctx, events);
    let mut outcome = BatchOutcome::default();
    if !unhandled.is_empty() {
        outcome.released += lease.release(&unhandled).await? as usize;
    }
    if lanes.is_empty() {
        return Ok(outcome);
    }
    // One transaction for the whole batch is cheapest, but batches of concurrent consumers
    // that update shared read-model rows (aggregates) in different orders deadlock, and a
    // deadlock costs PostgreSQL's deadlock_timeout to detect. After a conflict the batch (and
    // the next few) run one lane per transaction: short transactions rarely deadlock, and a
    // lane that still conflicts is retried alone, then charged.
    let small = ctx
        .small_transactions
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok();
    // A row that failed before usually fails again, and one failure rolls the optimistic pass
    // back for every lane in it: when a requeue of 7 500 dead letters put a retry in nearly every
    // batch, every healthy row was applied twice and the machine's other work waited. So lanes
    // holding a retry run in a careful pass of their own, the rest optimistically.
    let (retrying, first): (Vec<Lane>, Vec<Lane>) = lanes.into_iter().partition(Lane::retries);
    if !small {
        let mut conflict = None;
        for (group, pass) in [(&first, Pass::Optimistic), (&retrying, Pass::Careful)] {
            if group.is_empty() {
                continue;
            }
            match run_lanes(ctx, lease, group, skip, pass).await {
                Err(Abort::Conflict { reason, .. }) => {
                    conflict = Some(reason);
                    break;
                }
                Err(Abort::Batch(e)) => return Err(e),
                Ok(o) => outcome.merge(o),
            }
        }
        match conflict {
            None => return Ok(outcome),
            Some(reason) => {
                ctx.small_transactions
                    .store(SMALL_TRANSACTION_BATCHES, Ordering::Relaxed);
                tracing::debug!(%reason, "batch lost a lock conflict; applying it one lane per transaction");
            }
        }
    }
    for mut lane in first.into_iter().chain(retrying) {
        // A failed whole-batch pass may already have settled some rows (a lane charged on its
        // own statement): only what is still ours is applied.
        lane.events.retain(|e| lease.holds(e.event_work_id));
        if !lane.events.is_empty() {
            outcome.merge(run_lane_alone(ctx, lease, lane, skip).await?);
        }
    }
    Ok(outcome)
}

/// One lane in its own transactions: retried on lock conflicts, then charged.
async fn run_lane_alone<S: WorkStore>(
    ctx: &ApplyContext<S>,
    lease: &mut LeasedBatch<S>,
    lane: Lane,
    skip: &mut HashSet<Uuid>,
) -> Result<BatchOutcome, ApplyBatchError> {
    let mut round = 0u64;
    let pass = if lane.retries() {
        Pass::Careful
    } else {
        Pass::Optimistic
    };
    loop {
        round += 1;
        match run_lanes(ctx, lease, std::slice::from_ref(&lane), skip, pass).await {
            Ok(o) => return Ok(o),
            Err(Abort::Batch(e)) => return Err(e),
            Err(Abort::Conflict { event, reason }) if round < CONFLICT_ROUNDS => {
                let at = event.unwrap_or(0);
                lease
                    .note_error(lane.events[at].event_work_id, &reason)
                    .await;
                let jitter = (Uuid::new_v4().as_u128() % 20) as u64;
                let pause = Duration::from_millis(5 * round + jitter);
                tracing::debug!(round, ?pause, %reason, "lane lost a lock conflict; retrying it");
                tokio::time::sleep(pause).await;
            }
            Err(Abort::Conflict { event, reason }) => {
                // The same conflict every time is the row's own doing (or a statement that
                // raises a conflict SQLSTATE): charge it, so it ends dead-lettered instead of
                // blocking its lane for good.
                tracing::warn!(rounds = round, %reason, "lane kept losing lock conflicts; charging the row that hit them");
                let at = event.unwrap_or(0);
                return settle_poisoned(ctx, lease, &lane, at, &reason).await;
            }
        }
    }
}

/// Where [`run_lanes`] starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    /// The optimistic pass first (no savepoints), the careful one only if an event fails.
    Optimistic,
    /// The careful pass at once (lanes holding a retry, which usually fails again).
    Careful,
}

/// The optimistic pass (unless `pass` says careful), then careful passes until every lane is
/// settled. Lanes whose event took a transaction down are settled on their own and the careful
/// pass runs again without them. The lanes are borrowed: a copy is made only on that rare path
/// (copying every envelope of every batch, in case, was a tenth of the daemon's CPU).
async fn run_lanes<S: WorkStore>(
    ctx: &ApplyContext<S>,
    lease: &mut LeasedBatch<S>,
    lanes: &[Lane],
    skip: &mut HashSet<Uuid>,
    pass: Pass,
) -> Result<BatchOutcome, Abort> {
    if pass == Pass::Optimistic {
        if let Some(fast) = apply_fast(ctx, lease, lanes, skip).await? {
            return Ok(fast);
        }
    }
    let mut lanes = std::borrow::Cow::Borrowed(lanes);
    let mut outcome = BatchOutcome::default();
    loop {
        match apply_careful(ctx, lease, &lanes, skip).await {
            Ok(o) => {
                outcome.merge(o);
                return Ok(outcome);
            }
            Err(Careful::Poisoned { lane, event, error }) => {
                let poisoned = lanes.to_mut().remove(lane);
                outcome.merge(
                    settle_poisoned(ctx, lease, &poisoned, event, &error)
                        .await
                        .map_err(Abort::Batch)?,
                );
                // The events before it are still ours and still to apply: keep them.
                if event > 0 {
                    lanes.to_mut().insert(
                        lane,
                        Lane {
                            perspective: Arc::clone(&poisoned.perspective),
                            events: poisoned.events[..event].to_vec(),
                        },
                    );
                }
                if lanes.is_empty() {
                    return Ok(outcome);
                }
            }
            Err(Careful::Abort(abort)) => return Err(abort),
        }
    }
}

/// Charges the event at `at` of `lane` on its own statement and gives back the rows behind it.
async fn settle_poisoned<S: WorkStore>(
    ctx: &ApplyContext<S>,
    lease: &mut LeasedBatch<S>,
    lane: &Lane,
    at: usize,
    error: &str,
) -> Result<BatchOutcome, ApplyBatchError> {
    let ev = &lane.events[at];
    let failures = u32::try_from(ev.failures).unwrap_or(0).saturating_add(1);
    let delay = retry_delay(failures, ctx.backoff_base, ctx.backoff_max);
    let mut outcome = BatchOutcome::default();
    if lease.fail_now(ev.event_work_id, error, delay).await? {
        outcome.failed += 1;
    }
    let behind: Vec<Uuid> = lane.events[at + 1..]
        .iter()
        .map(|e| e.event_work_id)
        .collect();
    outcome.released += lease.release(&behind).await? as usize;
    Ok(outcome)
}
