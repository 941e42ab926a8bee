//! The lease handle: the one door of the rows a claim leased to us.
//!
//! The claim returns a [`LeasedBatch`]; every state change of its rows (complete, fail,
//! dead-letter, release, note, the give-back of rows another loop's lane holds) is a method of
//! it. Each change is fenced on our instance id in SQL, checks what it changed, and logs and
//! counts itself exactly once, after it is durable: a change made inside the batch's transaction
//! is only *staged* ([`Staged`]) and reported by [`LeasedBatch::committed`] once the transaction
//! has committed; a change made on its own statement is reported at once. Which rows the batch
//! holds is recorded once, in the process's [`InFlight`] record (which the renewal loop reads);
//! dropping the handle frees its lanes. At shutdown the record itself gives back what abandoned
//! batches held ([`InFlight::abandon`]).
//!
//! Refunds follow docs/pipeline.md ("Attempts") exactly: a row no handler saw goes back with a
//! refund of the bump its claim made (SQL knows whether there was one); a row a handler saw
//! goes back without one.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use super::inflight::{count_released, Held, InFlight, LaneKey};
use crate::store::{
    InstanceId, MoveOutcome, StatementBatch, StoreError, WorkRow, WorkStore, WorkTx,
};
use crate::telemetry::metrics as m;

/// A failure recorded inside a transaction, reported after it commits.
#[derive(Clone, Debug)]
struct StagedFailure {
    id: Uuid,
    error: String,
    retry_in: Duration,
}

/// A dead-letter move made inside a transaction, reported after it commits.
#[derive(Clone, Debug)]
struct StagedMove {
    id: Uuid,
    dead_letter_id: Uuid,
    reason: String,
    error: String,
}

/// Changes made inside one transaction: nothing of them is reported (or forgotten by the handle)
/// until [`LeasedBatch::committed`]; after a rollback they are simply dropped, or redone on their
/// own with [`LeasedBatch::redo_after_rollback`].
#[derive(Debug, Default)]
pub struct Staged {
    completed: Vec<Uuid>,
    failed: Vec<StagedFailure>,
    moved: Vec<StagedMove>,
    released: Vec<Uuid>,
}

impl Staged {
    /// Rows this transaction completes.
    pub fn completed(&self) -> usize {
        self.completed.len()
    }
}

/// The rows one claim leased to us, and the only way to change them.
#[derive(Debug)]
pub struct LeasedBatch<S: WorkStore> {
    store: S,
    instance: InstanceId,
    max_attempts: Option<u32>,
    inflight: Arc<InFlight>,
    /// This batch's key in the record.
    batch: u64,
    /// The lanes reserved for this batch (freed on drop).
    lanes: Vec<LaneKey>,
    /// The claimed rows, until the pipeline takes them.
    rows: Vec<WorkRow>,
}

impl<S: WorkStore> LeasedBatch<S> {
    /// Takes ownership of the rows one claim leased to `instance`: records them in `inflight`,
    /// reserving their lanes, and gives back at once (unstarted, with a refund) the rows of
    /// lanes another loop of ours holds: that loop will not fetch them again, and a kept lease
    /// would stall the lane until it expires. Rows that loop has in flight (their lease lapsed
    /// under it) are its own and left to it.
    pub(crate) async fn take(
        store: S,
        instance: InstanceId,
        max_attempts: Option<u32>,
        inflight: &Arc<InFlight>,
        rows: Vec<WorkRow>,
    ) -> Result<Self, StoreError> {
        let recorded = inflight.record(&rows);
        let mut lease = LeasedBatch {
            store,
            instance,
            max_attempts,
            inflight: Arc::clone(inflight),
            batch: recorded.batch,
            lanes: recorded.lanes,
            rows: Vec::new(),
        };
        if recorded.give_back.is_empty() && recorded.theirs.is_empty() {
            lease.rows = rows;
            return Ok(lease);
        }
        lease.release(&recorded.give_back).await?;
        lease.rows = rows
            .into_iter()
            .filter(|r| lease.holds(r.event_work_id))
            .collect();
        Ok(lease)
    }

    /// The claimed rows, for the stages after the claim (once: later calls return nothing).
    pub fn take_rows(&mut self) -> Vec<WorkRow> {
        std::mem::take(&mut self.rows)
    }

    /// The claimed rows not yet taken.
    pub fn rows(&self) -> &[WorkRow] {
        &self.rows
    }

    /// Our lease holder id.
    pub fn instance(&self) -> InstanceId {
        self.instance
    }

    /// The lanes this batch reserves in the process.
    pub fn lanes(&self) -> &[LaneKey] {
        &self.lanes
    }

    /// The process's record this batch is in.
    pub(crate) fn inflight(&self) -> &InFlight {
        &self.inflight
    }

    /// Rows still ours.
    pub fn held(&self) -> usize {
        self.inflight.held_by(self.batch)
    }

    /// Whether this row is still ours (not completed, failed, dead-lettered or given back).
    pub fn holds(&self, id: Uuid) -> bool {
        self.inflight.holds(self.batch, id)
    }

    /// Records that a handler is about to see these rows: from now on they are not refunded.
    pub fn mark_started(&mut self, ids: impl IntoIterator<Item = Uuid>) {
        self.inflight.set_started(self.batch, ids, true);
    }

    /// Undoes [`mark_started`](Self::mark_started) for rows whose handler call failed as a
    /// whole and that are handed over again (the careful pass marks each when it does): until
    /// then, they are given back with a refund.
    pub fn unmark_started(&mut self, ids: impl IntoIterator<Item = Uuid>) {
        self.inflight.set_started(self.batch, ids, false);
    }

    /// The pass died with its session at a step of its own, not at a handler's statement: the
    /// rows a handler saw go back refunded, within each row's budget (as many times as a row may
    /// be claimed: `worker.max_perspective_event_attempts`, 10 when off). See
    /// [`InFlight::forgive_started`].
    pub fn forgive_started(&mut self) -> usize {
        let budget = self.max_attempts.unwrap_or(10);
        self.inflight.forgive_started(self.batch, budget)
    }

    fn forget(&mut self, id: &Uuid) -> Option<Held> {
        self.inflight
            .forget(self.batch, std::slice::from_ref(id))
            .pop()
            .flatten()
    }

    // ---- changes on their own statement: durable at once, reported at once -------------------

    /// Moves a row to the dead letters now (the pre-filter, an unreadable event, a failure that
    /// took its transaction down). The one dead-letter path: one WARN line, one metric.
    pub async fn dead_letter_now(
        &mut self,
        id: Uuid,
        reason: &str,
        error: &str,
    ) -> Result<MoveOutcome, StoreError> {
        // Error texts are stored and logged capped (crate::text::MAX_TEXT).
        let error: &str = &crate::text::cap(error);
        let outcome = self
            .store
            .move_to_dead_letters(self.instance, id, reason, error)
            .await?;
        match outcome {
            MoveOutcome::Moved(dead_letter_id) => {
                if let Some(h) = self.forget(&id) {
                    log_dead_letter(&h, self.max_attempts, reason, dead_letter_id, error);
                }
            }
            MoveOutcome::AlreadyGone => {
                self.forget(&id);
            }
        }
        self.inflight.gone([&id]);
        Ok(outcome)
    }

    /// Moves many rows to the dead letters now, in one statement, all or nothing (the
    /// pre-filter's exhausted rows). Each move is logged and counted once, as by
    /// [`LeasedBatch::dead_letter_now`]. One outcome per move, in order.
    pub async fn dead_letter_many_now(
        &mut self,
        moves: &[(Uuid, String)],
        reason: &str,
    ) -> Result<Vec<MoveOutcome>, StoreError> {
        let moved: std::collections::HashMap<Uuid, Uuid> = self
            .store
            .move_many_to_dead_letters(self.instance, moves, reason)
            .await?
            .into_iter()
            .collect();
        let mut outcomes = Vec::with_capacity(moves.len());
        for (id, error) in moves {
            let held = self.forget(id);
            match moved.get(id) {
                Some(&dead_letter_id) => {
                    if let Some(h) = held {
                        log_dead_letter(&h, self.max_attempts, reason, dead_letter_id, error);
                    }
                    outcomes.push(MoveOutcome::Moved(dead_letter_id));
                }
                None => outcomes.push(MoveOutcome::AlreadyGone),
            }
        }
        self.inflight.gone(moves.iter().map(|(id, _)| id));
        Ok(outcomes)
    }

    /// Records a failure now (charged; parked for `retry_in`). False if the row was not ours.
    pub async fn fail_now(
        &mut self,
        id: Uuid,
        error: &str,
        retry_in: Duration,
    ) -> Result<bool, StoreError> {
        // Error texts are stored and logged capped (crate::text::MAX_TEXT).
        let error: &str = &crate::text::cap(error);
        let recorded = self
            .store
            .record_failure(self.instance, id, error, retry_in)
            .await?;
        if let Some(h) = self.forget(&id) {
            if recorded {
                log_failure(&h, error, retry_in);
                count_failures(std::iter::once(&h));
            }
        }
        Ok(recorded)
    }

    /// Keeps the error of a row given back uncharged (best effort: it is diagnosis only).
    pub async fn note_error(&self, id: Uuid, error: &str) {
        if let Err(e) = self.store.note_error(self.instance, id, error).await {
            tracing::debug!(error = %e, "could not keep the last error of a row given back");
        }
    }

    /// Gives rows back now: those no handler saw with a refund of their claim's bump, the
    /// others without. Returns how many were still ours.
    pub async fn release(&mut self, ids: &[Uuid]) -> Result<u64, StoreError> {
        let (started, unstarted) = self.inflight.split_started(self.batch, ids);
        let mut released = 0;
        if !unstarted.is_empty() {
            released += self
                .store
                .release_unstarted(self.instance, &unstarted)
                .await?;
        }
        if !started.is_empty() {
            released += self.store.release_started(self.instance, &started).await?;
        }
        self.inflight.forget(self.batch, &started);
        self.inflight.forget(self.batch, &unstarted);
        count_released(released);
        Ok(released)
    }

    /// Gives back every row still ours (the end of a batch, or a batch that failed as a whole).
    /// If the database does not answer, the rows are owed back when the batch ends, and the
    /// consumer loops give them back before their next claim ([`InFlight::settle_owed`]).
    pub async fn release_all(&mut self) {
        let ids = self.inflight.rows_of(self.batch);
        if ids.is_empty() {
            return;
        }
        if let Err(error) = self.release(&ids).await {
            tracing::debug!(%error, rows = ids.len(), "could not give rows back; they are given back once the database answers");
        }
    }

    // ---- changes inside the batch's transaction: staged, reported after commit ---------------

    /// Completes `ids` inside `tx`. Returns false when some row is no longer ours (a lease was
    /// lost): the transaction must then be rolled back.
    pub async fn complete_in(
        &self,
        tx: &mut S::Tx,
        staged: &mut Staged,
        ids: &[Uuid],
    ) -> Result<bool, StoreError> {
        let n = tx.complete(self.instance, ids).await?;
        staged.completed.extend_from_slice(ids);
        Ok(n as usize == ids.len())
    }

    /// Runs a batch's SQL statements and completes `ids` inside `tx`, in one call. Returns
    /// false when some row is no longer ours (the transaction must then be rolled back); an
    /// error of any statement is an error.
    pub async fn apply_and_complete_in(
        &self,
        tx: &mut S::Tx,
        staged: &mut Staged,
        statements: &StatementBatch<'_>,
        ids: &[Uuid],
    ) -> Result<bool, StoreError> {
        let n = tx
            .apply_statements_and_complete(statements, self.instance, ids)
            .await?;
        staged.completed.extend_from_slice(ids);
        Ok(n as usize == ids.len())
    }

    /// Records a failure inside `tx` (charged; parked for `retry_in`).
    pub async fn fail_in(
        &self,
        tx: &mut S::Tx,
        staged: &mut Staged,
        id: Uuid,
        error: &str,
        retry_in: Duration,
    ) -> Result<(), StoreError> {
        // Error texts are stored and logged capped (crate::text::MAX_TEXT).
        let error: &str = &crate::text::cap(error);
        if tx
            .record_failure(self.instance, id, error, retry_in)
            .await?
        {
            staged.failed.push(StagedFailure {
                id,
                error: error.to_string(),
                retry_in,
            });
        }
        Ok(())
    }

    /// Moves a row to the dead letters inside `tx`.
    pub async fn dead_letter_in(
        &self,
        tx: &mut S::Tx,
        staged: &mut Staged,
        id: Uuid,
        reason: &str,
        error: &str,
    ) -> Result<(), StoreError> {
        // Error texts are stored and logged capped (crate::text::MAX_TEXT).
        let error: &str = &crate::text::cap(error);
        if let MoveOutcome::Moved(dead_letter_id) = tx
            .move_to_dead_letters(self.instance, id, reason, error)
            .await?
        {
            staged.moved.push(StagedMove {
                id,
                dead_letter_id,
                reason: reason.to_string(),
                error: error.to_string(),
            });
        }
        Ok(())
    }

    /// Gives rows back inside `tx` (rows behind a failure in its lane): those no handler saw
    /// with a refund of their claim's bump, the others without.
    pub async fn release_in(
        &self,
        tx: &mut S::Tx,
        staged: &mut Staged,
        ids: &[Uuid],
    ) -> Result<(), StoreError> {
        let (started, unstarted) = self.inflight.split_started(self.batch, ids);
        let mut n = tx.release_unstarted(self.instance, &unstarted).await?;
        n += tx.release_started(self.instance, &started).await?;
        // Rows no longer ours are not ours to report; which ones is not worth a round trip.
        staged
            .released
            .extend(unstarted.into_iter().chain(started).take(n as usize));
        Ok(())
    }

    /// The transaction holding `staged` has committed: forget its rows, log and count its
    /// changes, once.
    pub fn committed(&mut self, staged: Staged) {
        let completed = self.inflight.forget(self.batch, &staged.completed);
        observe_lags(completed.iter().flatten());
        let mut failed = Vec::new();
        for f in &staged.failed {
            if let Some(h) = self.forget(&f.id) {
                log_failure(&h, &f.error, f.retry_in);
                failed.push(h);
            }
        }
        count_failures(failed.iter());
        for mv in &staged.moved {
            if let Some(h) = self.forget(&mv.id) {
                log_dead_letter(
                    &h,
                    self.max_attempts,
                    &mv.reason,
                    mv.dead_letter_id,
                    &mv.error,
                );
            }
        }
        self.inflight.forget(self.batch, &staged.released);
        count_released(staged.released.len() as u64);
        self.inflight.gone(
            staged
                .completed
                .iter()
                .chain(staged.moved.iter().map(|mv| &mv.id)),
        );
    }

    /// The transaction holding `staged` rolled back (a lost lease): redo its failures and
    /// dead-letter moves on their own statements (fenced: only rows still ours change), then
    /// give back everything else of `lanes` still ours. Nothing of ours stays leased and
    /// unrenewed, and nothing is reported that did not happen.
    pub async fn redo_after_rollback(
        &mut self,
        staged: Staged,
        rows: &[Uuid],
    ) -> Result<(), StoreError> {
        for f in staged.failed {
            self.fail_now(f.id, &f.error, f.retry_in).await?;
        }
        for mv in staged.moved {
            self.dead_letter_now(mv.id, &mv.reason, &mv.error).await?;
        }
        self.release(rows).await?;
        Ok(())
    }
}

/// `vantage_append_to_applied_seconds` of rows whose completion just committed: once per row,
/// one histogram handle per perspective.
fn observe_lags<'a>(completed: impl Iterator<Item = &'a Held>) {
    let mut by: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for h in completed {
        if let Some(lag) = h.lag() {
            by.entry(h.perspective.as_str())
                .or_default()
                .push(lag.as_secs_f64());
        }
    }
    for (p, lags) in by {
        let histogram = metrics::histogram!(m::APPEND_TO_APPLIED_SECONDS, m::LABEL_PERSPECTIVE => p.to_string());
        for lag in lags {
            histogram.record(lag);
        }
    }
}

fn log_failure(h: &Held, error: &str, retry_in: Duration) {
    tracing::info!(
        perspective = %h.perspective,
        stream_id = %h.stream_id,
        event_id = %h.event_id,
        global_position = h.global_position,
        attempts = h.attempts,
        failures = h.failures.saturating_add(1),
        retry_in = ?retry_in,
        %error,
        "apply failed; the event is parked and will be retried"
    );
}

fn count_failures<'a>(failed: impl Iterator<Item = &'a Held>) {
    let mut by: BTreeMap<&str, u64> = BTreeMap::new();
    for h in failed {
        *by.entry(h.perspective.as_str()).or_default() += 1;
    }
    for (p, n) in by {
        metrics::counter!(m::APPLY_FAILURES_TOTAL, m::LABEL_PERSPECTIVE => p.to_string())
            .increment(n);
    }
}

/// The one WARN line of a dead-letter move (docs/operations.md, "Logs and metrics":
/// perspective, stream, event, global position, attempts and max), and its metric.
fn log_dead_letter(
    h: &Held,
    max_attempts: Option<u32>,
    reason: &str,
    dead_letter_id: Uuid,
    error: &str,
) {
    tracing::warn!(
        perspective = %h.perspective,
        stream_id = %h.stream_id,
        event_id = %h.event_id,
        global_position = h.global_position,
        attempts = h.attempts,
        max_attempts = %max_attempts.map_or_else(|| "off".to_owned(), |m| m.to_string()),
        reason,
        %dead_letter_id,
        %error,
        "event dead-lettered"
    );
    super::spans::dead_letter(
        &h.perspective,
        h.stream_id,
        h.event_id,
        h.global_position,
        h.attempts,
        reason,
        error,
    );
    metrics::counter!(m::DEAD_LETTER_MOVES_TOTAL,
        m::LABEL_PERSPECTIVE => h.perspective.clone(),
        m::LABEL_REASON => reason.to_string())
    .increment(1);
}

impl<S: WorkStore> Drop for LeasedBatch<S> {
    /// Frees the batch's lanes; whatever it still recorded is owed back
    /// ([`InFlight::settle_owed`]).
    fn drop(&mut self) {
        self.inflight.end(self.batch, &self.lanes);
    }
}
