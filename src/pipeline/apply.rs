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
use crate::perspective::{is_conflict, ApplyError, Perspective, PerspectiveRegistry};
use crate::store::{
    complete_in, move_to_dead_letters_in, record_failure_in, release_unstarted_in, InstanceId,
    MoveOutcome, Store, StoreError, FAILURE_PERMANENT,
};
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
    /// Batches still to run one lane per transaction, shared by the consumer loops of the
    /// process: set after a lock conflict, counted down per batch (see [`apply_batch`]).
    pub small_transactions: Arc<AtomicU32>,
}

/// How many batches run one lane per transaction after a lock conflict before whole-batch
/// transactions are tried again.
const SMALL_TRANSACTION_BATCHES: u32 = 20;

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
    /// Rows given back unstarted (behind a failure, or after a lost lease).
    pub released: usize,
    /// A lease was lost: the whole transaction was rolled back and our rows given back.
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

/// Why a batch could not be applied at all. The caller gives the rows back with a refund.
#[derive(Debug, thiserror::Error)]
pub enum ApplyBatchError {
    /// The database failed (connection lost, commit failed): nobody is charged.
    #[error(transparent)]
    Store(StoreError),
    /// A handler reported the database unavailable.
    #[error("database unavailable while applying: {0}")]
    Unavailable(String),
    /// The batch kept losing lock races (deadlocks with other batches touching the same
    /// read-model rows): nobody is charged, the rows go back with a refund.
    #[error("transaction conflicts while applying: {0}")]
    Conflict(String),
}

impl From<StoreError> for ApplyBatchError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Database(db) => ApplyBatchError::from(db),
            StoreError::Conflict(m) => ApplyBatchError::Conflict(m),
            other => ApplyBatchError::Store(other),
        }
    }
}

impl From<sqlx::Error> for ApplyBatchError {
    fn from(e: sqlx::Error) -> Self {
        if is_conflict(&e) {
            ApplyBatchError::Conflict(e.to_string())
        } else {
            ApplyBatchError::Store(StoreError::Database(e))
        }
    }
}

/// One lane's events, in stream_version order, with its handler.
struct Lane {
    perspective: Arc<dyn Perspective>,
    events: Vec<EventEnvelope>,
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

/// Per-perspective counters, published once per batch.
#[derive(Default)]
struct Tally {
    applied: BTreeMap<String, u64>,
    cooled: BTreeMap<String, u64>,
    failures: BTreeMap<String, u64>,
}

impl Tally {
    fn publish(self) {
        for (p, n) in self.applied {
            metrics::counter!(m::EVENTS_APPLIED_TOTAL, m::LABEL_PERSPECTIVE => p).increment(n);
        }
        for (p, n) in self.cooled {
            metrics::counter!(m::COOLDOWN_SKIPS_TOTAL, m::LABEL_PERSPECTIVE => p).increment(n);
        }
        for (p, n) in self.failures {
            metrics::counter!(m::APPLY_FAILURES_TOTAL, m::LABEL_PERSPECTIVE => p).increment(n);
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

/// The bookkeeping of one pass over a batch (one transaction).
#[derive(Default)]
struct Pass {
    marks: Marks,
    tally: Tally,
    /// Rows to complete in this transaction.
    done: Vec<Uuid>,
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

    /// The transaction will not commit: forget its marks, return the error.
    fn abandon<E>(self, ctx: &ApplyContext, error: E) -> ApplyBatchError
    where
        ApplyBatchError: From<E>,
    {
        self.marks.forget(ctx);
        ApplyBatchError::from(error)
    }
}

fn is_cooled(ctx: &ApplyContext, id: Uuid) -> bool {
    ctx.cooldown.as_ref().is_some_and(|c| c.is_cooled(id))
}

async fn timed_apply(
    perspective: &dyn Perspective,
    ev: &EventEnvelope,
    conn: &mut sqlx::PgConnection,
) -> Result<(), ApplyError> {
    let started = Instant::now();
    let result = perspective.apply(ev, conn).await;
    metrics::histogram!(m::APPLY_DURATION_SECONDS, m::LABEL_PERSPECTIVE => ev.perspective_name.clone())
        .record(started.elapsed().as_secs_f64());
    result
}

/// Applies one batch of typed events (all leased to us, ordered by stream, perspective,
/// stream_version).
pub async fn apply_batch(
    ctx: &ApplyContext,
    events: Vec<EventEnvelope>,
) -> Result<BatchOutcome, ApplyBatchError> {
    let (lanes, unhandled) = lanes(ctx, events);
    let mut outcome = BatchOutcome::default();
    if !unhandled.is_empty() {
        outcome.released += ctx
            .store
            .release_unstarted(ctx.instance, &unhandled)
            .await? as usize;
    }
    if lanes.is_empty() {
        return Ok(outcome);
    }
    // One transaction for the whole batch is cheapest, but batches of concurrent consumers
    // that update shared read-model rows (aggregates) in different orders deadlock, and a
    // deadlock costs PostgreSQL's deadlock_timeout to detect. After a conflict the batch (and
    // the next few) run one lane per transaction: short transactions rarely deadlock, and a
    // lane that still conflicts is retried alone. Nobody is charged for a conflict.
    let small = ctx
        .small_transactions
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok();
    if !small {
        match apply_both_passes(ctx, &lanes).await {
            Err(ApplyBatchError::Conflict(reason)) => {
                ctx.small_transactions
                    .store(SMALL_TRANSACTION_BATCHES, Ordering::Relaxed);
                tracing::debug!(%reason, "batch lost a lock conflict; applying it one lane per transaction");
            }
            other => {
                outcome.merge(other?);
                return Ok(outcome);
            }
        }
    }
    for lane in &lanes {
        let mut round = 0u64;
        loop {
            round += 1;
            match apply_both_passes(ctx, std::slice::from_ref(lane)).await {
                Err(ApplyBatchError::Conflict(reason)) if round < CONFLICT_ROUNDS => {
                    let jitter = (Uuid::new_v4().as_u128() % 20) as u64;
                    let pause = Duration::from_millis(5 * round + jitter);
                    tracing::debug!(round, ?pause, %reason, "lane lost a lock conflict; retrying it");
                    tokio::time::sleep(pause).await;
                }
                Err(ApplyBatchError::Conflict(reason)) => {
                    // Give it back uncharged; a later claim tries again.
                    let ids: Vec<Uuid> = lane.events.iter().map(|e| e.event_work_id).collect();
                    outcome.released +=
                        ctx.store.release_unstarted(ctx.instance, &ids).await? as usize;
                    tracing::warn!(rounds = round, %reason, "lane kept losing lock conflicts; gave it back for later");
                    break;
                }
                other => {
                    outcome.merge(other?);
                    break;
                }
            }
        }
    }
    Ok(outcome)
}

/// How many times a lane is run before lock conflicts make us give it back.
const CONFLICT_ROUNDS: u64 = 4;

/// The optimistic pass, and the careful one if a handler failed.
async fn apply_both_passes(
    ctx: &ApplyContext,
    lanes: &[Lane],
) -> Result<BatchOutcome, ApplyBatchError> {
    match apply_fast(ctx, lanes).await? {
        Some(fast) => Ok(fast),
        None => apply_careful(ctx, lanes).await,
    }
}

/// Every event in one transaction, no savepoints. `None` = a handler failed (rolled back).
async fn apply_fast(
    ctx: &ApplyContext,
    lanes: &[Lane],
) -> Result<Option<BatchOutcome>, ApplyBatchError> {
    let mut tx = ctx.store.pool().begin().await?;
    let mut pass = Pass::default();
    for lane in lanes {
        for ev in &lane.events {
            if is_cooled(ctx, ev.event_work_id) {
                pass.cooled(ev);
                continue;
            }
            match timed_apply(lane.perspective.as_ref(), ev, &mut tx).await {
                Ok(()) => pass.applied(ctx, lane.perspective.as_ref(), ev),
                Err(ApplyError::Unavailable(reason)) => {
                    pass.marks.forget(ctx);
                    return Err(ApplyBatchError::Unavailable(reason));
                }
                Err(ApplyError::Conflict(reason)) => {
                    pass.marks.forget(ctx);
                    return Err(ApplyBatchError::Conflict(reason));
                }
                Err(_) => {
                    // Dropping `tx` rolls back; the careful pass sorts the batch out.
                    drop(tx);
                    pass.marks.forget(ctx);
                    return Ok(None);
                }
            }
        }
    }
    finish(ctx, tx, pass).await.map(Some)
}

/// Completes the pass's rows in the transaction and commits; a lost lease rolls everything back.
async fn finish(
    ctx: &ApplyContext,
    mut tx: sqlx::Transaction<'static, sqlx::Postgres>,
    pass: Pass,
) -> Result<BatchOutcome, ApplyBatchError> {
    let completed = match complete_in(&mut tx, ctx.instance, &pass.done).await {
        Ok(n) => n,
        Err(e) => return Err(pass.abandon(ctx, e)),
    };
    if completed as usize != pass.done.len() {
        // Some row was taken over by another instance: our writes must not commit, or its new
        // owner would apply them a second time.
        drop(tx);
        let Pass {
            marks,
            done,
            outcome,
            ..
        } = pass;
        marks.forget(ctx);
        let released = ctx.store.release_unstarted(ctx.instance, &done).await? as usize;
        tracing::warn!(
            expected = done.len(),
            still_ours = completed,
            "lost the lease of rows in flight; rolled the batch back and gave back the rest"
        );
        return Ok(BatchOutcome {
            released: outcome.released + released,
            lease_lost: true,
            ..BatchOutcome::default()
        });
    }
    if let Err(e) = tx.commit().await {
        return Err(pass.abandon(ctx, e));
    }
    pass.tally.publish();
    Ok(pass.outcome)
}

/// One savepoint per event: charge only failing rows, dead-letter permanent failures.
async fn apply_careful(
    ctx: &ApplyContext,
    lanes: &[Lane],
) -> Result<BatchOutcome, ApplyBatchError> {
    let mut tx = ctx.store.pool().begin().await?;
    let mut pass = Pass::default();
    for lane in lanes {
        for (i, ev) in lane.events.iter().enumerate() {
            if is_cooled(ctx, ev.event_work_id) {
                pass.cooled(ev);
                continue;
            }
            let mut savepoint = match tx.begin().await {
                Ok(sp) => sp,
                Err(e) => return Err(pass.abandon(ctx, e)),
            };
            let result = timed_apply(lane.perspective.as_ref(), ev, &mut savepoint).await;
            let settled = match &result {
                Ok(()) => savepoint.commit().await,
                Err(_) => savepoint.rollback().await,
            };
            if let Err(e) = settled {
                return Err(pass.abandon(ctx, e));
            }
            match result {
                Ok(()) => pass.applied(ctx, lane.perspective.as_ref(), ev),
                Err(ApplyError::Unavailable(reason)) => {
                    return Err(pass.abandon(ctx, ApplyBatchError::Unavailable(reason)));
                }
                Err(ApplyError::Conflict(reason)) => {
                    return Err(pass.abandon(ctx, ApplyBatchError::Conflict(reason)));
                }
                Err(ApplyError::Permanent(error)) => {
                    let moved = move_to_dead_letters_in(
                        &mut *tx,
                        ev.event_work_id,
                        FAILURE_PERMANENT,
                        &error,
                        Some(ctx.instance),
                    )
                    .await;
                    match moved {
                        Ok(MoveOutcome::Moved(dead_letter_id)) => {
                            log_permanent(ctx, ev, &error, dead_letter_id);
                            pass.outcome.dead_lettered += 1;
                        }
                        Ok(MoveOutcome::AlreadyGone) => {}
                        Err(e) => return Err(pass.abandon(ctx, e)),
                    }
                }
                Err(ApplyError::Retryable(error)) => {
                    let failures = u32::try_from(ev.failures).unwrap_or(0).saturating_add(1);
                    let delay = retry_delay(failures, ctx.backoff_base, ctx.backoff_max);
                    let recorded =
                        record_failure_in(&mut *tx, ctx.instance, ev.event_work_id, &error, delay)
                            .await;
                    if let Err(e) = recorded {
                        return Err(pass.abandon(ctx, e));
                    }
                    tracing::info!(
                        perspective = %ev.perspective_name,
                        stream_id = %ev.stream_id,
                        event_id = %ev.event_id,
                        global_position = ev.global_position,
                        attempts = ev.attempts,
                        failures,
                        retry_in = ?delay,
                        %error,
                        "apply failed; the event is parked and will be retried"
                    );
                    *pass
                        .tally
                        .failures
                        .entry(ev.perspective_name.clone())
                        .or_default() += 1;
                    pass.outcome.failed += 1;
                    // The rows behind it wait, uncharged.
                    let behind: Vec<Uuid> = lane.events[i + 1..]
                        .iter()
                        .map(|e| e.event_work_id)
                        .collect();
                    match release_unstarted_in(&mut *tx, ctx.instance, &behind).await {
                        Ok(n) => pass.outcome.released += n as usize,
                        Err(e) => return Err(pass.abandon(ctx, e)),
                    }
                    break;
                }
            }
        }
    }
    let result = finish(ctx, tx, pass).await?;
    if !result.lease_lost && result.released > 0 {
        metrics::counter!(m::LEASES_RELEASED_TOTAL).increment(result.released as u64);
    }
    Ok(result)
}

fn log_permanent(ctx: &ApplyContext, ev: &EventEnvelope, error: &str, dead_letter_id: Uuid) {
    tracing::warn!(
        perspective = %ev.perspective_name,
        stream_id = %ev.stream_id,
        event_id = %ev.event_id,
        global_position = ev.global_position,
        attempts = ev.attempts,
        max_attempts = ?ctx.max_attempts,
        reason = FAILURE_PERMANENT,
        %dead_letter_id,
        %error,
        "event dead-lettered: its handler reported a permanent failure"
    );
    metrics::counter!(m::DEAD_LETTER_MOVES_TOTAL,
        m::LABEL_PERSPECTIVE => ev.perspective_name.clone(),
        m::LABEL_REASON => FAILURE_PERMANENT)
    .increment(1);
}
