//! One pass of the apply stage over some lanes, in one transaction: the optimistic pass (no
//! savepoints) and the careful one (a savepoint per event), their bookkeeping, and how a failed
//! handler call is judged. [`super::apply_batch`] decides which passes run.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::{ApplyBatchError, ApplyContext, BatchOutcome, Lane};
use crate::perspective::{ApplyError, ApplyTx, EventEnvelope, Perspective};
use crate::pipeline::backoff::retry_delay;
use crate::pipeline::lease::{LeasedBatch, Staged};
use crate::store::{
    StatementBatch, StatementParams, StoreError, WorkStore, WorkTx, FAILURE_PERMANENT,
};
use crate::telemetry::metrics as m;

/// How long we ask the database whether it is there before calling it unavailable.
const HEALTH_PROBE: Duration = Duration::from_secs(2);

/// Per-perspective counters of applies and cooled rows, published once the pass commits.
#[derive(Default)]
struct Tally {
    applied: BTreeMap<String, u64>,
    cooled: BTreeMap<String, u64>,
}

impl Tally {
    /// One more for `perspective` (its name is copied once per pass, not once per event).
    fn count(map: &mut BTreeMap<String, u64>, perspective: &str) {
        match map.get_mut(perspective) {
            Some(n) => *n += 1,
            None => {
                map.insert(perspective.to_string(), 1);
            }
        }
    }

    fn publish(self) {
        for (p, n) in self.applied {
            metrics::counter!(m::EVENTS_APPLIED_TOTAL, m::LABEL_PERSPECTIVE => p).increment(n);
        }
        for (p, n) in self.cooled {
            metrics::counter!(m::COOLDOWN_SKIPS_TOTAL, m::LABEL_PERSPECTIVE => p).increment(n);
        }
    }
}

/// Marks made during one transaction, to forget again if it does not commit.
#[derive(Default)]
struct Marks {
    ids: Vec<Uuid>,
    /// The transaction is a database's (effects through it roll back with it). Without one
    /// (the memory store), every effect is outside any transaction, so a mark is always kept:
    /// an event applied in a pass that then rolls back is completed, not applied again.
    transactional: bool,
}

impl Marks {
    fn mark<S: WorkStore>(
        &mut self,
        ctx: &ApplyContext<S>,
        perspective: &dyn Perspective,
        id: Uuid,
    ) {
        if let Some(cache) = &ctx.cooldown {
            cache.mark(id);
            if self.transactional && perspective.effects_in_transaction() {
                self.ids.push(id);
            }
        }
    }

    fn forget<S: WorkStore>(self, ctx: &ApplyContext<S>) {
        if let Some(cache) = &ctx.cooldown {
            for id in self.ids {
                cache.forget(id);
            }
        }
    }
}

/// The bookkeeping of one pass over some lanes (one transaction).
struct Pass {
    marks: Marks,
    tally: Tally,
    /// Rows to complete in this transaction.
    done: Vec<Uuid>,
    /// Changes staged on leased rows, reported after commit.
    staged: Staged,
    outcome: BatchOutcome,
}

impl Pass {
    fn new(transactional: bool) -> Pass {
        Pass {
            marks: Marks {
                ids: Vec::new(),
                transactional,
            },
            tally: Tally::default(),
            done: Vec::new(),
            staged: Staged::default(),
            outcome: BatchOutcome::default(),
        }
    }

    /// A cooled row: completed without re-applying.
    fn cooled(&mut self, ev: &EventEnvelope) {
        Tally::count(&mut self.tally.cooled, &ev.perspective_name);
        self.outcome.cooled += 1;
        self.done.push(ev.event_work_id);
    }

    /// Successful applies of a statement batch: as [`Pass::applied`] for each, with the
    /// cooldown cache marked once for all.
    fn applied_batch<S: WorkStore>(
        &mut self,
        ctx: &ApplyContext<S>,
        batched: &[(&Lane, &EventEnvelope)],
    ) {
        if let Some(cache) = &ctx.cooldown {
            let ids: Vec<Uuid> = batched.iter().map(|(_, ev)| ev.event_work_id).collect();
            cache.mark_all(&ids);
            if self.marks.transactional {
                self.marks.ids.extend(
                    batched
                        .iter()
                        .filter(|(lane, _)| lane.perspective.effects_in_transaction())
                        .map(|(_, ev)| ev.event_work_id),
                );
            }
        }
        for (_, ev) in batched {
            Tally::count(&mut self.tally.applied, &ev.perspective_name);
            self.outcome.applied += 1;
            self.done.push(ev.event_work_id);
        }
    }

    /// A successful apply: cooled from now on, completed with the transaction.
    fn applied<S: WorkStore>(
        &mut self,
        ctx: &ApplyContext<S>,
        perspective: &dyn Perspective,
        ev: &EventEnvelope,
    ) {
        self.marks.mark(ctx, perspective, ev.event_work_id);
        Tally::count(&mut self.tally.applied, &ev.perspective_name);
        self.outcome.applied += 1;
        self.done.push(ev.event_work_id);
    }
}

/// How a pass ended when it did not commit.
pub(super) enum Abort {
    /// The database (or our use of it) failed as a whole.
    Batch(ApplyBatchError),
    /// A lock conflict at `event` of the pass's lane (None = at completion or commit; only
    /// read when the pass ran one lane). The transaction was rolled back.
    Conflict {
        event: Option<usize>,
        reason: String,
    },
    /// The event at `lane`/`event` failed in a way that took the transaction down with it (a
    /// timeout, a statement that broke its connection). Rolled back; the event is to be
    /// charged on its own statement.
    Poisoned {
        lane: usize,
        event: usize,
        error: String,
    },
}

impl From<StoreError> for Abort {
    fn from(e: StoreError) -> Self {
        Abort::Batch(ApplyBatchError::Store(e))
    }
}

impl From<sqlx::Error> for Abort {
    fn from(e: sqlx::Error) -> Self {
        Abort::Batch(ApplyBatchError::from(e))
    }
}

fn is_cooled<S: WorkStore>(ctx: &ApplyContext<S>, id: Uuid) -> bool {
    ctx.cooldown.as_ref().is_some_and(|c| c.is_cooled(id))
}

/// Whether a handler failed because a statement its connection had prepared and cached no
/// longer matches the schema (SQLSTATE 0A000, "cached plan must not change result type",
/// after an `ALTER TABLE` or a re-created function): a failure of the connection's statement
/// cache, which clearing it heals.
fn is_stale_plan(e: &ApplyError) -> bool {
    e.message()
        .contains("cached plan must not change result type")
}

/// What one handler call produced.
enum Applied {
    Done,
    Failed(ApplyError),
    TimedOut,
}

async fn timed_apply<S: WorkStore>(
    ctx: &ApplyContext<S>,
    perspective: &dyn Perspective,
    ev: &EventEnvelope,
    tx: &mut S::Tx,
) -> Applied {
    let started = Instant::now();
    // A little later than the statement_timeout of SQL perspectives, so their statements end
    // cleanly on the server (a savepoint can roll back) before the transaction is given up.
    let deadline = ctx.apply_timeout + Duration::from_millis(250);
    let mut apply_tx = match tx.connection() {
        Some(conn) => ApplyTx::postgres(conn),
        None => ApplyTx::none(),
    };
    let result = tokio::time::timeout(deadline, perspective.apply(ev, &mut apply_tx)).await;
    metrics::histogram!(m::APPLY_DURATION_SECONDS, m::LABEL_PERSPECTIVE => ev.perspective_name.clone())
        .record(started.elapsed().as_secs_f64());
    match result {
        Ok(Ok(())) => Applied::Done,
        Ok(Err(e)) => Applied::Failed(e),
        Err(_) => Applied::TimedOut,
    }
}

/// Whether the database answers at all (on any connection of the pool, within a moment).
async fn database_answers<S: WorkStore>(store: &S) -> bool {
    matches!(
        tokio::time::timeout(HEALTH_PROBE, store.ping()).await,
        Ok(Ok(()))
    )
}

/// A batch transaction and its server process, listed for shutdown while it runs.
struct BatchTx<S: WorkStore> {
    tx: S::Tx,
    guard: Option<crate::pipeline::inflight::BackendGuard>,
}

impl<S: WorkStore> BatchTx<S> {
    async fn begin(ctx: &ApplyContext<S>) -> Result<BatchTx<S>, StoreError> {
        let tx = ctx.store.begin_batch(ctx.apply_timeout).await?;
        let guard = tx.backend().map(|pid| ctx.inflight.register_backend(pid));
        Ok(BatchTx { tx, guard })
    }

    /// Gives the transaction up while its connection may still be running a statement: cancel
    /// that statement on the server (so the rollback does not wait for it and its locks go),
    /// then drop the transaction, which rolls it back.
    async fn abandon(self, store: &S) {
        if let Some(pid) = self.guard.as_ref().map(|g| g.pid()) {
            match tokio::time::timeout(HEALTH_PROBE, store.cancel_backend(pid)).await {
                Ok(Ok(_)) => {}
                Ok(Err(error)) => {
                    tracing::debug!(%error, pid, "could not cancel a batch statement")
                }
                Err(_) => tracing::debug!(pid, "cancelling a batch statement got no answer"),
            }
        }
        drop(self.tx);
    }
}

/// What a failed handler call means for the pass, once the database has been asked.
enum Verdict {
    /// Charge the row (retryable), in this transaction.
    Charge(String),
    /// Dead-letter the row (permanent), in this transaction.
    Permanent(String),
    /// A lock conflict: retry the transaction, uncharged (for a while).
    Conflict(String),
    /// The statement broke the transaction or its connection: charge it on its own.
    Poisoned(String),
    /// The database is gone: give everything back, charge nobody.
    Unavailable(String),
}

async fn judge<S: WorkStore>(ctx: &ApplyContext<S>, failure: Applied) -> Verdict {
    match failure {
        Applied::Done => unreachable!("judge is only called for failures"),
        Applied::TimedOut => Verdict::Poisoned(format!(
            "apply timed out after {} (worker.apply_timeout)",
            humantime::format_duration(ctx.apply_timeout)
        )),
        Applied::Failed(ApplyError::Retryable(m)) => Verdict::Charge(m),
        // Without a dead-letter store (the memory store) the row stays and is retried.
        Applied::Failed(ApplyError::Permanent(m)) if !ctx.store.has_dead_letters() => {
            Verdict::Charge(m)
        }
        Applied::Failed(ApplyError::Permanent(m)) => Verdict::Permanent(m),
        Applied::Failed(ApplyError::Conflict(m)) => Verdict::Conflict(m),
        Applied::Failed(ApplyError::Unavailable(m)) => {
            if database_answers(&ctx.store).await {
                // The database is fine: the statement failed by itself (it raised a connection
                // SQLSTATE, or killed its own backend).
                Verdict::Poisoned(m)
            } else {
                Verdict::Unavailable(m)
            }
        }
    }
}

/// Every event in one transaction, no savepoints. `None` = a handler failed (rolled back; the
/// careful pass sorts the batch out).
pub(super) async fn apply_fast<S: WorkStore>(
    ctx: &ApplyContext<S>,
    lease: &mut LeasedBatch<S>,
    lanes: &[Lane],
) -> Result<Option<BatchOutcome>, Abort> {
    let mut btx = BatchTx::begin(ctx).await?;
    let mut pass = Pass::new(btx.tx.has_database());
    // Lanes of SQL perspectives are applied set-wise: their statements go to the database in
    // one round trip, after the other lanes (lanes are independent; each keeps its order).
    let mut statements = StatementBatch::default();
    let mut batched: Vec<(&Lane, &EventEnvelope)> = Vec::new();
    // The batch's cooled rows, looked up under one lock.
    let cooled: HashSet<Uuid> = match &ctx.cooldown {
        Some(cache) => cache
            .cooled_among(
                lanes
                    .iter()
                    .flat_map(|l| l.events.iter().map(|e| e.event_work_id)),
            )
            .into_iter()
            .collect(),
        None => HashSet::new(),
    };
    for lane in lanes {
        let set_wise = btx.tx.has_database()
            && lane
                .events
                .iter()
                .all(|e| lane.perspective.batch_statement(&e.event_type).is_some());
        for (i, ev) in lane.events.iter().enumerate() {
            if cooled.contains(&ev.event_work_id) {
                pass.cooled(ev);
                continue;
            }
            if set_wise {
                if let Some(statement) = lane.perspective.batch_statement(&ev.event_type) {
                    // Marked started just before the call that runs it (below), and unmarked
                    // if that call fails: the careful pass then marks exactly the events it
                    // hands over.
                    statements.push(statement, params(ev));
                    batched.push((lane, ev));
                    continue;
                }
            }
            lease.mark_started(ev.event_work_id);
            match timed_apply(ctx, lane.perspective.as_ref(), ev, &mut btx.tx).await {
                Applied::Done => pass.applied(ctx, lane.perspective.as_ref(), ev),
                Applied::Failed(ApplyError::Conflict(reason)) => {
                    pass.marks.forget(ctx);
                    drop(btx);
                    return Err(Abort::Conflict {
                        event: Some(i),
                        reason,
                    });
                }
                Applied::TimedOut => {
                    pass.marks.forget(ctx);
                    btx.abandon(&ctx.store).await;
                    return Ok(None);
                }
                Applied::Failed(_) => {
                    pass.marks.forget(ctx);
                    drop(btx);
                    return Ok(None);
                }
            }
        }
    }
    let mut completed = None;
    if !statements.is_empty() {
        // The statements and the completion of every row of the pass in one call.
        let mut to_complete = pass.done.clone();
        to_complete.extend(batched.iter().map(|(_, ev)| ev.event_work_id));
        let started = Instant::now();
        let deadline = ctx.apply_timeout + Duration::from_millis(250);
        // Every batched row is handed to the call: if shutdown abandons the pass while the call
        // runs, none of them is refunded (the one whose statement was running keeps its
        // attempt, so a statement slower than the grace is charged across restarts).
        for (_, ev) in &batched {
            lease.mark_started(ev.event_work_id);
        }
        let result = tokio::time::timeout(
            deadline,
            lease.apply_and_complete_in(&mut btx.tx, &mut pass.staged, &statements, &to_complete),
        )
        .await;
        match result {
            Ok(Ok(all_ours)) => {
                completed = Some(all_ours);
                // One call for all: each event is credited its share of the time.
                let share = started.elapsed().as_secs_f64() / statements.len() as f64;
                // One histogram handle per run of a perspective, not a lookup per event.
                let mut histogram: Option<(&str, metrics::Histogram)> = None;
                for (_, ev) in &batched {
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
                pass.applied_batch(ctx, &batched);
            }
            // Some statement failed (or the batch outlived one apply's deadline): the careful
            // pass applies one event per savepoint and finds which.
            Ok(Err(_)) => {
                pass.marks.forget(ctx);
                drop(btx);
                unmark(lease, &batched);
                return Ok(None);
            }
            Err(_) => {
                pass.marks.forget(ctx);
                btx.abandon(&ctx.store).await;
                unmark(lease, &batched);
                return Ok(None);
            }
        }
    }
    finish(ctx, lease, btx, pass, lanes, completed)
        .await
        .map(Some)
}

/// The set-wise call failed as a whole: its rows are handed over again by the careful pass.
fn unmark<S: WorkStore>(lease: &mut LeasedBatch<S>, batched: &[(&Lane, &EventEnvelope)]) {
    for (_, ev) in batched {
        lease.unmark_started(ev.event_work_id);
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

/// Completes the pass's rows in the transaction (unless `completed` says the apply call did,
/// and whether they were all still ours) and commits, then reports its changes. A lost lease
/// rolls everything back; what the pass decided is then redone on its own statements.
async fn finish<S: WorkStore>(
    ctx: &ApplyContext<S>,
    lease: &mut LeasedBatch<S>,
    mut btx: BatchTx<S>,
    pass: Pass,
    lanes: &[Lane],
    completed: Option<bool>,
) -> Result<BatchOutcome, Abort> {
    let Pass {
        marks,
        tally,
        done,
        mut staged,
        outcome,
    } = pass;
    let completion = match completed {
        Some(all) => Ok(all),
        None => lease.complete_in(&mut btx.tx, &mut staged, &done).await,
    };
    let all_ours = match completion {
        Ok(all) => all,
        Err(e) => {
            marks.forget(ctx);
            return Err(conflict_or_batch(e));
        }
    };
    if !all_ours {
        // Some row was taken over by another instance: our writes must not commit, or its new
        // owner would apply them a second time.
        drop(btx);
        marks.forget(ctx);
        let rows: Vec<Uuid> = lanes.iter().flat_map(Lane::ids).collect();
        tracing::warn!(
            rows = rows.len(),
            "lost the lease of rows in flight; rolled the batch back, recording its failures and giving back the rest"
        );
        let before = lease.held();
        lease.redo_after_rollback(staged, &rows).await?;
        return Ok(BatchOutcome {
            released: before - lease.held(),
            lease_lost: true,
            ..BatchOutcome::default()
        });
    }
    if let Err(e) = btx.tx.commit().await {
        marks.forget(ctx);
        return Err(conflict_or_batch(e));
    }
    lease.committed(staged);
    tally.publish();
    Ok(outcome)
}

/// A failure at completion or commit: a lock conflict is retried like a handler's.
fn conflict_or_batch(e: StoreError) -> Abort {
    if let StoreError::Database(db) = &e {
        if crate::perspective::is_conflict(db) {
            return Abort::Conflict {
                event: None,
                reason: db.to_string(),
            };
        }
    }
    if let StoreError::Conflict(reason) = &e {
        return Abort::Conflict {
            event: None,
            reason: reason.clone(),
        };
    }
    Abort::Batch(ApplyBatchError::Store(e))
}

/// One savepoint per event: charge only failing rows, dead-letter permanent failures.
pub(super) async fn apply_careful<S: WorkStore>(
    ctx: &ApplyContext<S>,
    lease: &mut LeasedBatch<S>,
    lanes: &[Lane],
) -> Result<BatchOutcome, Abort> {
    let mut btx = BatchTx::begin(ctx).await?;
    let mut pass = Pass::new(btx.tx.has_database());
    for (li, lane) in lanes.iter().enumerate() {
        for (i, ev) in lane.events.iter().enumerate() {
            if is_cooled(ctx, ev.event_work_id) {
                pass.cooled(ev);
                continue;
            }
            if let Err(e) = btx.tx.savepoint().await {
                pass.marks.forget(ctx);
                return Err(e.into());
            }
            lease.mark_started(ev.event_work_id);
            let mut result = timed_apply(ctx, lane.perspective.as_ref(), ev, &mut btx.tx).await;
            if matches!(&result, Applied::Failed(e) if is_stale_plan(e)) {
                // The connection's cached statement is stale (DDL changed its result type):
                // the connection's failure, not the event's. Forget the connection's cached
                // statements and run the event once more, uncharged.
                let healed = async {
                    btx.tx.rollback_to_savepoint().await?;
                    if let Some(conn) = btx.tx.connection() {
                        use sqlx::Connection as _;
                        conn.clear_cached_statements()
                            .await
                            .map_err(StoreError::from)?;
                    }
                    btx.tx.savepoint().await
                }
                .await;
                if let Err(e) = healed {
                    pass.marks.forget(ctx);
                    return Err(e.into());
                }
                tracing::info!(
                    perspective = %ev.perspective_name,
                    "a cached statement plan went stale after a schema change; the connection's statement cache was cleared and the event is applied again"
                );
                result = timed_apply(ctx, lane.perspective.as_ref(), ev, &mut btx.tx).await;
            }
            let failure = match result {
                Applied::Done => match btx.tx.release_savepoint().await {
                    Ok(()) => {
                        pass.applied(ctx, lane.perspective.as_ref(), ev);
                        continue;
                    }
                    Err(e) => {
                        pass.marks.forget(ctx);
                        return Err(e.into());
                    }
                },
                Applied::TimedOut => {
                    // The connection may still be running the handler's statement.
                    pass.marks.forget(ctx);
                    btx.abandon(&ctx.store).await;
                    let Verdict::Poisoned(error) = judge(ctx, Applied::TimedOut).await else {
                        unreachable!("a timeout is always charged on its own")
                    };
                    return Err(Abort::Poisoned {
                        lane: li,
                        event: i,
                        error,
                    });
                }
                failed => failed,
            };
            let rolled_back = btx.tx.rollback_to_savepoint().await.is_ok();
            let verdict = match judge(ctx, failure).await {
                // A statement that left the transaction usable is charged in it.
                Verdict::Poisoned(m) if rolled_back => Verdict::Charge(m),
                v => v,
            };
            match verdict {
                Verdict::Charge(error) => {
                    let failures = u32::try_from(ev.failures).unwrap_or(0).saturating_add(1);
                    let delay = retry_delay(failures, ctx.backoff_base, ctx.backoff_max);
                    let behind: Vec<Uuid> = lane.events[i + 1..]
                        .iter()
                        .map(|e| e.event_work_id)
                        .collect();
                    let staged = async {
                        lease
                            .fail_in(
                                &mut btx.tx,
                                &mut pass.staged,
                                ev.event_work_id,
                                &error,
                                delay,
                            )
                            .await?;
                        lease
                            .release_in(&mut btx.tx, &mut pass.staged, &behind)
                            .await
                    }
                    .await;
                    if let Err(e) = staged {
                        pass.marks.forget(ctx);
                        return Err(conflict_or_batch(e));
                    }
                    pass.outcome.failed += 1;
                    pass.outcome.released += behind.len();
                    break;
                }
                Verdict::Permanent(error) => {
                    let moved = lease
                        .dead_letter_in(
                            &mut btx.tx,
                            &mut pass.staged,
                            ev.event_work_id,
                            FAILURE_PERMANENT,
                            &error,
                        )
                        .await;
                    if let Err(e) = moved {
                        pass.marks.forget(ctx);
                        return Err(conflict_or_batch(e));
                    }
                    pass.outcome.dead_lettered += 1;
                }
                Verdict::Conflict(reason) => {
                    pass.marks.forget(ctx);
                    drop(btx);
                    return Err(Abort::Conflict {
                        event: Some(i),
                        reason,
                    });
                }
                Verdict::Poisoned(error) => {
                    pass.marks.forget(ctx);
                    btx.abandon(&ctx.store).await;
                    return Err(Abort::Poisoned {
                        lane: li,
                        event: i,
                        error,
                    });
                }
                Verdict::Unavailable(reason) => {
                    pass.marks.forget(ctx);
                    drop(btx);
                    return Err(Abort::Batch(ApplyBatchError::Unavailable(reason)));
                }
            }
        }
    }
    finish(ctx, lease, btx, pass, lanes, None).await
}
