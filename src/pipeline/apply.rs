//! The apply stage: run handlers in stream order per lane, and complete the work rows in the
//! same transaction as the handlers' writes (exactly-once effects for SQL perspectives).
//!
//! A batch is first applied optimistically in one transaction with no savepoints (one round
//! trip per event plus begin/complete/commit). If any handler fails, that transaction is rolled
//! back and the batch is applied again carefully, one savepoint per event, so that in one pass:
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
//! Every change to a leased row goes through the lease handle ([`LeasedBatch`]), which reports
//! it once it is durable.
//!
//! The cooldown cache is checked before each apply and marked right after a successful one.
//! For perspectives whose effects all go through the transaction, a rolled-back mark is
//! forgotten again (their effects were rolled back too).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::Acquire;
use uuid::Uuid;

use super::backoff::retry_delay;
use super::cooldown::CooldownCache;
use super::envelope::EventEnvelope;
use super::inflight::InFlight;
use super::lease::{LeasedBatch, Staged};
use crate::perspective::{ApplyError, Perspective, PerspectiveRegistry};
use crate::store::{InstanceId, Store, StoreError, FAILURE_PERMANENT};
use crate::telemetry::metrics as m;

/// Everything the apply stage needs.
#[derive(Clone)]
pub struct ApplyContext {
    /// The database.
    pub store: Store,
    /// Our lease holder id.
    pub instance: InstanceId,
    /// Handlers by perspective name.
    pub registry: PerspectiveRegistry,
    /// The cooldown cache (None when disabled).
    pub cooldown: Option<Arc<CooldownCache>>,
    /// `worker.retry_backoff_base`.
    pub backoff_base: Duration,
    /// `worker.retry_backoff_max`.
    pub backoff_max: Duration,
    /// `worker.max_perspective_event_attempts`, for log lines.
    pub max_attempts: Option<u32>,
    /// `worker.apply_timeout`: the deadline of one apply.
    pub apply_timeout: Duration,
    /// Batches still to run one lane per transaction, shared by the consumer loops of the
    /// process: set after a lock conflict, counted down per batch (see [`apply_batch`]).
    pub small_transactions: Arc<AtomicU32>,
    /// The process's work in flight (batch transactions are listed there for shutdown).
    pub inflight: Arc<InFlight>,
}

/// How many batches run one lane per transaction after a lock conflict before whole-batch
/// transactions are tried again.
const SMALL_TRANSACTION_BATCHES: u32 = 20;

/// How many times a lane is run before a lock conflict is charged to the row that hit it.
const CONFLICT_ROUNDS: u64 = 4;

/// How long we ask the database whether it is there before calling it unavailable.
const HEALTH_PROBE: Duration = Duration::from_secs(2);

/// What happened to one batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Events applied and completed.
    pub applied: usize,
    /// Rows completed without re-applying (cooled).
    pub cooled: usize,
    /// Rows whose failure was recorded (parked).
    pub failed: usize,
    /// Rows dead-lettered for a permanent failure.
    pub dead_lettered: usize,
    /// Rows given back (behind a failure, after a lost lease or conflict).
    pub released: usize,
    /// A lease was lost: a transaction was rolled back and its changes redone on their own.
    pub lease_lost: bool,
}

impl BatchOutcome {
    fn merge(&mut self, other: BatchOutcome) {
        self.applied += other.applied;
        self.cooled += other.cooled;
        self.failed += other.failed;
        self.dead_lettered += other.dead_lettered;
        self.released += other.released;
        self.lease_lost |= other.lease_lost;
    }
}

/// Why a batch could not be applied at all. The caller gives the rows back.
#[derive(Debug, thiserror::Error)]
pub enum ApplyBatchError {
    /// The database failed (connection lost, commit failed): nobody is charged.
    #[error(transparent)]
    Store(StoreError),
    /// The database did not answer a health probe after a statement failed: nobody is charged.
    #[error("database unavailable while applying: {0}")]
    Unavailable(String),
}

impl From<StoreError> for ApplyBatchError {
    fn from(e: StoreError) -> Self {
        ApplyBatchError::Store(e)
    }
}

impl From<sqlx::Error> for ApplyBatchError {
    fn from(e: sqlx::Error) -> Self {
        ApplyBatchError::Store(StoreError::Database(e))
    }
}

/// One lane's events, in stream_version order, with its handler.
#[derive(Clone)]
struct Lane {
    perspective: Arc<dyn Perspective>,
    events: Vec<EventEnvelope>,
}

impl Lane {
    fn ids(&self) -> Vec<Uuid> {
        self.events.iter().map(|e| e.event_work_id).collect()
    }
}

fn lanes(ctx: &ApplyContext, events: Vec<EventEnvelope>) -> (Vec<Lane>, Vec<Uuid>) {
    let mut lanes: Vec<Lane> = Vec::new();
    let mut unhandled = Vec::new();
    for ev in events {
        let Some(perspective) = ctx.registry.get(&ev.perspective_name) else {
            // Claims are filtered by our perspective names, so this is a row we should not hold.
            unhandled.push(ev.event_work_id);
            continue;
        };
        match lanes.last_mut() {
            Some(lane)
                if lane.events[0].stream_id == ev.stream_id
                    && lane.events[0].perspective_name == ev.perspective_name =>
            {
                lane.events.push(ev)
            }
            _ => lanes.push(Lane {
                perspective: Arc::clone(perspective),
                events: vec![ev],
            }),
        }
    }
    (lanes, unhandled)
}

/// Per-perspective counters of applies and cooled rows, published once the pass commits.
#[derive(Default)]
struct Tally {
    applied: BTreeMap<String, u64>,
    cooled: BTreeMap<String, u64>,
}

impl Tally {
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
struct Marks(Vec<Uuid>);

impl Marks {
    fn mark(&mut self, ctx: &ApplyContext, perspective: &dyn Perspective, id: Uuid) {
        if let Some(cache) = &ctx.cooldown {
            cache.mark(id);
            if perspective.effects_in_transaction() {
                self.0.push(id);
            }
        }
    }

    fn forget(self, ctx: &ApplyContext) {
        if let Some(cache) = &ctx.cooldown {
            for id in self.0 {
                cache.forget(id);
            }
        }
    }
}

/// The bookkeeping of one pass over some lanes (one transaction).
#[derive(Default)]
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
    /// A cooled row: completed without re-applying.
    fn cooled(&mut self, ev: &EventEnvelope) {
        *self
            .tally
            .cooled
            .entry(ev.perspective_name.clone())
            .or_default() += 1;
        self.outcome.cooled += 1;
        self.done.push(ev.event_work_id);
    }

    /// A successful apply: cooled from now on, completed with the transaction.
    fn applied(&mut self, ctx: &ApplyContext, perspective: &dyn Perspective, ev: &EventEnvelope) {
        self.marks.mark(ctx, perspective, ev.event_work_id);
        *self
            .tally
            .applied
            .entry(ev.perspective_name.clone())
            .or_default() += 1;
        self.outcome.applied += 1;
        self.done.push(ev.event_work_id);
    }
}

/// How a pass ended when it did not commit.
enum Abort {
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

fn is_cooled(ctx: &ApplyContext, id: Uuid) -> bool {
    ctx.cooldown.as_ref().is_some_and(|c| c.is_cooled(id))
}

/// What one handler call produced.
enum Applied {
    Done,
    Failed(ApplyError),
    TimedOut,
}

async fn timed_apply(
    ctx: &ApplyContext,
    perspective: &dyn Perspective,
    ev: &EventEnvelope,
    conn: &mut sqlx::PgConnection,
) -> Applied {
    let started = Instant::now();
    // A little later than the statement_timeout of SQL perspectives, so their statements end
    // cleanly on the server (a savepoint can roll back) before the transaction is given up.
    let deadline = ctx.apply_timeout + Duration::from_millis(250);
    let result = tokio::time::timeout(deadline, perspective.apply(ev, conn)).await;
    metrics::histogram!(m::APPLY_DURATION_SECONDS, m::LABEL_PERSPECTIVE => ev.perspective_name.clone())
        .record(started.elapsed().as_secs_f64());
    match result {
        Ok(Ok(())) => Applied::Done,
        Ok(Err(e)) => Applied::Failed(e),
        Err(_) => Applied::TimedOut,
    }
}

/// Whether the database answers at all (on any connection of the pool, within a moment).
async fn database_answers(store: &Store) -> bool {
    matches!(
        tokio::time::timeout(HEALTH_PROBE, store.ping()).await,
        Ok(Ok(()))
    )
}

/// A batch transaction and its server process, listed for shutdown while it runs.
struct BatchTx {
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    guard: super::inflight::BackendGuard,
}

impl BatchTx {
    async fn begin(ctx: &ApplyContext) -> Result<BatchTx, StoreError> {
        let (tx, pid) = ctx.store.begin_batch(ctx.apply_timeout).await?;
        Ok(BatchTx {
            tx,
            guard: ctx.inflight.register_backend(pid),
        })
    }

    /// Gives the transaction up while its connection may still be running a statement: cancel
    /// that statement on the server (so the rollback does not wait for it and its locks go),
    /// then drop the transaction, which rolls it back.
    async fn abandon(self, store: &Store) {
        let pid = self.guard.pid();
        match tokio::time::timeout(HEALTH_PROBE, store.cancel_backend(pid)).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::debug!(%error, pid, "could not cancel a batch statement"),
            Err(_) => tracing::debug!(pid, "cancelling a batch statement got no answer"),
        }
        drop(self.tx);
    }
}

/// Applies one batch of typed events (all leased to us through `lease`, ordered by stream,
/// perspective, stream_version). Every row of `events` is settled (completed, failed,
/// dead-lettered or given back) when this returns Ok.
pub async fn apply_batch(
    ctx: &ApplyContext,
    lease: &mut LeasedBatch,
    events: Vec<EventEnvelope>,
) -> Result<BatchOutcome, ApplyBatchError> {
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
    if !small {
        match run_lanes(ctx, lease, lanes.clone()).await {
            Err(Abort::Conflict { reason, .. }) => {
                ctx.small_transactions
                    .store(SMALL_TRANSACTION_BATCHES, Ordering::Relaxed);
                tracing::debug!(%reason, "batch lost a lock conflict; applying it one lane per transaction");
            }
            Err(Abort::Batch(e)) => return Err(e),
            Err(Abort::Poisoned { .. }) => unreachable!("run_lanes settles poisoned lanes"),
            Ok(o) => {
                outcome.merge(o);
                return Ok(outcome);
            }
        }
    }
    for mut lane in lanes {
        // A failed whole-batch pass may already have settled some rows (a lane charged on its
        // own statement): only what is still ours is applied.
        lane.events.retain(|e| lease.holds(e.event_work_id));
        if !lane.events.is_empty() {
            outcome.merge(run_lane_alone(ctx, lease, lane).await?);
        }
    }
    Ok(outcome)
}

/// One lane in its own transactions: retried on lock conflicts, then charged.
async fn run_lane_alone(
    ctx: &ApplyContext,
    lease: &mut LeasedBatch,
    lane: Lane,
) -> Result<BatchOutcome, ApplyBatchError> {
    let mut round = 0u64;
    loop {
        round += 1;
        match run_lanes(ctx, lease, vec![lane.clone()]).await {
            Ok(o) => return Ok(o),
            Err(Abort::Batch(e)) => return Err(e),
            Err(Abort::Poisoned { .. }) => unreachable!("run_lanes settles poisoned lanes"),
            Err(Abort::Conflict { event, reason, .. }) if round < CONFLICT_ROUNDS => {
                let at = event.unwrap_or(0);
                lease
                    .note_error(lane.events[at].event_work_id, &reason)
                    .await;
                let jitter = (Uuid::new_v4().as_u128() % 20) as u64;
                let pause = Duration::from_millis(5 * round + jitter);
                tracing::debug!(round, ?pause, %reason, "lane lost a lock conflict; retrying it");
                tokio::time::sleep(pause).await;
            }
            Err(Abort::Conflict { event, reason, .. }) => {
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

/// The optimistic pass, then careful passes until every lane is settled. Lanes whose event took
/// a transaction down are settled on their own and the careful pass runs again without them.
async fn run_lanes(
    ctx: &ApplyContext,
    lease: &mut LeasedBatch,
    mut lanes: Vec<Lane>,
) -> Result<BatchOutcome, Abort> {
    if let Some(fast) = apply_fast(ctx, lease, &lanes).await? {
        return Ok(fast);
    }
    let mut outcome = BatchOutcome::default();
    loop {
        match apply_careful(ctx, lease, &lanes).await {
            Ok(o) => {
                outcome.merge(o);
                return Ok(outcome);
            }
            Err(Abort::Poisoned { lane, event, error }) => {
                let poisoned = lanes.remove(lane);
                outcome.merge(
                    settle_poisoned(ctx, lease, &poisoned, event, &error)
                        .await
                        .map_err(Abort::Batch)?,
                );
                // The events before it are still ours and still to apply: keep them.
                if event > 0 {
                    lanes.insert(
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
            Err(other) => return Err(other),
        }
    }
}

/// Charges the event at `at` of `lane` on its own statement and gives back the rows behind it.
async fn settle_poisoned(
    ctx: &ApplyContext,
    lease: &mut LeasedBatch,
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

async fn judge(ctx: &ApplyContext, failure: Applied) -> Verdict {
    match failure {
        Applied::Done => unreachable!("judge is only called for failures"),
        Applied::TimedOut => Verdict::Poisoned(format!(
            "apply timed out after {} (worker.apply_timeout)",
            humantime::format_duration(ctx.apply_timeout)
        )),
        Applied::Failed(ApplyError::Retryable(m)) => Verdict::Charge(m),
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
async fn apply_fast(
    ctx: &ApplyContext,
    lease: &mut LeasedBatch,
    lanes: &[Lane],
) -> Result<Option<BatchOutcome>, Abort> {
    let mut btx = BatchTx::begin(ctx).await?;
    let mut pass = Pass::default();
    for lane in lanes {
        for (i, ev) in lane.events.iter().enumerate() {
            if is_cooled(ctx, ev.event_work_id) {
                pass.cooled(ev);
                continue;
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
    finish(ctx, lease, btx, pass, lanes).await.map(Some)
}

/// Completes the pass's rows in the transaction and commits, then reports its changes. A lost
/// lease rolls everything back; what the pass decided is then redone on its own statements.
async fn finish(
    ctx: &ApplyContext,
    lease: &mut LeasedBatch,
    mut btx: BatchTx,
    pass: Pass,
    lanes: &[Lane],
) -> Result<BatchOutcome, Abort> {
    let Pass {
        marks,
        tally,
        done,
        mut staged,
        outcome,
    } = pass;
    let all_ours = match lease.complete_in(&mut btx.tx, &mut staged, &done).await {
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
        return Err(conflict_or_batch(StoreError::Database(e)));
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
async fn apply_careful(
    ctx: &ApplyContext,
    lease: &mut LeasedBatch,
    lanes: &[Lane],
) -> Result<BatchOutcome, Abort> {
    let mut btx = BatchTx::begin(ctx).await?;
    let mut pass = Pass::default();
    for (li, lane) in lanes.iter().enumerate() {
        for (i, ev) in lane.events.iter().enumerate() {
            if is_cooled(ctx, ev.event_work_id) {
                pass.cooled(ev);
                continue;
            }
            let mut savepoint = match btx.tx.begin().await {
                Ok(sp) => sp,
                Err(e) => {
                    pass.marks.forget(ctx);
                    return Err(e.into());
                }
            };
            lease.mark_started(ev.event_work_id);
            let result = timed_apply(ctx, lane.perspective.as_ref(), ev, &mut savepoint).await;
            let failure = match result {
                Applied::Done => match savepoint.commit().await {
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
                    drop(savepoint);
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
            let rolled_back = savepoint.rollback().await.is_ok();
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
    finish(ctx, lease, btx, pass, lanes).await
}
