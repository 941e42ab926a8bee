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

use super::encode_request;

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
