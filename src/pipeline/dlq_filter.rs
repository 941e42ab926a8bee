//! The DLQ pre-filter (seed: `FilterDeadLetteredAsync`).
//!
//! Runs right after the claim returns raw rows, before deserialization: a row claimed more than
//! `max_perspective_event_attempts` times (strict `>`) is moved to the dead letters and dropped
//! from the apply set. Deserializing and applying a row we already know is doomed would be the
//! most expensive way to find out again.
//!
//! - A move that finds the row already gone (another worker completed or moved it) is a no-op.
//! - A move that *fails* keeps the row in the apply set: we would rather visibly keep failing
//!   than silently swallow rows when the dead-letter surface itself is broken.
//! - With the option `off`, or without a dead-letter store (in-memory hosts), it passes
//!   everything through.

use async_trait::async_trait;
use uuid::Uuid;

use super::lease::LeasedBatch;
use crate::store::{MoveOutcome, StoreError, WorkRow, WorkStore, FAILURE_MAX_ATTEMPTS};
use crate::telemetry::metrics as m;

/// Where dead letters go. The lease handle ([`LeasedBatch`]) is the one real implementation (it
/// logs and counts each move once, after it is durable); the trait lets in-memory hosts run the
/// same pipeline with no dead-letter store, and unit tests script outcomes.
#[async_trait]
pub trait DeadLetterSink: Send {
    /// Moves one leased work row (atomic, idempotent).
    async fn move_to_dead_letters(
        &mut self,
        work_id: Uuid,
        reason: &str,
        error_text: &str,
    ) -> Result<MoveOutcome, StoreError>;

    /// Moves many leased work rows with one reason, each with its own error text, all or
    /// nothing: one outcome per row, in order, or an error and nothing moved.
    async fn move_many_to_dead_letters(
        &mut self,
        moves: &[(Uuid, String)],
        reason: &str,
    ) -> Result<Vec<MoveOutcome>, StoreError>;
}

#[async_trait]
impl<S: WorkStore> DeadLetterSink for LeasedBatch<S> {
    async fn move_to_dead_letters(
        &mut self,
        work_id: Uuid,
        reason: &str,
        error_text: &str,
    ) -> Result<MoveOutcome, StoreError> {
        self.dead_letter_now(work_id, reason, error_text).await
    }

    async fn move_many_to_dead_letters(
        &mut self,
        moves: &[(Uuid, String)],
        reason: &str,
    ) -> Result<Vec<MoveOutcome>, StoreError> {
        self.dead_letter_many_now(moves, reason).await
    }
}

/// The decision, on its own: `attempts` is one-based (N = claimed N times), so a max of 10
/// applies claims 1..=10 and dead-letters on the 11th. `None` = dead-lettering is off.
pub fn exceeds_max_attempts(attempts: i32, max: Option<u32>) -> bool {
    match max {
        Some(max) => i64::from(attempts) > i64::from(max),
        None => false,
    }
}

/// What the filter did with one claim's rows.
#[derive(Debug, Default)]
pub struct FilterOutcome {
    /// Rows to deserialize and apply, in their original order.
    pub survivors: Vec<WorkRow>,
    /// Rows moved to the dead letters now.
    pub moved: usize,
    /// Rows another worker had already completed or moved (dropped).
    pub already_gone: usize,
    /// Rows whose move failed (kept in `survivors`).
    pub move_errors: usize,
}

/// Runs the pre-filter over the rows of one claim.
pub async fn filter_dead_lettered(
    rows: Vec<WorkRow>,
    max_attempts: Option<u32>,
    sink: Option<&mut dyn DeadLetterSink>,
) -> FilterOutcome {
    let (Some(max), Some(sink)) = (max_attempts, sink) else {
        return FilterOutcome {
            survivors: rows,
            ..FilterOutcome::default()
        };
    };
    let mut outcome = FilterOutcome::default();
    let error_text = |row: &WorkRow| {
        format!(
            "claimed {} times, more than max_perspective_event_attempts = {max}",
            row.attempts
        )
    };
    let (doomed, _): (Vec<usize>, Vec<usize>) =
        (0..rows.len()).partition(|&i| exceeds_max_attempts(rows[i].attempts, Some(max)));
    if doomed.is_empty() {
        outcome.survivors = rows;
        return outcome;
    }

    // All of a claim's exhausted rows in one move; if that fails, row by row, so that one row
    // the dead-letter store refuses does not keep the others in the apply set.
    let moves: Vec<(Uuid, String)> = doomed
        .iter()
        .map(|&i| (rows[i].event_work_id, error_text(&rows[i])))
        .collect();
    let results: Vec<Result<MoveOutcome, StoreError>> = match sink
        .move_many_to_dead_letters(&moves, FAILURE_MAX_ATTEMPTS)
        .await
    {
        Ok(outcomes) => outcomes.into_iter().map(Ok).collect(),
        Err(_) => {
            let mut results = Vec::with_capacity(moves.len());
            for (id, text) in &moves {
                results.push(
                    sink.move_to_dead_letters(*id, FAILURE_MAX_ATTEMPTS, text)
                        .await,
                );
            }
            results
        }
    };

    let mut results = doomed.iter().copied().zip(results).peekable();
    for (i, row) in rows.into_iter().enumerate() {
        let Some((_, result)) = results.next_if(|(d, _)| *d == i) else {
            outcome.survivors.push(row);
            continue;
        };
        // The sink (the lease handle) logs and counts a move once it is durable.
        match result {
            Ok(MoveOutcome::Moved(_)) => outcome.moved += 1,
            Ok(MoveOutcome::AlreadyGone) => outcome.already_gone += 1,
            Err(error) => {
                tracing::error!(
                    perspective = %row.perspective_name,
                    stream_id = %row.stream_id,
                    event_id = %row.event_id,
                    global_position = row.global_position,
                    attempts = row.attempts,
                    max_attempts = max,
                    %error,
                    "could not move the event to the dead letters; applying it as usual"
                );
                metrics::counter!(m::DEAD_LETTER_MOVE_ERRORS_TOTAL).increment(1);
                outcome.move_errors += 1;
                outcome.survivors.push(row);
            }
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Records moves; answers with a scripted outcome per work id.
    #[derive(Default)]
    struct Sink {
        gone: Vec<Uuid>,
        broken: Vec<Uuid>,
        moved: Mutex<Vec<(Uuid, String)>>,
        batches: usize,
    }

    #[async_trait]
    impl DeadLetterSink for Sink {
        async fn move_to_dead_letters(
            &mut self,
            work_id: Uuid,
            reason: &str,
            _error_text: &str,
        ) -> Result<MoveOutcome, StoreError> {
            if self.broken.contains(&work_id) {
                return Err(StoreError::Conflict("dead-letter table is broken".into()));
            }
            if self.gone.contains(&work_id) {
                return Ok(MoveOutcome::AlreadyGone);
            }
            self.moved
                .lock()
                .unwrap()
                .push((work_id, reason.to_string()));
            Ok(MoveOutcome::Moved(Uuid::new_v4()))
        }

        async fn move_many_to_dead_letters(
            &mut self,
            moves: &[(Uuid, String)],
            reason: &str,
        ) -> Result<Vec<MoveOutcome>, StoreError> {
            self.batches += 1;
            if moves.iter().any(|(id, _)| self.broken.contains(id)) {
                return Err(StoreError::Conflict("dead-letter table is broken".into()));
            }
            let mut out = Vec::new();
            for (id, text) in moves {
                out.push(self.move_to_dead_letters(*id, reason, text).await?);
            }
            Ok(out)
        }
    }

    fn row(attempts: i32) -> WorkRow {
        WorkRow {
            attempts,
            ..WorkRow::sample("p", Uuid::new_v4())
        }
    }

    #[test]
    fn strictly_greater_than_max() {
        assert!(!exceeds_max_attempts(10, Some(10)));
        assert!(exceeds_max_attempts(11, Some(10)));
        assert!(!exceeds_max_attempts(1, Some(1)));
        assert!(exceeds_max_attempts(2, Some(1)));
        assert!(!exceeds_max_attempts(i32::MAX, None));
    }

    #[tokio::test]
    async fn moves_only_rows_over_the_limit_and_keeps_order() {
        let mut sink = Sink::default();
        let rows = vec![row(1), row(11), row(10), row(12)];
        let ids: Vec<Uuid> = rows.iter().map(|r| r.event_work_id).collect();
        let out = filter_dead_lettered(rows, Some(10), Some(&mut sink)).await;
        let kept: Vec<Uuid> = out.survivors.iter().map(|r| r.event_work_id).collect();
        assert_eq!(kept, vec![ids[0], ids[2]]);
        assert_eq!(out.moved, 2);
        assert_eq!(sink.batches, 1, "one move for the claim's exhausted rows");
        let moved = sink.moved.lock().unwrap();
        assert_eq!(moved.len(), 2);
        assert!(moved.iter().all(|(_, r)| r == FAILURE_MAX_ATTEMPTS));
    }

    #[tokio::test]
    async fn already_gone_is_dropped_silently() {
        let r = row(11);
        let mut sink = Sink {
            gone: vec![r.event_work_id],
            ..Sink::default()
        };
        let out = filter_dead_lettered(vec![r], Some(10), Some(&mut sink)).await;
        assert!(out.survivors.is_empty());
        assert_eq!((out.moved, out.already_gone, out.move_errors), (0, 1, 0));
    }

    #[tokio::test]
    async fn failed_move_keeps_the_row_in_the_apply_set() {
        let r = row(11);
        let id = r.event_work_id;
        let mut sink = Sink {
            broken: vec![id],
            ..Sink::default()
        };
        let out = filter_dead_lettered(vec![r], Some(10), Some(&mut sink)).await;
        assert_eq!(out.survivors.len(), 1);
        assert_eq!(out.survivors[0].event_work_id, id);
        assert_eq!(out.move_errors, 1);
    }

    #[tokio::test]
    async fn one_refused_row_does_not_keep_the_others_in_the_apply_set() {
        let (good, bad, fine) = (row(11), row(12), row(1));
        let (good_id, bad_id, fine_id) =
            (good.event_work_id, bad.event_work_id, fine.event_work_id);
        let mut sink = Sink {
            broken: vec![bad_id],
            ..Sink::default()
        };
        let out = filter_dead_lettered(vec![good, bad, fine], Some(10), Some(&mut sink)).await;
        let kept: Vec<Uuid> = out.survivors.iter().map(|r| r.event_work_id).collect();
        assert_eq!(kept, vec![bad_id, fine_id]);
        assert_eq!((out.moved, out.move_errors), (1, 1));
        assert_eq!(sink.moved.lock().unwrap()[0].0, good_id);
    }

    #[tokio::test]
    async fn off_or_no_store_passes_everything_through() {
        let mut sink = Sink::default();
        let out = filter_dead_lettered(vec![row(1000)], None, Some(&mut sink)).await;
        assert_eq!(out.survivors.len(), 1);
        let out = filter_dead_lettered(vec![row(1000)], Some(10), None).await;
        assert_eq!(out.survivors.len(), 1);
        assert!(sink.moved.lock().unwrap().is_empty());
    }
}
