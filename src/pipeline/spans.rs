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

use opentelemetry::trace::{Link, Span as _, SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};
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
///
/// Made with the SDK's tracer directly rather than through `tracing`: with every event
/// traced, this span is made once per row on the drain's path, and the `tracing` layer's own
/// bookkeeping per span cost more than the span itself.
pub(crate) struct ApplySpan {
    span: opentelemetry_sdk::trace::Span,
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
        let tracer = traces::DirectTracer::current()?;
        let batch = Span::current().context().span().span_context().clone();
        let first = ev.attempts <= 1 && ev.failures == 0;
        let mut links = Vec::with_capacity(2);
        if !first {
            links.push(Link::with_context(producer.span().span_context().clone()));
        }
        if batch.is_valid() {
            links.push(Link::with_context(batch));
        }
        // Few attributes, each small: with every event traced, the spans' size is most of
        // what exporting them costs. The event id, stream version and failure count are in
        // the database under the position.
        let builder = tracer
            .span_builder(format!("apply {}", ev.perspective_name))
            .with_kind(SpanKind::Consumer)
            .with_links(links)
            .with_attributes([
                KeyValue::new("vantage.perspective", ev.perspective_name.clone()),
                // (encoded without the formatting machinery: this runs once per traced row)
                KeyValue::new(
                    "vantage.stream_id",
                    ev.stream_id
                        .hyphenated()
                        .encode_lower(&mut uuid::Uuid::encode_buffer())
                        .to_owned(),
                ),
                KeyValue::new("vantage.global_position", ev.global_position),
                KeyValue::new("vantage.event_type", ev.event_type.clone()),
                KeyValue::new("vantage.attempts", i64::from(ev.attempts)),
            ]);
        let parent = if first { producer } else { Context::new() };
        Some(ApplySpan {
            span: builder.start_with_context(&tracer, &parent),
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
            ("rolled_back", None)
        } else {
            match self.pending.take() {
                Some(Pending::Applied) => ("applied", Some(Status::Ok)),
                Some(Pending::Failed(error)) => ("failed", Some(Status::error(error))),
                Some(Pending::DeadLettered(error)) => ("dead_lettered", Some(Status::error(error))),
                // Reached but not decided: given back behind a failure of its lane.
                None => ("released", None),
            }
        };
        self.span
            .set_attribute(KeyValue::new("vantage.outcome", outcome));
        if let Some(status) = status {
            self.span.set_status(status);
        }
        self.span.end();
    }
}
