//! The pipeline's spans, exported when traces are on ([`crate::telemetry::traces`]); with
//! traces off every constructor here returns a disabled span, which costs a callsite check.
//!
//! - `vantage.claim`: one claim, a root span; a claim that found nothing is dropped by the
//!   sampler, so an idle daemon exports nothing.
//! - `vantage.batch`: what became of the claimed rows (stages 2 to 6), a child of its claim;
//!   dead-letter moves are its children (`vantage.dead_letter`, emitted once the move is
//!   durable).
//! - `vantage.apply`: the apply of one event whose metadata carries a W3C `traceparent`, in one
//!   perspective. On the event's first attempt it is a child of the producer's span, so the
//!   producer's trace shows it; on a retry (or after a takeover) it starts a trace of its own,
//!   linked to the producer's span. Either way it is linked to its batch. It ends once its
//!   pass's outcome is durable (`vantage.outcome`: applied, failed, dead_lettered, released),
//!   or with `rolled_back` when the pass was given up and the event is tried again.

use std::sync::Arc;

use opentelemetry::trace::Status;
use tracing::field::Empty;
use tracing::Span;

use super::envelope::EventEnvelope;
use crate::telemetry::traces::{self, TARGET};

/// The longest error text put on a span (a handler's error can quote producer data).
const MAX_ERROR: usize = 1024;

/// A claim's span, opened before the claim; record [`traces::CLAIMED`] when it returns.
pub(crate) fn claim(perspectives: usize, max_rows: u32) -> Span {
    tracing::trace_span!(
        target: TARGET,
        parent: None,
        "vantage.claim",
        otel.kind = "consumer",
        vantage.claimed = Empty,
        vantage.perspectives = perspectives as i64,
        vantage.max_rows = i64::from(max_rows),
    )
}

/// The span of what becomes of `claimed` rows, a child of their `claim`.
pub(crate) fn batch(claim: &Span, claimed: usize) -> Span {
    tracing::trace_span!(
        target: TARGET,
        parent: claim,
        "vantage.batch",
        vantage.claimed = claimed as i64,
        vantage.applied = Empty,
        vantage.failed = Empty,
        vantage.dead_lettered = Empty,
        vantage.released = Empty,
    )
}

/// Records what a batch did on its span.
pub(crate) fn batch_done(span: &Span, outcome: &super::DrainOutcome) {
    let b = &outcome.batch;
    // (as i64: OpenTelemetry has no unsigned integers, and tracing's u64 would become text)
    span.record("vantage.applied", (b.applied + b.cooled) as i64);
    span.record("vantage.failed", b.failed as i64);
    span.record(
        "vantage.dead_lettered",
        (b.dead_lettered + outcome.dead_lettered_max_attempts + outcome.dead_lettered_unreadable)
            as i64,
    );
    span.record("vantage.released", b.released as i64);
}

/// A dead-letter move that just became durable: a span of its own, under the current batch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn dead_letter(
    perspective: &str,
    stream_id: uuid::Uuid,
    event_id: uuid::Uuid,
    global_position: i64,
    attempts: i32,
    reason: &str,
    error: &str,
) {
    let span = tracing::trace_span!(
        target: TARGET,
        "vantage.dead_letter",
        vantage.perspective = perspective,
        vantage.stream_id = %stream_id,
        vantage.event_id = %event_id,
        vantage.global_position = global_position,
        vantage.attempts = attempts,
        vantage.reason = reason,
        otel.status_code = "ERROR",
        otel.status_description = %crate::text::cap_at(error, MAX_ERROR),
    );
    drop(span);
}

/// What a pass decided for a traced event, before it is durable.
enum Pending {
    Applied,
    Failed(String),
    DeadLettered(String),
}

/// The apply span of one traced event in one pass (see the module's text). Dropped: ended with
/// the outcome, if the pass committed ([`ApplySpan::durable`]), else `rolled_back`.
///
/// Recorded without the SDK's span object, nor `tracing` ([`traces::Applies`]): with every
/// event traced this span is made once per row on the drain's path, and both cost more per
/// span than the rest of tracing together.
pub(crate) struct ApplySpan {
    record: Option<traces::ApplyRecord>,
    to: Arc<traces::Applies>,
    pending: Option<Pending>,
    durable: bool,
}

impl ApplySpan {
    /// The span of `ev`'s apply, when traces are on and its metadata has a valid `traceparent`.
    pub(crate) fn start(ev: &EventEnvelope) -> Option<ApplySpan> {
        if !tracing::enabled!(target: TARGET, tracing::Level::TRACE) {
            return None;
        }
        let producer = traces::parent_span_context(&ev.metadata)?;
        let (to, batch) = traces::Applies::current()?;
        let first = ev.attempts <= 1 && ev.failures == 0;
        // Few attributes, each small: with every event traced, the spans' size is most of
        // what exporting them costs. The event id, stream version and failure count are in
        // the database under the position.
        let event = traces::ApplyEvent {
            perspective: &ev.perspective_name,
            event_type: &ev.event_type,
            stream_id: ev.stream_id,
            global_position: ev.global_position,
            attempts: ev.attempts,
        };
        let record = if first {
            to.start(&event, Some(&producer), [None, batch])
        } else {
            // A trace of its own, linked to the producer's span (then to its batch).
            to.start(&event, None, [Some(producer), batch])
        }?;
        Some(ApplySpan {
            record: Some(record),
            to,
            pending: None,
            durable: false,
        })
    }

    pub(crate) fn applied(&mut self) {
        self.pending = Some(Pending::Applied);
    }

    pub(crate) fn failed(&mut self, error: &str) {
        self.pending = Some(Pending::Failed(
            crate::text::cap_at(error, MAX_ERROR).into_owned(),
        ));
    }

    pub(crate) fn dead_lettered(&mut self, error: &str) {
        self.pending = Some(Pending::DeadLettered(
            crate::text::cap_at(error, MAX_ERROR).into_owned(),
        ));
    }

    /// The pass committed: the outcome stands.
    pub(crate) fn durable(&mut self) {
        self.durable = true;
    }
}

impl Drop for ApplySpan {
    fn drop(&mut self) {
        let (outcome, status) = if !self.durable {
            ("rolled_back", Status::Unset)
        } else {
            match self.pending.take() {
                Some(Pending::Applied) => ("applied", Status::Ok),
                Some(Pending::Failed(error)) => ("failed", Status::error(error)),
                Some(Pending::DeadLettered(error)) => ("dead_lettered", Status::error(error)),
                // Reached but not decided: given back behind a failure of its lane.
                None => ("released", Status::Unset),
            }
        };
        if let Some(record) = self.record.take() {
            self.to.end(record, outcome, status);
        }
    }
}
