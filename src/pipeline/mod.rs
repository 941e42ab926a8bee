//! The drain pipeline, one stage per module, in the order an event goes through them:
//!
//! 1. [`claim`]: acquire lanes and fetch their rows raw (`get_stream_events`, one call; orphaned
//!    lanes included);
//! 2. [`dlq_filter`]: rows claimed more than `max_perspective_event_attempts` times go to the
//!    dead letters, before any deserialization;
//! 3. [`envelope`]: survivors become typed [`EventEnvelope`](crate::perspective::EventEnvelope)s;
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
pub mod lease;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use self::apply::{ApplyBatchError, ApplyContext, BatchOutcome};
use self::claim::{ClaimLimits, ClaimedBatch};
use self::dlq_filter::DeadLetterSink;
use self::inflight::InFlight;
use self::lease::LeasedBatch;
use crate::config::WorkerSettings;
use crate::perspective::PerspectiveRegistry;
use crate::store::{InstanceId, MoveOutcome, Store, StoreError, WorkStore, FAILURE_PERMANENT};

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

/// Why a pass failed; its rows were given back (or will lapse if the database is gone).
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
        }
    }
}

/// One consumer loop's view of the pipeline (cheap to clone: everything is shared), over a
/// store: [`Store`] (PostgreSQL, the default) or [`MemoryStore`](crate::store::MemoryStore).
#[derive(Clone)]
pub struct Pipeline<S: WorkStore = Store> {
    /// Apply stage context (store, instance, handlers, cooldown, backoff).
    pub ctx: ApplyContext<S>,
    /// Claim limits.
    pub limits: ClaimLimits,
    /// Perspective names we have handlers for (claims take only their rows).
    pub perspectives: Vec<String>,
    /// Shared per-process reservations.
    pub inflight: Arc<InFlight>,
    /// Whether dead letters can be written (false in in-memory hosts: the filter passes through).
    pub dead_letters_enabled: bool,
}

impl<S: WorkStore> Pipeline<S> {
    /// The pipeline of one daemon: `registry`'s handlers, claims and retries as `worker` says,
    /// a fresh [`InFlight`] shared by every clone (one per process).
    pub fn new(
        store: S,
        instance: InstanceId,
        registry: PerspectiveRegistry,
        cooldown: Option<Arc<cooldown::CooldownCache>>,
        worker: &WorkerSettings,
    ) -> Pipeline<S> {
        let inflight = InFlight::new();
        let perspectives = registry.names();
        let dead_letters_enabled = store.has_dead_letters();
        Pipeline {
            ctx: ApplyContext {
                store,
                instance,
                registry,
                cooldown,
                backoff_base: worker.retry_backoff_base,
                backoff_max: worker.retry_backoff_max,
                max_attempts: worker.max_perspective_event_attempts,
                apply_timeout: worker.apply_timeout,
                small_transactions: Default::default(),
                inflight: Arc::clone(&inflight),
            },
            limits: ClaimLimits {
                lease: worker.lease,
                max_streams: worker.max_streams_per_claim,
                batch_size: worker.batch_size,
            },
            perspectives,
            inflight,
            dead_letters_enabled,
        }
    }

    /// One pass: claim → DLQ filter → envelope → (cooldown, apply, complete).
    pub async fn drain_once(&self) -> Result<DrainOutcome, DrainError> {
        self.drain_once_unless(&CancellationToken::new()).await
    }

    /// One pass, except that `stop` abandons the claim stage (a claim waiting on a database
    /// that does not answer is no work in flight). Once rows are claimed, the pass finishes.
    pub async fn drain_once_unless(
        &self,
        stop: &CancellationToken,
    ) -> Result<DrainOutcome, DrainError> {
        let ctx = &self.ctx;
        let claim = claim::claim_batch(
            &ctx.store,
            ctx.instance,
            &self.perspectives,
            &self.limits,
            &self.inflight,
        );
        let claimed = tokio::select! {
            biased;
            _ = stop.cancelled() => return Ok(DrainOutcome::default()),
            claimed = claim => claimed,
        };
        let ClaimedBatch { rows, reservation } = claimed.map_err(DrainError::Claim)?;
        let mut outcome = DrainOutcome {
            claimed: rows.len(),
            ..DrainOutcome::default()
        };
        if rows.is_empty() {
            return Ok(outcome);
        }
        let mut lease = LeasedBatch::new(
            ctx.store.clone(),
            ctx.instance,
            ctx.max_attempts,
            &rows,
            reservation,
        );

        let sink: Option<&mut dyn DeadLetterSink> = if self.dead_letters_enabled {
            Some(&mut lease)
        } else {
            None
        };
        let filtered = dlq_filter::filter_dead_lettered(rows, ctx.max_attempts, sink).await;
        outcome.dead_lettered_max_attempts = filtered.moved;

        let mut envelopes = Vec::with_capacity(filtered.survivors.len());
        for row in filtered.survivors {
            let work_id = row.event_work_id;
            match envelope::from_row(row) {
                Ok(envelope) => envelopes.push(envelope),
                Err(error) => {
                    match lease
                        .dead_letter_now(work_id, FAILURE_PERMANENT, &error.to_string())
                        .await
                    {
                        Ok(MoveOutcome::Moved(_)) => outcome.dead_lettered_unreadable += 1,
                        Ok(MoveOutcome::AlreadyGone) => {}
                        Err(e) => {
                            lease.release_all().await;
                            return Err(DrainError::DeadLetter(e));
                        }
                    }
                }
            }
        }

        let result = apply::apply_batch(ctx, &mut lease, envelopes).await;
        // Whatever is still ours (nothing, unless the batch failed as a whole) goes back.
        lease.release_all().await;
        outcome.batch = result?;
        Ok(outcome)
    }
}
