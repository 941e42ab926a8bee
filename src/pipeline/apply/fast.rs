//! The optimistic pass: every event of the lanes in one transaction, no savepoints. The
//! statements of SQL-perspective lanes go to the database in one call that also completes the
//! pass's rows; Rust perspectives are called one event at a time. Any failure gives the pass
//! up (`None`): the careful pass decides again, event by event.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::context::{ApplyContext, Lane};
use super::judge::{self, Failure};
use crate::perspective::{ApplyError, EventEnvelope, Perspective};
use crate::pipeline::lease::LeasedBatch;
use crate::pipeline::settle::{self, Abort, BatchOutcome, Decisions, PassTx};
use crate::store::{StatementBatch, StatementParams, WorkStore, WorkTx};
use crate::telemetry::metrics as m;

/// Runs the optimistic pass over `lanes` and settles it; `None` = some event failed (rolled
/// back; nothing decided). Rows in `skip` are completed without applying.
pub(super) async fn apply_fast<S: WorkStore>(
    ctx: &ApplyContext<S>,
    lease: &mut LeasedBatch<S>,
    lanes: &[Lane],
    skip: &mut HashSet<Uuid>,
) -> Result<Option<BatchOutcome>, Abort> {
    // When every lane is applied set-wise, the pass is the statements' call and nothing else:
    // its transaction is that call alone (one round trip), all or nothing.
    let all_set_wise = lanes.iter().all(|lane| {
        lane.events
            .iter()
            .all(|e| lane.perspective.batch_statement(&e.event_type).is_some())
    });
    let mut ptx = if all_set_wise {
        PassTx::begin_deferred(
            &ctx.store,
            ctx.apply_timeout,
            &ctx.inflight,
            ctx.cooldown.as_ref(),
        )
        .await?
    } else {
        PassTx::begin(
            &ctx.store,
            ctx.apply_timeout,
            &ctx.inflight,
            ctx.cooldown.as_ref(),
        )
        .await?
    };
    let mut decisions = Decisions::default();
    // Lanes of SQL perspectives are applied set-wise: their statements go to the database in
    // one round trip, after the other lanes (lanes are independent; each keeps its order).
    let mut statements = StatementBatch::default();
    let mut batched: Vec<(&dyn Perspective, &EventEnvelope)> = Vec::new();
    for lane in lanes {
        let perspective = lane.perspective.as_ref();
        let set_wise = ptx.tx.has_database()
            && lane
                .events
                .iter()
                .all(|e| perspective.batch_statement(&e.event_type).is_some());
        for (i, ev) in lane.events.iter().enumerate() {
            if skip.contains(&ev.event_work_id) {
                decisions.skip(ev);
                continue;
            }
            decisions.reach(ev);
            if set_wise {
                if let Some(statement) = perspective.batch_statement(&ev.event_type) {
                    statements.push(statement, params(ev));
                    batched.push((perspective, ev));
                    continue;
                }
            }
            lease.mark_started([ev.event_work_id]);
            match judge::call(ctx, perspective, ev, &mut ptx.tx).await {
                Ok(()) => {
                    ptx.mark(perspective, ev.event_work_id, skip);
                    decisions.applied(ev);
                }
                Err(Failure::Error(ApplyError::Conflict(reason))) => {
                    return Err(Abort::Conflict {
                        event: Some(i),
                        reason,
                    });
                }
                Err(Failure::TimedOut) => {
                    ptx.abandon(&ctx.store).await;
                    return Ok(None);
                }
                Err(Failure::Error(_)) => return Ok(None),
            }
        }
    }
    if !statements.is_empty() {
        if !run_statements(ctx, lease, &mut ptx, &mut decisions, &statements, &batched).await {
            return Ok(None);
        }
        ptx.mark_all(batched.iter().copied(), skip);
        for (_, ev) in &batched {
            decisions.applied(ev);
        }
    }
    settle::commit(lease, ptx, decisions, || {
        lanes.iter().flat_map(Lane::ids).collect()
    })
    .await
    .map(Some)
}

/// The statements of the batched events and the completion of every row of the pass, in one
/// call through the lease handle. False = some statement failed (or the call outlived one
/// apply's deadline): the rows are handed over again by the careful pass.
async fn run_statements<S: WorkStore>(
    ctx: &ApplyContext<S>,
    lease: &mut LeasedBatch<S>,
    ptx: &mut PassTx<S>,
    decisions: &mut Decisions,
    statements: &StatementBatch<'_>,
    batched: &[(&dyn Perspective, &EventEnvelope)],
) -> bool {
    let mut to_complete = decisions.done.clone();
    to_complete.extend(batched.iter().map(|(_, ev)| ev.event_work_id));
    let started = Instant::now();
    let deadline = ctx.apply_timeout + Duration::from_millis(250);
    // Every batched row is handed to the call: if shutdown abandons the pass while the call
    // runs, none of them is refunded (the one whose statement was running keeps its attempt,
    // so a statement slower than the grace is charged across restarts).
    let ids = || batched.iter().map(|(_, ev)| ev.event_work_id);
    lease.mark_started(ids());
    let result = tokio::time::timeout(
        deadline,
        lease.apply_and_complete_in(&mut ptx.tx, &mut decisions.staged, statements, &to_complete),
    )
    .await;
    match result {
        Ok(Ok(all_ours)) => {
            decisions.completed_with_statements = Some(all_ours);
            record_durations(
                batched,
                started.elapsed().as_secs_f64() / statements.len() as f64,
            );
            true
        }
        Ok(Err(_)) => {
            lease.unmark_started(ids());
            false
        }
        Err(_) => {
            // The connection may still run the statement: cancel it before the rollback.
            lease.unmark_started(ids());
            ptx.cancel(&ctx.store).await;
            false
        }
    }
}

/// One call for all: each event is credited its share of the time, with one histogram handle
/// per run of a perspective, not a lookup per event.
fn record_durations(batched: &[(&dyn Perspective, &EventEnvelope)], share: f64) {
    let mut histogram: Option<(&str, metrics::Histogram)> = None;
    for (_, ev) in batched {
        match &histogram {
            Some((name, h)) if *name == ev.perspective_name => h.record(share),
            _ => {
                let h = metrics::histogram!(m::APPLY_DURATION_SECONDS,
                    m::LABEL_PERSPECTIVE => ev.perspective_name.clone());
                h.record(share);
                histogram = Some((ev.perspective_name.as_str(), h));
            }
        }
    }
}

/// The seven parameters of an event's statement.
fn params(ev: &EventEnvelope) -> StatementParams<'_> {
    StatementParams {
        data: &ev.data,
        stream_id: ev.stream_id,
        event_id: ev.event_id,
        event_type: &ev.event_type,
        global_position: ev.global_position,
        stream_version: ev.stream_version,
        metadata: &ev.metadata,
    }
}
