//! The drain pipeline, one stage per module, in the order an event goes through them
//! ([`Pipeline::drain_once_unless`] calls them in this order):
//!
//! 1. [`claim`]: acquire lanes and lease their rows (`get_stream_events`, one call; orphaned
//!    lanes included), returning the [`lease`] handle, the one door of every change to them;
//! 2. [`dlq_filter`]: rows claimed more than `max_perspective_event_attempts` times go to the
//!    dead letters, before any deserialization;
//! 3. [`envelope`]: survivors become typed [`EventEnvelope`](crate::perspective::EventEnvelope)s
//!    (a row whose event vanished is dead-lettered);
//! 4. [`cooldown`]: which rows were applied recently (completed, not re-applied);
//! 5. [`apply`]: handlers run in stream order per lane and decide each event: applied, failed
//!    with a [`backoff`], dead-lettered, skipped;
//! 6. [`settle`]: each pass's decisions become durable through the lease handle, in the same
//!    transaction as the handlers' writes; at the end whatever is still ours goes back.
//!
//! [`inflight`] is the process's one record of which rows and lanes its batches hold;
//! [`replaying`] chooses which perspectives a loop's claims ask for (history is background
//! work: one loop takes the perspectives replaying it).

pub mod apply;
pub mod backoff;
pub mod claim;
pub mod cooldown;
pub mod dlq_filter;
pub mod envelope;
pub mod inflight;
pub mod lease;
pub mod replaying;
pub mod settle;
mod spans;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use self::apply::{ApplyBatchError, ApplyContext, BatchOutcome};
use self::claim::ClaimLimits;
use self::dlq_filter::DeadLetterSink;
use self::inflight::InFlight;
use self::replaying::{ClaimRole, Replaying};
use crate::config::WorkerSettings;
use crate::perspective::PerspectiveRegistry;
use crate::store::{InstanceId, Store, StoreError, WorkStore};

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
    /// Whether some perspective reads events' payloads (else claims leave them out).
    pub reads_data: bool,
    /// Which perspectives this loop's claims ask for (`pipeline::replaying`).
    pub role: ClaimRole,
    /// The perspectives this process has seen replaying history, shared by every clone.
    pub replaying: Arc<Replaying>,
    /// Poked when a claim comes back full (more work is likely due): another idle loop of the
    /// process should claim beside this one. `None`: nobody to tell (tests, one-shot drains).
    pub relay: Option<Arc<tokio::sync::Notify>>,
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
        let reads_data = registry.iter().any(|p| p.reads_data());
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
            reads_data,
            role: ClaimRole::All,
            replaying: Arc::default(),
            relay: None,
        }
    }

    /// The pipeline of consumer loop `id` of `consumers`: with two or more, the first claims
    /// the perspectives replaying history and the others the rest (`pipeline::replaying`).
    pub fn for_consumer(&self, id: usize, consumers: usize) -> Pipeline<S> {
        Pipeline {
            role: ClaimRole::of_consumer(id, consumers),
            ..self.clone()
        }
    }

    /// This pipeline, poking `relay` whenever a claim comes back full (`daemon::wake`).
    pub fn relaying_to(self, relay: Arc<tokio::sync::Notify>) -> Pipeline<S> {
        Pipeline {
            relay: Some(relay),
            ..self
        }
    }

    /// Whether this loop's claims ask for every perspective now (not while some perspective
    /// replays history and the loop takes only that part, or only the rest).
    pub fn claims_every_perspective(&self) -> bool {
        self.replaying
            .claimable(self.role, &self.perspectives)
            .len()
            == self.perspectives.len()
    }

    /// One pass: claim → DLQ filter → envelope → cooldown → apply → settle.
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
        // 0. Rows an ended batch could not give back (the database went away) stall their
        // lanes until they are given back: first, now that the database may answer.
        if let Err(error) = self.inflight.settle_owed(&ctx.store, ctx.instance).await {
            tracing::debug!(%error, "could not give back rows owed back yet");
        }
        // History yields to fresh work that waits (`replaying`): before the claim, nothing held.
        if self.role == ClaimRole::History {
            let mut waited = std::time::Duration::ZERO;
            while let Some(step) = self
                .replaying
                .history_wait(waited, std::time::Instant::now())
            {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return Ok(DrainOutcome::default()),
                    _ = tokio::time::sleep(step) => waited += step,
                }
            }
        }
        // 1. Claim: the lease handle owns the rows from here on. Its span is never entered, so
        // nothing starts it before the number of rows is on it.
        let asked = self.replaying.claimable(self.role, &self.perspectives);
        let claim_span = spans::claim(asked.len(), self.limits.batch_size);
        let claim = async {
            // Rows a claim of ours leased although its answer was lost stall their lanes too.
            if let Err(error) = self
                .inflight
                .settle_lost_claims(&ctx.store, ctx.instance)
                .await
            {
                tracing::debug!(%error, "could not give back the rows of a lost claim yet");
            }
            claim::claim_batch_reading(
                &ctx.store,
                ctx.instance,
                &asked,
                &self.limits,
                &self.inflight,
                ctx.max_attempts,
                self.reads_data,
            )
            .await
        };
        let mut lease = tokio::select! {
            biased;
            _ = stop.cancelled() => return Ok(DrainOutcome::default()),
            claimed = claim => claimed.map_err(DrainError::Claim)?,
        };
        let rows = lease.take_rows();
        self.replaying.observe(
            self.role,
            &asked,
            rows.iter().map(|r| (r.perspective_name.as_str(), r.replay)),
        );
        if self.role == ClaimRole::Fresh {
            self.replaying
                .report_fresh(&rows, std::time::Instant::now());
        }
        // Recorded before anything asks for the span's context: the sampler drops an empty claim.
        claim_span.record(crate::telemetry::traces::CLAIMED, rows.len() as i64);
        if rows.is_empty() {
            return Ok(DrainOutcome::default());
        }
        // Before applying, so that the next loop claims while this one applies.
        if let Some(relay) = &self.relay {
            if claim::is_full(&rows, &self.limits) {
                relay.notify_one();
            }
        }
        let batch_span = spans::batch(&claim_span, rows.len());
        drop(claim_span);
        let result = self
            .drain_claimed(lease, rows)
            .instrument(batch_span.clone())
            .await;
        if let Ok(outcome) = &result {
            spans::batch_done(&batch_span, outcome);
        }
        result
    }

    /// Stages 2 to 6 of a pass over the `rows` of `lease`.
    async fn drain_claimed(
        &self,
        mut lease: lease::LeasedBatch<S>,
        rows: Vec<crate::store::WorkRow>,
    ) -> Result<DrainOutcome, DrainError> {
        let ctx = &self.ctx;
        let mut outcome = DrainOutcome {
            claimed: rows.len(),
            ..DrainOutcome::default()
        };

        // 2. DLQ pre-filter.
        let sink: Option<&mut dyn DeadLetterSink> = if self.dead_letters_enabled {
            Some(&mut lease)
        } else {
            None
        };
        let filtered = dlq_filter::filter_dead_lettered(rows, ctx.max_attempts, sink).await;
        outcome.dead_lettered_max_attempts = filtered.moved;

        // 3. Envelopes.
        let envelopes = match envelope::open(&mut lease, filtered.survivors).await {
            Ok((envelopes, unreadable)) => {
                outcome.dead_lettered_unreadable = unreadable;
                envelopes
            }
            Err(e) => {
                settle::give_back_rest(&mut lease).await;
                return Err(DrainError::DeadLetter(e));
            }
        };

        // 4. Cooldown.
        let cooled = cooldown::cooled(ctx.cooldown.as_deref(), &envelopes);

        // 5. Apply (each pass settled by 6. in its transaction).
        let result = apply::apply_batch(ctx, &mut lease, envelopes, cooled).await;
        // A store error here comes from a step of the pass itself (BEGIN, SAVEPOINT, COMMIT):
        // a handler's own statement is judged in the careful pass and never surfaces as one.
        // When the session died there (terminated, the server restarted), no event is to blame.
        if let Err(ApplyBatchError::Store(e)) = &result {
            if e.is_connection_error() {
                lease.forgive_started();
            }
        }

        // 6. Settle the rest: whatever is still ours (nothing, unless the batch failed as a
        // whole) goes back.
        settle::give_back_rest(&mut lease).await;
        outcome.batch = result?;
        Ok(outcome)
    }
}
