//! The drain pipeline, one stage per module, in the order an event goes through them:
//!
//! 1. [`claim`]: acquire lanes and fetch their rows raw (`claim_orphaned_perspective_events`,
//!    `get_stream_events`);
//! 2. [`dlq_filter`]: rows claimed more than `max_perspective_event_attempts` times go to the
//!    dead letters, before any deserialization;
//! 3. [`envelope`]: survivors become typed [`EventEnvelope`]s;
//! 4. [`cooldown`]: recently applied work ids are completed, not re-applied (inside apply);
//! 5. [`apply`]: handlers run in stream order per lane; success completes the row in the same
//!    transaction, failure parks it with [`backoff`].

pub mod apply;
pub mod backoff;
pub mod claim;
pub mod cooldown;
pub mod dlq_filter;
pub mod envelope;
pub mod inflight;

use std::sync::Arc;

use uuid::Uuid;

pub use envelope::EventEnvelope;

use self::apply::{ApplyBatchError, ApplyContext, BatchOutcome};
use self::claim::{ClaimLimits, ClaimedBatch};
use self::dlq_filter::DeadLetterSink;
use self::inflight::InFlight;
use crate::store::{MoveOutcome, StoreError, FAILURE_PERMANENT};
use crate::telemetry::metrics as m;

/// What one pass of the pipeline did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DrainOutcome {
    /// Rows claimed.
    pub claimed: usize,
    /// Rows dead-lettered by the pre-filter (MaxAttemptsExceeded).
    pub dead_lettered_max_attempts: usize,
    /// Rows dead-lettered because they could not become an envelope (their event vanished).
    pub dead_lettered_unreadable: usize,
    /// What the apply stage did.
    pub batch: BatchOutcome,
}

/// Why a pass failed; its rows were given back with a refund (or will lapse if the database
/// is gone).
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// The claim failed.
    #[error("claim failed: {0}")]
    Claim(#[source] StoreError),
    /// The apply stage failed as a whole.
    #[error("apply failed: {0}")]
    Apply(#[from] ApplyBatchError),
    /// A dead-letter move of an unreadable row failed.
    #[error("dead-letter move failed: {0}")]
    DeadLetter(#[source] StoreError),
}

impl DrainError {
    /// True when the database itself is the problem (back off, do not blame events).
    pub fn is_database_unavailable(&self) -> bool {
        match self {
            DrainError::Claim(e) | DrainError::DeadLetter(e) => e.is_connection_error(),
            DrainError::Apply(ApplyBatchError::Store(e)) => e.is_connection_error(),
            DrainError::Apply(ApplyBatchError::Unavailable(_)) => true,
            // Lock conflicts are transient too; nobody was charged.
            DrainError::Apply(ApplyBatchError::Conflict(_)) => true,
        }
    }
}

/// One consumer loop's view of the pipeline (cheap to clone: everything is shared).
#[derive(Clone)]
pub struct Pipeline {
    /// Apply stage context (store, instance, handlers, cooldown, backoff).
    pub ctx: ApplyContext,
    /// Claim limits.
    pub limits: ClaimLimits,
    /// Perspective names we have handlers for (claims take only their rows).
    pub perspectives: Vec<String>,
    /// Shared per-process reservations.
    pub inflight: Arc<InFlight>,
    /// Whether dead letters can be written (false in in-memory hosts: the filter passes through).
    pub dead_letters_enabled: bool,
}

impl Pipeline {
    /// One pass: claim → DLQ filter → envelope → (cooldown, apply, complete).
    pub async fn drain_once(&self) -> Result<DrainOutcome, DrainError> {
        let ctx = &self.ctx;
        let ClaimedBatch { rows, reservation } = claim::claim_batch(
            &ctx.store,
            ctx.instance,
            &self.perspectives,
            &self.limits,
            &self.inflight,
        )
        .await
        .map_err(DrainError::Claim)?;
        let mut outcome = DrainOutcome {
            claimed: rows.len(),
            ..DrainOutcome::default()
        };
        if rows.is_empty() {
            return Ok(outcome);
        }
        let all_ids: Vec<Uuid> = rows.iter().map(|r| r.event_work_id).collect();

        let sink: Option<&dyn DeadLetterSink> = if self.dead_letters_enabled {
            Some(&ctx.store)
        } else {
            None
        };
        let filtered =
            dlq_filter::filter_dead_lettered(rows, ctx.max_attempts, sink, ctx.instance).await;
        outcome.dead_lettered_max_attempts = filtered.moved;

        let mut envelopes = Vec::with_capacity(filtered.survivors.len());
        for row in filtered.survivors {
            let (work_id, perspective, stream_id, event_id, global_position, attempts) = (
                row.event_work_id,
                row.perspective_name.clone(),
                row.stream_id,
                row.event_id,
                row.global_position,
                row.attempts,
            );
            match EventEnvelope::from_row(row) {
                Ok(envelope) => envelopes.push(envelope),
                Err(error) => {
                    let error = error.to_string();
                    match ctx
                        .store
                        .move_to_dead_letters(
                            work_id,
                            FAILURE_PERMANENT,
                            &error,
                            Some(ctx.instance),
                        )
                        .await
                    {
                        Ok(MoveOutcome::Moved(dead_letter_id)) => {
                            tracing::warn!(perspective = %perspective, %stream_id, %event_id, global_position, attempts,
                                max_attempts = ?ctx.max_attempts, reason = FAILURE_PERMANENT,
                                %dead_letter_id, %error, "event dead-lettered: it cannot be read");
                            metrics::counter!(m::DEAD_LETTER_MOVES_TOTAL,
                                m::LABEL_PERSPECTIVE => perspective,
                                m::LABEL_REASON => FAILURE_PERMANENT)
                            .increment(1);
                            outcome.dead_lettered_unreadable += 1;
                        }
                        Ok(MoveOutcome::AlreadyGone) => {}
                        Err(e) => {
                            self.give_back(&all_ids).await;
                            return Err(DrainError::DeadLetter(e));
                        }
                    }
                }
            }
        }

        match apply::apply_batch(ctx, envelopes).await {
            Ok(batch) => {
                outcome.batch = batch;
                drop(reservation);
                Ok(outcome)
            }
            Err(e) => {
                self.give_back(&all_ids).await;
                drop(reservation);
                Err(e.into())
            }
        }
    }

    /// Best effort: rows we still hold after a failed pass go back with a refund (if the
    /// database is gone, their leases lapse and we re-lease them ourselves without a bump).
    async fn give_back(&self, ids: &[Uuid]) {
        match self
            .ctx
            .store
            .release_unstarted(self.ctx.instance, ids)
            .await
        {
            Ok(n) => metrics::counter!(m::LEASES_RELEASED_TOTAL).increment(n),
            Err(e) => {
                tracing::debug!(error = %e, "could not give rows back; their leases will lapse")
            }
        }
    }
}
