//! The lease handle: the one owner of the rows a claim leased to us.
//!
//! Every state change of a claimed row (complete, fail, dead-letter, release) goes through a
//! [`LeasedBatch`]. Each change is fenced on our instance id in SQL, checks what it changed, and
//! logs and counts itself exactly once, after it is durable: a change made inside the batch's
//! transaction is only *staged* ([`Staged`]) and reported by [`LeasedBatch::committed`] once the
//! transaction has committed; a change made on its own statement is reported at once. Renewal
//! is the background loop's job, through the [`Reservation`] the handle keeps alive.
//!
//! Refunds follow SPEC §1.1 exactly: a row no handler saw goes back with a refund of the bump its
//! claim made (SQL knows whether there was one); a row a handler saw goes back without one.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use uuid::Uuid;

use super::inflight::Reservation;
use crate::store::{
    InstanceId, MoveOutcome, StatementBatch, StoreError, WorkRow, WorkStore, WorkTx,
};
use crate::telemetry::metrics as m;

/// What the handle remembers of a leased row, for its log lines.
#[derive(Clone, Debug)]
struct Held {
    perspective: String,
    stream_id: Uuid,
    event_id: Uuid,
    global_position: i64,
    attempts: i32,
    failures: i32,
    /// Handed to a handler at least once under this lease (no refund when given back).
    started: bool,
}

impl Held {
    fn of(row: &WorkRow) -> Self {
        Held {
            perspective: row.perspective_name.clone(),
            stream_id: row.stream_id,
            event_id: row.event_id,
            global_position: row.global_position,
            attempts: row.attempts,
            failures: row.failures,
            started: false,
        }
    }
}

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
    held: HashMap<Uuid, Held>,
    reservation: Reservation,
}

impl<S: WorkStore> LeasedBatch<S> {
    /// Takes ownership of `rows` (leased to `instance`), tracked for renewal by `reservation`.
    pub fn new(
        store: S,
        instance: InstanceId,
        max_attempts: Option<u32>,
        rows: &[WorkRow],
        mut reservation: Reservation,
    ) -> Self {
        let ids: Vec<Uuid> = rows.iter().map(|r| r.event_work_id).collect();
        reservation.track_rows(&ids);
        LeasedBatch {
            store,
            instance,
            max_attempts,
            held: rows
                .iter()
                .map(|r| (r.event_work_id, Held::of(r)))
                .collect(),
            reservation,
        }
    }

    /// Our lease holder id.
    pub fn instance(&self) -> InstanceId {
        self.instance
    }

    /// Rows still ours.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Whether this row is still ours (not completed, failed, dead-lettered or given back).
    pub fn holds(&self, id: Uuid) -> bool {
        self.held.contains_key(&id)
    }

    /// Records that a handler is about to see these rows: from now on they are not refunded.
    pub fn mark_started(&mut self, id: Uuid) {
        if let Some(h) = self.held.get_mut(&id) {
            if !h.started {
                h.started = true;
                self.reservation.mark_started(id);
            }
        }
    }

    /// Undoes [`mark_started`](Self::mark_started) for a row whose handler call failed as a
    /// whole and that is handed over again (the careful pass marks it when it does): until
    /// then, it is given back with a refund.
    pub fn unmark_started(&mut self, id: Uuid) {
        if let Some(h) = self.held.get_mut(&id) {
            if h.started {
                h.started = false;
                self.reservation.unmark_started(&id);
            }
        }
    }

    fn forget(&mut self, id: &Uuid) -> Option<Held> {
        self.reservation.untrack(id);
        self.held.remove(id)
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
        let (started, unstarted): (Vec<Uuid>, Vec<Uuid>) = ids
            .iter()
            .copied()
            .filter(|id| self.held.contains_key(id))
            .partition(|id| self.held[id].started);
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
        for id in started.iter().chain(&unstarted) {
            self.forget(id);
        }
        count_released(released);
        Ok(released)
    }

    /// Gives back every row still ours (the end of a batch, or a batch that failed as a whole).
    /// Best effort: if the database is gone the leases lapse and we re-lease them ourselves.
    pub async fn release_all(&mut self) {
        let ids: Vec<Uuid> = self.held.keys().copied().collect();
        if ids.is_empty() {
            return;
        }
        if let Err(error) = self.release(&ids).await {
            tracing::debug!(%error, rows = ids.len(), "could not give rows back; their leases will lapse");
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
        let (started, unstarted): (Vec<Uuid>, Vec<Uuid>) = ids
            .iter()
            .copied()
            .filter(|id| self.held.contains_key(id))
            .partition(|id| self.held[id].started);
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
        for id in &staged.completed {
            self.forget(id);
        }
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
        for id in &staged.released {
            self.forget(id);
        }
        count_released(staged.released.len() as u64);
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
        let rest: Vec<Uuid> = rows
            .iter()
            .copied()
            .filter(|id| self.held.contains_key(id))
            .collect();
        self.release(&rest).await?;
        Ok(())
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

fn count_released(n: u64) {
    if n > 0 {
        metrics::counter!(m::LEASES_RELEASED_TOTAL).increment(n);
    }
}

/// The one WARN line of a dead-letter move (SPEC §5: perspective, stream, event, global
/// position, attempts and max), and its metric.
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
    metrics::counter!(m::DEAD_LETTER_MOVES_TOTAL,
        m::LABEL_PERSPECTIVE => h.perspective.clone(),
        m::LABEL_REASON => reason.to_string())
    .increment(1);
}

/// Gives back rows a claim leased that no batch will work on (their lane is reserved by another
/// loop of ours): unstarted, with a refund of their claim's bump.
pub async fn give_back_unworked<S: WorkStore>(
    store: &S,
    instance: InstanceId,
    ids: &[Uuid],
) -> Result<u64, StoreError> {
    if ids.is_empty() {
        return Ok(0);
    }
    let released = store.release_unstarted(instance, ids).await?;
    count_released(released);
    Ok(released)
}
