//! Apply spans without the SDK's span object: with every event traced there is one per row on
//! the drain's path, and the SDK's span (a sampler call through a `Context`, the span data's
//! name, attribute vector and owned strings, a channel send per span to the batch thread, and
//! the frees of all of it there) cost about as much as the rest of tracing together.
//!
//! An [`ApplyRecord`] holds what the span says in one flat value. When it ends, [`Applies`]
//! hands it on: for `http/protobuf`, straight into the body of the next OTLP request
//! ([`otlp::Queue`]); for any other exporter (`http/json`, the tests' in-memory one), as the
//! SDK's [`SpanData`] to the provider's own processor, so those exporters see exactly what the
//! SDK would have made. A test checks the two agree byte for byte once encoded.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::SystemTime;

use opentelemetry::trace::{
    Link, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::trace::{
    IdGenerator, RandomIdGenerator, Sampler, SamplingDecision, ShouldSample, SpanData, SpanEvents,
    SpanLinks, SpanProcessor,
};

use super::{otlp, SamplerChoice};

/// The name of every apply span starts so; the perspective's name follows.
pub(crate) const NAME_PREFIX: &str = "apply ";

/// One apply span, recorded (see the module's text). Its attributes, in this order:
/// `vantage.perspective`, `vantage.stream_id`, `vantage.global_position`,
/// `vantage.event_type`, `vantage.attempts`, then `vantage.outcome` when it ends.
pub(crate) struct ApplyRecord {
    pub(super) context: SpanContext,
    /// The producer's span on a first attempt; invalid for a root.
    pub(super) parent: SpanId,
    pub(super) parent_is_remote: bool,
    /// At most two: the producer's span (on a retry), then the batch's.
    pub(super) links: [Option<SpanContext>; 2],
    pub(super) start: SystemTime,
    /// The perspective's name, then the event type: one allocation for both.
    text: String,
    perspective_len: usize,
    pub(super) stream_id: uuid::Uuid,
    pub(super) global_position: i64,
    pub(super) attempts: i64,
}

/// What an apply span says once it ends.
pub(crate) struct Ended {
    pub(super) record: ApplyRecord,
    pub(super) end: SystemTime,
    pub(super) outcome: &'static str,
    pub(super) status: Status,
}

/// An attribute value as the encoder and the SDK's span data both need it.
pub(super) enum Attr<'a> {
    Str(&'a str),
    I64(i64),
}

/// The event an apply span is about.
pub(crate) struct ApplyEvent<'a> {
    pub(crate) perspective: &'a str,
    pub(crate) event_type: &'a str,
    pub(crate) stream_id: uuid::Uuid,
    pub(crate) global_position: i64,
    pub(crate) attempts: i32,
}

impl ApplyRecord {
    pub(super) fn perspective(&self) -> &str {
        &self.text[..self.perspective_len]
    }

    pub(super) fn event_type(&self) -> &str {
        &self.text[self.perspective_len..]
    }

    /// The length of the perspective's name and the event type together.
    pub(super) fn text_len(&self) -> usize {
        self.text.len()
    }
}

impl Ended {
    /// The span's attributes, in the order the SDK would hold them; `uuid` is room for the
    /// stream id's text.
    pub(super) fn attributes<'a>(
        &'a self,
        uuid: &'a mut [u8; uuid::fmt::Hyphenated::LENGTH],
    ) -> [(&'static str, Attr<'a>); 6] {
        let r = &self.record;
        [
            ("vantage.perspective", Attr::Str(r.perspective())),
            (
                "vantage.stream_id",
                Attr::Str(r.stream_id.hyphenated().encode_lower(uuid)),
            ),
            ("vantage.global_position", Attr::I64(r.global_position)),
            ("vantage.event_type", Attr::Str(r.event_type())),
            ("vantage.attempts", Attr::I64(r.attempts)),
            ("vantage.outcome", Attr::Str(self.outcome)),
        ]
    }

    /// The SDK's span data of this span, as its tracer would have made it.
    pub(super) fn span_data(&self, scope: &InstrumentationScope) -> SpanData {
        let r = &self.record;
        let mut uuid = [0u8; uuid::fmt::Hyphenated::LENGTH];
        let attributes = self
            .attributes(&mut uuid)
            .into_iter()
            .map(|(key, value)| match value {
                Attr::Str(s) => KeyValue::new(key, s.to_owned()),
                Attr::I64(i) => KeyValue::new(key, i),
            })
            .collect();
        let mut links = SpanLinks::default();
        links.links = r
            .links
            .iter()
            .flatten()
            .map(|cx| Link::with_context(cx.clone()))
            .collect();
        SpanData {
            span_context: r.context.clone(),
            parent_span_id: r.parent,
            parent_span_is_remote: r.parent_is_remote,
            span_kind: SpanKind::Consumer,
            name: Cow::Owned(format!("{NAME_PREFIX}{}", r.perspective())),
            start_time: r.start,
            end_time: self.end,
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links,
            status: self.status.clone(),
            instrumentation_scope: scope.clone(),
        }
    }
}

/// Where the apply spans of one tracer provider go, and which are kept.
pub(crate) struct Applies {
    sampler: Keep,
    to: Sink,
    ids: RandomIdGenerator,
}

pub(super) enum Sink {
    /// Encoded into the next OTLP request (`http/protobuf`).
    Encoded(Arc<otlp::Queue>),
    /// Made into span data for the provider's own processor (any other exporter).
    Processor {
        processor: Arc<dyn SpanProcessor>,
        scope: InstrumentationScope,
    },
}

impl Applies {
    pub(super) fn new(choice: &SamplerChoice, to: Sink) -> Applies {
        Applies {
            sampler: Keep::new(choice),
            to,
            ids: RandomIdGenerator::default(),
        }
    }

    /// Starts the apply span of `event`: a child of `parent` (the producer's span, remote), or,
    /// when `parent` is `None`, the root of a trace of its own; linked to `links`. `None` when
    /// the sampler drops it.
    pub(crate) fn start(
        &self,
        event: &ApplyEvent<'_>,
        parent: Option<&SpanContext>,
        links: [Option<SpanContext>; 2],
    ) -> Option<ApplyRecord> {
        let trace_id = parent.map_or_else(|| self.ids.new_trace_id(), SpanContext::trace_id);
        if !self.sampler.keeps(parent, trace_id) {
            return None;
        }
        let start = opentelemetry::time::now();
        // As the SDK's tracer: the parent's trace state, the sampled flag set.
        let state = parent.map_or(TraceState::NONE, |p| p.trace_state().clone());
        let context = SpanContext::new(
            trace_id,
            self.ids.new_span_id(),
            TraceFlags::SAMPLED,
            false,
            state,
        );
        let mut text = String::with_capacity(event.perspective.len() + event.event_type.len());
        text.push_str(event.perspective);
        text.push_str(event.event_type);
        Some(ApplyRecord {
            context,
            parent: parent.map_or(SpanId::INVALID, SpanContext::span_id),
            parent_is_remote: parent.is_some_and(SpanContext::is_remote),
            links,
            start,
            text,
            perspective_len: event.perspective.len(),
            stream_id: event.stream_id,
            global_position: event.global_position,
            attempts: i64::from(event.attempts),
        })
    }

    /// Ends `record` with `outcome` and `status`, and hands it on for export.
    pub(crate) fn end(&self, record: ApplyRecord, outcome: &'static str, status: Status) {
        let ended = Ended {
            record,
            end: opentelemetry::time::now(),
            outcome,
            status,
        };
        match &self.to {
            Sink::Encoded(queue) => queue.push_apply(&ended),
            Sink::Processor { processor, scope } => processor.on_end(ended.span_data(scope)),
        }
    }
}

/// The provider's sampling decision for an apply span, without a `Context` to ask it with:
/// parent-based as the SDK's `Sampler::ParentBased` (a span with a parent follows the parent's
/// sampled flag), anything else asked of the SDK's sampler itself. (An apply span is never a
/// claim, so [`super::QuietIdle`] has nothing to add.)
pub(super) struct Keep {
    parent_based: bool,
    root: Sampler,
}

impl Keep {
    pub(super) fn new(choice: &SamplerChoice) -> Keep {
        match choice {
            SamplerChoice::ParentBased(root) => Keep {
                parent_based: true,
                root: root.sampler(),
            },
            other => Keep {
                parent_based: false,
                root: other.sampler(),
            },
        }
    }

    pub(super) fn keeps(&self, parent: Option<&SpanContext>, trace_id: TraceId) -> bool {
        match parent {
            Some(p) if self.parent_based => p.is_sampled(),
            _ => {
                let decision = self
                    .root
                    .should_sample(None, trace_id, "", &SpanKind::Consumer, &[], &[])
                    .decision;
                decision == SamplingDecision::RecordAndSample
            }
        }
    }
}
