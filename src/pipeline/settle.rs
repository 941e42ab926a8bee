//! The settle stage: what a pass of the apply stage decided becomes durable through the lease
//! handle, in the pass's transaction, and is reported once it committed.
//!
//! `PassTx` owns the batch transaction of one pass, so giving a pass up is dropping it
//! (rolled back, the cooldown marks of its rolled-back effects forgotten), never a sequence to
//! copy. `Decisions` is what the pass decided per event: applied, skipped (cooled), failed
//! with a backoff (the rows behind it in its lane given back), dead-lettered. `commit` hands
//! them to the [`LeasedBatch`], which changes the rows fenced on our lease and stages what it
//! changed; a lost lease rolls the pass back and redoes its failures on their own statements;
//! after the commit each change is logged and counted once. `give_back_rest` ends a batch:
//! whatever is still ours goes back.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use super::cooldown::CooldownCache;
use super::inflight::{BackendGuard, InFlight};
use super::lease::{LeasedBatch, Staged};
use super::spans::ApplySpan;
use crate::perspective::{EventEnvelope, Perspective};
use crate::store::{StoreError, WorkStore, WorkTx};
use crate::telemetry::metrics as m;

/// How long we ask the database whether it is there before calling it unavailable, or to
/// cancel a statement.
pub(crate) const HEALTH_PROBE: Duration = Duration::from_secs(2);

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
    pub(crate) fn merge(&mut self, other: BatchOutcome) {
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

/// How a pass ended when it did not commit. Its transaction is gone (rolled back).
pub(crate) enum Abort {
    /// The database (or our use of it) failed as a whole.
    Batch(ApplyBatchError),
    /// A lock conflict at `event` of the pass's lane (None = at settling or commit; only read
    /// when the pass ran one lane).
    Conflict {
        event: Option<usize>,
        reason: String,
    },
}

impl From<StoreError> for Abort {
    fn from(e: StoreError) -> Self {
        Abort::Batch(ApplyBatchError::Store(e))
    }
}

/// The batch transaction of one pass, its server process listed for shutdown while it runs,
/// and the cooldown marks made under it. Dropped without [`PassTx::commit`]: rolled back, and
/// the marks of effects that rolled back with it are forgotten.
pub(crate) struct PassTx<S: WorkStore> {
    pub(crate) tx: S::Tx,
    guard: Option<BackendGuard>,
    marks: Marks,
}

impl<S: WorkStore> PassTx<S> {
    /// Begins a pass: its statements may each run `statement_timeout`; its server process is
    /// listed in `inflight` while it runs; successful applies are marked in `cooldown`.
    pub(crate) async fn begin(
        store: &S,
        statement_timeout: Duration,
        inflight: &Arc<InFlight>,
        cooldown: Option<&Arc<CooldownCache>>,
    ) -> Result<PassTx<S>, StoreError> {
        let tx = store.begin_batch(statement_timeout).await?;
        Ok(Self::of(tx, inflight, cooldown))
    }

    /// [`PassTx::begin`] for a pass that calls no handler itself: its transaction begins with
    /// its first statement, and is that statement alone when it is the statements' call
    /// ([`WorkStore::begin_batch_deferred`]).
    pub(crate) async fn begin_deferred(
        store: &S,
        statement_timeout: Duration,
        inflight: &Arc<InFlight>,
        cooldown: Option<&Arc<CooldownCache>>,
    ) -> Result<PassTx<S>, StoreError> {
        let tx = store.begin_batch_deferred(statement_timeout).await?;
        Ok(Self::of(tx, inflight, cooldown))
    }

    fn of(tx: S::Tx, inflight: &Arc<InFlight>, cooldown: Option<&Arc<CooldownCache>>) -> Self {
        let guard = tx.backend().map(|pid| inflight.register_backend(pid));
        let transactional = tx.has_database();
        PassTx {
            tx,
            guard,
            marks: Marks {
                cache: cooldown.cloned(),
                ids: Vec::new(),
                transactional,
            },
        }
    }

    /// Marks a successful apply in the cooldown cache. An effect outside the transaction stays
    /// done whatever becomes of the pass: it joins `skip`, so a later pass of this batch
    /// completes the row instead of applying it again.
    pub(crate) fn mark(
        &mut self,
        perspective: &dyn Perspective,
        id: Uuid,
        skip: &mut HashSet<Uuid>,
    ) {
        if self.marks.mark(perspective, id) {
            skip.insert(id);
        }
    }

    /// [`PassTx::mark`] for the events of one statement call (one cache lock for all).
    pub(crate) fn mark_all<'e>(
        &mut self,
        events: impl Iterator<Item = (&'e dyn Perspective, &'e EventEnvelope)> + Clone,
        skip: &mut HashSet<Uuid>,
    ) {
        let Some(cache) = &self.marks.cache else {
            return;
        };
        let ids: Vec<Uuid> = events.clone().map(|(_, ev)| ev.event_work_id).collect();
        cache.mark_all(&ids);
        for (perspective, ev) in events {
            if self.marks.transactional && perspective.effects_in_transaction() {
                self.marks.ids.push(ev.event_work_id);
            } else {
                skip.insert(ev.event_work_id);
            }
        }
    }

    /// Gives the pass up while its connection may still be running a statement: cancel that
    /// statement on the server (so the rollback does not wait for it and its locks go), then
    /// drop the transaction, which rolls it back.
    pub(crate) async fn abandon(mut self, store: &S) {
        self.cancel(store).await;
    }

    /// Cancels the statement the pass's connection runs, if any can be.
    pub(crate) async fn cancel(&mut self, store: &S) {
        if let Some(pid) = self.guard.as_ref().map(|g| g.pid()) {
            match tokio::time::timeout(HEALTH_PROBE, store.cancel_backend(pid)).await {
                Ok(Ok(_)) => {}
                Ok(Err(error)) => {
                    tracing::debug!(%error, pid, "could not cancel a batch statement")
                }
                Err(_) => tracing::debug!(pid, "cancelling a batch statement got no answer"),
            }
        }
    }

    /// Commits; the marks stay (unless the commit fails).
    async fn commit(self) -> Result<(), StoreError> {
        let PassTx {
            tx,
            guard,
            mut marks,
        } = self;
        let result = tx.commit().await;
        if result.is_ok() {
            marks.ids.clear();
        }
        drop(guard);
        result
    }
}

/// Cooldown marks made during one transaction, forgotten again on drop (the transaction did
/// not commit) when the effects they stand for rolled back with it.
struct Marks {
    cache: Option<Arc<CooldownCache>>,
    ids: Vec<Uuid>,
    /// The transaction is a database's (effects through it roll back with it). Without one
    /// (the memory store), every effect is outside any transaction, so a mark is always kept:
    /// an event applied in a pass that then rolls back is completed, not applied again.
    transactional: bool,
}

impl Marks {
    /// Marks `id`; true when the mark stays even if the pass rolls back.
    fn mark(&mut self, perspective: &dyn Perspective, id: Uuid) -> bool {
        let Some(cache) = &self.cache else {
            return false;
        };
        cache.mark(id);
        if self.transactional && perspective.effects_in_transaction() {
            self.ids.push(id);
            false
        } else {
            true
        }
    }
}

impl Drop for Marks {
    fn drop(&mut self) {
        if let Some(cache) = &self.cache {
            for id in self.ids.drain(..) {
                cache.forget(id);
            }
        }
    }
}

/// Per-perspective counters of applies and cooled rows, published once the pass commits.
#[derive(Default)]
pub(crate) struct Tally {
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

    /// Counts the pass in the metrics and in `inflight`'s applied counts (the chart history).
    fn publish(self, inflight: &InFlight) {
        inflight.add_applied(self.applied.iter().map(|(p, n)| (p.as_str(), *n)));
        for (p, n) in self.applied {
            metrics::counter!(m::EVENTS_APPLIED_TOTAL, m::LABEL_PERSPECTIVE => p).increment(n);
        }
        for (p, n) in self.cooled {
            metrics::counter!(m::COOLDOWN_SKIPS_TOTAL, m::LABEL_PERSPECTIVE => p).increment(n);
        }
    }
}

/// A failure decided by a pass, settled in its transaction before the completion.
enum Change {
    /// Charged, parked for `retry_in`; `behind` (the rest of its lane) given back.
    Fail {
        id: Uuid,
        error: String,
        retry_in: Duration,
        behind: Vec<Uuid>,
    },
    /// Dead-lettered (a permanent failure).
    DeadLetter { id: Uuid, error: String },
}

/// What one pass decided for each event it reached: applied, skipped (cooled: completed without
/// applying), failed with a backoff (and the rows behind it in its lane given back), or
/// dead-lettered. The settle stage hands the decisions to the lease handle, in the pass's
/// transaction.
#[derive(Default)]
pub(crate) struct Decisions {
    /// Rows to complete: applied or skipped.
    pub(crate) done: Vec<Uuid>,
    /// Failures and dead-letter moves, in the order they were decided.
    changes: Vec<Change>,
    /// Set when the pass's statement call completed every row of `done` already (SQL
    /// perspectives: the completion rides on the statements' round trip): whether they were
    /// all still ours.
    pub(crate) completed_with_statements: Option<bool>,
    tally: Tally,
    pub(crate) outcome: BatchOutcome,
    /// Changes staged on leased rows, reported after commit.
    pub(crate) staged: Staged,
    /// The apply spans of the traced events the pass reached (empty when traces are off).
    spans: HashMap<Uuid, ApplySpan>,
}

impl Decisions {
    /// The pass reached `ev`: its apply span starts, if it is traced.
    pub(crate) fn reach(&mut self, ev: &EventEnvelope) {
        if let Some(span) = ApplySpan::start(ev) {
            self.spans.insert(ev.event_work_id, span);
        }
    }

    /// The apply span of `ev`, if it is traced (no lookup at all when nothing is).
    fn span(&mut self, ev: &EventEnvelope) -> Option<&mut ApplySpan> {
        if self.spans.is_empty() {
            return None;
        }
        self.spans.get_mut(&ev.event_work_id)
    }

    /// A cooled row: completed without re-applying.
    pub(crate) fn skip(&mut self, ev: &EventEnvelope) {
        Tally::count(&mut self.tally.cooled, &ev.perspective_name);
        self.outcome.cooled += 1;
        self.done.push(ev.event_work_id);
    }

    /// A successful apply: completed with the transaction.
    pub(crate) fn applied(&mut self, ev: &EventEnvelope) {
        Tally::count(&mut self.tally.applied, &ev.perspective_name);
        self.outcome.applied += 1;
        self.done.push(ev.event_work_id);
        if let Some(span) = self.span(ev) {
            span.applied();
        }
    }

    /// A retryable failure: charged, parked for `retry_in`; the rows behind it go back.
    pub(crate) fn failed(
        &mut self,
        ev: &EventEnvelope,
        error: String,
        retry_in: Duration,
        behind: &[EventEnvelope],
    ) {
        if let Some(span) = self.span(ev) {
            span.failed(&error);
        }
        self.changes.push(Change::Fail {
            id: ev.event_work_id,
            error,
            retry_in,
            behind: behind.iter().map(|e| e.event_work_id).collect(),
        });
        self.outcome.failed += 1;
        self.outcome.released += behind.len();
    }

    /// A permanent failure: dead-lettered; the lane goes on.
    pub(crate) fn dead_letter(&mut self, ev: &EventEnvelope, error: String) {
        if let Some(span) = self.span(ev) {
            span.dead_lettered(&error);
        }
        self.changes.push(Change::DeadLetter {
            id: ev.event_work_id,
            error,
        });
        self.outcome.dead_lettered += 1;
    }
}

/// Settles a pass: records its failures (giving back the rows behind each) and dead-letter
/// moves, in the order decided, then completes its done rows (unless its statement call did),
/// all through the lease handle in the pass's transaction, then commits and reports each change once. A lost
/// lease (some row no longer ours) rolls everything back; what the pass decided for its
/// failures is then redone on its own statements and the rest of `rows` is given back.
pub(crate) async fn commit<S: WorkStore>(
    lease: &mut LeasedBatch<S>,
    mut ptx: PassTx<S>,
    decisions: Decisions,
    rows: impl FnOnce() -> Vec<Uuid>,
) -> Result<BatchOutcome, Abort> {
    let Decisions {
        done,
        changes,
        completed_with_statements,
        tally,
        outcome,
        mut staged,
        mut spans,
    } = decisions;
    let settled = async {
        for change in &changes {
            match change {
                Change::Fail {
                    id,
                    error,
                    retry_in,
                    behind,
                } => {
                    lease
                        .fail_in(&mut ptx.tx, &mut staged, *id, error, *retry_in)
                        .await?;
                    lease.release_in(&mut ptx.tx, &mut staged, behind).await?;
                }
                Change::DeadLetter { id, error } => {
                    lease
                        .dead_letter_in(
                            &mut ptx.tx,
                            &mut staged,
                            *id,
                            crate::store::FAILURE_PERMANENT,
                            error,
                        )
                        .await?;
                }
            }
        }
        match completed_with_statements {
            Some(all) => Ok::<bool, StoreError>(all),
            None => lease.complete_in(&mut ptx.tx, &mut staged, &done).await,
        }
    }
    .await;
    let all_ours = settled.map_err(conflict_or_batch)?;
    if !all_ours {
        // Some row was taken over by another instance: our writes must not commit, or its new
        // owner would apply them a second time.
        drop(ptx);
        let rows = rows();
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
    ptx.commit().await.map_err(conflict_or_batch)?;
    spans.values_mut().for_each(ApplySpan::durable);
    drop(spans);
    lease.committed(staged);
    tally.publish(lease.inflight());
    Ok(outcome)
}

/// A failure at settling or commit: a lock conflict is retried like a handler's.
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

/// The end of a batch: every row still ours (nothing, unless the batch failed as a whole) goes
/// back, those no handler saw with a refund.
pub(crate) async fn give_back_rest<S: WorkStore>(lease: &mut LeasedBatch<S>) {
    lease.release_all().await;
}
