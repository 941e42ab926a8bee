//! The careful pass: one savepoint per event, so that one pass decides every event it reaches.
//! A retryable failure charges only its row and gives back the rows behind it in its lane; a
//! permanent one dead-letters its row and the lane goes on; everything else is applied.

use std::collections::HashSet;

use uuid::Uuid;

use super::context::{ApplyContext, Lane};
use super::judge::{self, Failure, Verdict};
use crate::pipeline::backoff::retry_delay;
use crate::pipeline::lease::LeasedBatch;
use crate::pipeline::settle::{self, Abort, ApplyBatchError, BatchOutcome, Decisions, PassTx};
use crate::store::{StoreError, WorkStore, WorkTx};

/// How a careful pass ended when it did not settle.
pub(super) enum Careful {
    /// As any pass: the batch failed, or a lock conflict.
    Abort(Abort),
    /// The event at `lane`/`event` failed in a way that took the transaction down with it (a
    /// timeout, a statement that broke its connection): rolled back, to be charged on its own
    /// statement.
    Poisoned {
        lane: usize,
        event: usize,
        error: String,
    },
}

impl From<Abort> for Careful {
    fn from(a: Abort) -> Self {
        Careful::Abort(a)
    }
}

impl From<StoreError> for Careful {
    fn from(e: StoreError) -> Self {
        Careful::Abort(e.into())
    }
}

/// Runs the careful pass over `lanes` and settles it. Rows in `skip` are completed without
/// applying.
pub(super) async fn apply_careful<S: WorkStore>(
    ctx: &ApplyContext<S>,
    lease: &mut LeasedBatch<S>,
    lanes: &[Lane],
    skip: &mut HashSet<Uuid>,
) -> Result<BatchOutcome, Careful> {
    let mut ptx = PassTx::begin(
        &ctx.store,
        ctx.apply_timeout,
        &ctx.inflight,
        ctx.cooldown.as_ref(),
    )
    .await?;
    let mut decisions = Decisions::default();
    for (li, lane) in lanes.iter().enumerate() {
        let perspective = lane.perspective.as_ref();
        for (i, ev) in lane.events.iter().enumerate() {
            if skip.contains(&ev.event_work_id) {
                decisions.skip(ev);
                continue;
            }
            decisions.reach(ev);
            ptx.tx.savepoint().await?;
            lease.mark_started([ev.event_work_id]);
            let mut result = judge::call(ctx, perspective, ev, &mut ptx.tx).await;
            if matches!(&result, Err(e) if judge::is_stale_plan(e)) {
                heal_stale_plan(&mut ptx).await?;
                tracing::info!(
                    perspective = %ev.perspective_name,
                    "a cached statement plan went stale after a schema change; the connection's statement cache was cleared and the event is applied again"
                );
                result = judge::call(ctx, perspective, ev, &mut ptx.tx).await;
            }
            let error = match result {
                Ok(()) => {
                    ptx.tx.release_savepoint().await?;
                    ptx.mark(perspective, ev.event_work_id, skip);
                    decisions.applied(ev);
                    continue;
                }
                Err(Failure::TimedOut) => {
                    // The connection may still be running the handler's statement.
                    ptx.abandon(&ctx.store).await;
                    return Err(Careful::Poisoned {
                        lane: li,
                        event: i,
                        error: judge::timed_out(ctx),
                    });
                }
                Err(Failure::Error(error)) => error,
            };
            let rolled_back = ptx.tx.rollback_to_savepoint().await.is_ok();
            match judge::judge(ctx, error).await {
                Verdict::Charge(error) => {
                    decisions.failed(ev, error, backoff(ctx, ev), &lane.events[i + 1..]);
                    break;
                }
                // A statement that left the transaction usable is charged in it.
                Verdict::Poisoned(error) if rolled_back => {
                    decisions.failed(ev, error, backoff(ctx, ev), &lane.events[i + 1..]);
                    break;
                }
                Verdict::Permanent(error) => decisions.dead_letter(ev, error),
                Verdict::Conflict(reason) => {
                    return Err(Abort::Conflict {
                        event: Some(i),
                        reason,
                    }
                    .into());
                }
                Verdict::Poisoned(error) => {
                    ptx.abandon(&ctx.store).await;
                    return Err(Careful::Poisoned {
                        lane: li,
                        event: i,
                        error,
                    });
                }
                Verdict::Unavailable(reason) => {
                    return Err(Abort::Batch(ApplyBatchError::Unavailable(reason)).into());
                }
            }
        }
    }
    let settled = settle::commit(lease, ptx, decisions, || {
        lanes.iter().flat_map(Lane::ids).collect()
    })
    .await?;
    Ok(settled)
}

/// The backoff of an event's next failure.
fn backoff<S: WorkStore>(
    ctx: &ApplyContext<S>,
    ev: &crate::perspective::EventEnvelope,
) -> std::time::Duration {
    let failures = u32::try_from(ev.failures).unwrap_or(0).saturating_add(1);
    retry_delay(failures, ctx.backoff_base, ctx.backoff_max)
}

/// The connection's cached statement is stale (DDL changed its result type): the connection's
/// failure, not the event's. Forget the connection's cached statements and open the savepoint
/// again, so the event runs once more, uncharged.
async fn heal_stale_plan<S: WorkStore>(ptx: &mut PassTx<S>) -> Result<(), StoreError> {
    ptx.tx.rollback_to_savepoint().await?;
    if let Some(conn) = ptx.tx.connection() {
        use sqlx::Connection as _;
        conn.clear_cached_statements()
            .await
            .map_err(StoreError::from)?;
    }
    ptx.tx.savepoint().await
}
