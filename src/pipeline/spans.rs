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

use opentelemetry::trace::TraceContextExt;
use tracing::field::Empty;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

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
pub(crate) struct ApplySpan {
    span: Span,
    pending: Option<Pending>,
    durable: bool,
}

impl ApplySpan {
    /// The span of `ev`'s apply, when traces are on and its metadata has a valid `traceparent`.
    pub(crate) fn start(ev: &EventEnvelope) -> Option<ApplySpan> {
        if !tracing::enabled!(target: TARGET, tracing::Level::TRACE) {
            return None;
        }
        let producer = traces::parent_of(&ev.metadata)?;
        // Few attributes, each small: with every event traced, the spans' size is most of
        // what tracing costs (encoding and sending them). The event id, stream version and
        // failure count are in the database under the position.
        let span = tracing::trace_span!(
            target: TARGET,
            parent: None,
            "vantage.apply",
            otel.name = %format_args!("apply {}", ev.perspective_name),
            otel.kind = "consumer",
            otel.status_code = Empty,
            otel.status_description = Empty,
            vantage.perspective = ev.perspective_name.as_str(),
            vantage.stream_id = %ev.stream_id,
            vantage.global_position = ev.global_position,
            vantage.event_type = ev.event_type.as_str(),
            vantage.attempts = ev.attempts,
            vantage.outcome = Empty,
        );
        let batch = Span::current().context().span().span_context().clone();
        if ev.attempts <= 1 && ev.failures == 0 {
            let _ = span.set_parent(producer);
        } else {
            span.add_link(producer.span().span_context().clone());
        }
        if batch.is_valid() {
            span.add_link(batch);
        }
        Some(ApplySpan {
            span,
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
        let span = &self.span;
        if !self.durable {
            span.record("vantage.outcome", "rolled_back");
            return;
        }
        match self.pending.take() {
            Some(Pending::Applied) => {
                span.record("vantage.outcome", "applied");
                span.record("otel.status_code", "OK");
            }
            Some(Pending::Failed(error)) => {
                span.record("vantage.outcome", "failed");
                span.record("otel.status_code", "ERROR");
                span.record("otel.status_description", error.as_str());
            }
            Some(Pending::DeadLettered(error)) => {
                span.record("vantage.outcome", "dead_lettered");
                span.record("otel.status_code", "ERROR");
                span.record("otel.status_description", error.as_str());
            }
            // Reached but not decided: given back behind a failure of its lane.
            None => {
                span.record("vantage.outcome", "released");
            }
        }
    }
}
