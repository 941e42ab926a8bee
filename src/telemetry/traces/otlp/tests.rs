//! The hand-written encoding against the reference one (opentelemetry-proto's transform and
//! prost's encoder), for spans made by the SDK itself: equal once decoded, field for field.

use opentelemetry::trace::{
    Link, Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Array, Context, KeyValue, StringValue, Value};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use opentelemetry_sdk::Resource;
use prost::Message as _;

use super::super::apply::Ended;
use super::{encode_applies, encode_request};

fn resource() -> Resource {
    Resource::builder_empty()
        .with_service_name("vantage-test")
        .with_attribute(KeyValue::new("service.version", "1.2.3"))
        .with_attribute(KeyValue::new("host.cores", 2))
        .build()
}

/// Spans made by the SDK: every kind of field vantage (or a layer) can set.
fn spans() -> Vec<SpanData> {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .with_resource(resource())
        .build();
    let tracer = provider.tracer("vantage");
    let remote = SpanContext::new(
        TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
        SpanId::from_hex("00f067aa0ba902b7").unwrap(),
        TraceFlags::SAMPLED,
        true,
        TraceState::from_key_value([("vendor", "value"), ("other", "x")]).unwrap(),
    );
    let producer = Context::new().with_remote_span_context(remote.clone());
    // A child of a remote parent, every attribute type, a long value (a length of two bytes),
    // an event, an error status.
    let mut child = tracer
        .span_builder("apply order_summary")
        .with_kind(SpanKind::Consumer)
        .with_attributes([
            KeyValue::new("vantage.perspective", "order_summary"),
            KeyValue::new("vantage.global_position", 42_i64),
            KeyValue::new("vantage.negative", -7_i64),
            KeyValue::new("vantage.zero", 0_i64),
            KeyValue::new("vantage.empty", ""),
            KeyValue::new("vantage.flag", true),
            KeyValue::new("vantage.false", false),
            KeyValue::new("vantage.ratio", 0.25_f64),
            KeyValue::new("vantage.long", "é".repeat(300)),
            KeyValue::new(
                "vantage.strings",
                Value::Array(Array::String(vec![StringValue::from("a"), "".into()])),
            ),
            KeyValue::new("vantage.ints", Value::Array(Array::I64(vec![1, -2, 0]))),
            KeyValue::new(
                "vantage.bools",
                Value::Array(Array::Bool(vec![true, false])),
            ),
            KeyValue::new("vantage.floats", Value::Array(Array::F64(vec![1.5, 0.0]))),
        ])
        .start_with_context(&tracer, &producer);
    child.add_event("retrying", vec![KeyValue::new("attempt", 2_i64)]);
    child.set_status(Status::error("relation \"x\" does not exist"));
    child.end();
    // A root span linked to the remote one and to a local one, with an OK status.
    let local = tracer.start("vantage.batch");
    let local_cx = local.span_context().clone();
    drop(local);
    let mut linked = tracer
        .span_builder("apply order_summary")
        .with_kind(SpanKind::Consumer)
        .with_links(vec![
            Link::with_context(remote),
            Link::new(local_cx, vec![KeyValue::new("why", "batch")], 0),
        ])
        .start(&tracer);
    linked.set_status(Status::Ok);
    linked.end();
    // Another scope, and every span kind.
    let other = provider.tracer("elsewhere");
    for kind in [
        SpanKind::Internal,
        SpanKind::Server,
        SpanKind::Client,
        SpanKind::Producer,
    ] {
        other.span_builder("k").with_kind(kind).start(&other).end();
    }
    exporter.get_finished_spans().unwrap()
}

/// Ours, decoded, with the scope groups in the reference's order (it groups with a map).
fn decoded(batch: &[SpanData], resource: &Resource) -> ExportTraceServiceRequest {
    let mut body = Vec::new();
    encode_request(batch, resource, &mut body);
    ExportTraceServiceRequest::decode(body.as_slice()).expect("our body decodes as OTLP")
}

fn reference(batch: &[SpanData], resource: &Resource) -> ExportTraceServiceRequest {
    ExportTraceServiceRequest {
        resource_spans: group_spans_by_resource_and_scope(
            batch.to_vec(),
            &ResourceAttributesWithSchema::from(resource),
        ),
    }
}

fn by_scope(mut request: ExportTraceServiceRequest) -> ExportTraceServiceRequest {
    for rs in &mut request.resource_spans {
        rs.scope_spans
            .sort_by_key(|s| s.scope.as_ref().map(|s| s.name.clone()));
        if let Some(r) = rs.resource.as_mut() {
            r.attributes.sort_by(|a, b| a.key.cmp(&b.key));
        }
    }
    request
}

#[test]
fn the_encoding_equals_the_reference_one_field_for_field() {
    let batch = spans();
    assert_eq!(batch.len(), 7, "the spans were made");
    let resource = resource();
    let ours = by_scope(decoded(&batch, &resource));
    let theirs = by_scope(reference(&batch, &resource));
    assert_eq!(ours.resource_spans.len(), 1);
    assert_eq!(ours.resource_spans[0].scope_spans.len(), 2);
    assert_eq!(ours, theirs);
    // And the bytes are the same length: nothing is sent that decoding would drop.
    let mut body = Vec::new();
    encode_request(&batch, &resource, &mut body);
    assert_eq!(body.len(), reference(&batch, &resource).encoded_len());
}

#[test]
fn an_empty_batch_is_an_empty_request() {
    let mut body = Vec::new();
    encode_request(&[], &resource(), &mut body);
    assert!(body.is_empty());
}

#[test]
fn headers_are_key_value_pairs_percent_decoded_and_a_bad_one_is_refused() {
    let map = super::parse_headers("x-honeycomb-team=abc%3D%3D, api-key = k%20v ,").unwrap();
    assert_eq!(map.get("x-honeycomb-team").unwrap(), "abc==");
    assert_eq!(map.get("api-key").unwrap(), "k v");
    assert!(super::parse_headers("").unwrap().is_empty());
    assert!(super::parse_headers("novalue").is_err());
    assert!(super::parse_headers("k=%zz").is_err());
    assert!(super::parse_headers("bad key=v").is_err());
}

/// The apply spans of every shape vantage records: a first attempt (a child of the producer's
/// remote span, with its trace state, linked to its batch), a retry (a root, linked to the
/// producer and the batch), one without a batch, and every outcome's status, with texts long
/// enough to need two bytes of length.
fn applies() -> Vec<Ended> {
    use super::super::apply::{Applies, ApplyEvent, Sink};
    use super::super::SamplerChoice;
    let applies = Applies::new(
        &SamplerChoice::ParentBased(Box::new(SamplerChoice::AlwaysOn)),
        Sink::Processor {
            processor: std::sync::Arc::new(opentelemetry_sdk::trace::SimpleSpanProcessor::new(
                InMemorySpanExporter::default(),
            )),
            scope: opentelemetry::InstrumentationScope::builder("vantage").build(),
        },
    );
    let producer = SpanContext::new(
        TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
        SpanId::from_hex("00f067aa0ba902b7").unwrap(),
        TraceFlags::SAMPLED,
        true,
        TraceState::from_key_value([("vendor", "value")]).unwrap(),
    );
    let batch = SpanContext::new(
        TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
        SpanId::from_hex("b7ad6b7169203331").unwrap(),
        TraceFlags::SAMPLED,
        false,
        TraceState::NONE,
    );
    let long = "é".repeat(80);
    let events = [
        ("order_summary", "OrderPlaced", 1),
        (long.as_str(), "OrderPaid", 2),
        ("ledger", long.as_str(), 7),
    ];
    let mut out = Vec::new();
    for (i, (perspective, event_type, attempts)) in events.into_iter().enumerate() {
        let event = ApplyEvent {
            perspective,
            event_type,
            stream_id: uuid::Uuid::from_u128(0x0123_4567_89ab_cdef_0123_4567_89ab_cdef + i as u128),
            global_position: [42, -1, i64::MAX][i],
            attempts,
        };
        let shapes = [
            applies.start(&event, Some(&producer), [None, Some(batch.clone())]),
            applies.start(&event, None, [Some(producer.clone()), Some(batch.clone())]),
            applies.start(&event, Some(&producer), [None, None]),
        ];
        for (record, (outcome, status)) in shapes.into_iter().zip([
            ("applied", Status::Ok),
            ("failed", Status::error("x".repeat(300))),
            ("rolled_back", Status::Unset),
        ]) {
            out.push(Ended {
                record: record.expect("sampled"),
                end: std::time::SystemTime::now(),
                outcome,
                status,
            });
        }
    }
    out
}

#[test]
fn an_apply_record_is_encoded_as_its_span_data_is() {
    let spans = applies();
    let scope = opentelemetry::InstrumentationScope::builder("vantage").build();
    let data: Vec<SpanData> = spans.iter().map(|s| s.span_data(&scope)).collect();
    // (One resource: the order its attributes are iterated in is its own.)
    let resource = resource();
    let mut ours = Vec::new();
    encode_applies(&spans, &resource, &scope, &mut ours);
    let mut theirs = Vec::new();
    encode_request(&data, &resource, &mut theirs);
    assert_eq!(ours, theirs);
    // And what both say is what the reference encoder makes of the span data.
    let decoded = ExportTraceServiceRequest::decode(ours.as_slice()).unwrap();
    assert_eq!(by_scope(decoded), by_scope(reference(&data, &resource)));
}

/// The span data of a record is what the SDK's tracer made of the same apply before vantage
/// recorded it itself (the ids and times aside, which are new each time).
#[test]
fn an_apply_records_span_data_is_what_the_sdk_would_make() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let tracer = provider.tracer("vantage");
    let scope = opentelemetry::InstrumentationScope::builder("vantage").build();
    for ended in applies() {
        let r = &ended.record;
        let first = r.parent != SpanId::INVALID;
        let producer = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
            SpanId::from_hex("00f067aa0ba902b7").unwrap(),
            TraceFlags::SAMPLED,
            true,
            TraceState::from_key_value([("vendor", "value")]).unwrap(),
        );
        let parent = if first {
            Context::new().with_remote_span_context(producer.clone())
        } else {
            Context::new()
        };
        let links = r
            .links
            .iter()
            .flatten()
            .map(|cx| Link::with_context(cx.clone()))
            .collect();
        let mut span = tracer
            .span_builder(format!("apply {}", r.perspective()))
            .with_kind(SpanKind::Consumer)
            .with_links(links)
            .with_attributes([
                KeyValue::new("vantage.perspective", r.perspective().to_owned()),
                KeyValue::new("vantage.stream_id", r.stream_id.to_string()),
                KeyValue::new("vantage.global_position", r.global_position),
                KeyValue::new("vantage.event_type", r.event_type().to_owned()),
                KeyValue::new("vantage.attempts", r.attempts),
            ])
            .start_with_context(&tracer, &parent);
        span.set_attribute(KeyValue::new("vantage.outcome", ended.outcome));
        if ended.status != Status::Unset {
            span.set_status(ended.status.clone());
        }
        span.end();
        let mut sdk = exporter.get_finished_spans().unwrap().pop().unwrap();
        exporter.reset();
        let ours = ended.span_data(&scope);
        sdk.span_context = SpanContext::new(
            ours.span_context.trace_id(),
            ours.span_context.span_id(),
            sdk.span_context.trace_flags(),
            sdk.span_context.is_remote(),
            sdk.span_context.trace_state().clone(),
        );
        if first {
            assert_eq!(sdk.span_context.trace_id(), producer.trace_id());
        }
        sdk.start_time = ours.start_time;
        sdk.end_time = ours.end_time;
        assert_eq!(ours, sdk);
    }
}
