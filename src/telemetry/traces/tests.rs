use std::collections::HashMap;

use opentelemetry::trace::{TraceContextExt, TraceFlags};

use super::*;

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |name| map.get(name).cloned()
}

fn file(endpoint: Option<&str>) -> TelemetrySettings {
    TelemetrySettings {
        otlp_endpoint: endpoint.map(str::to_owned),
        ..TelemetrySettings::default()
    }
}

#[test]
fn traces_are_off_unless_an_endpoint_is_set() {
    assert_eq!(resolve(&file(None), env(&[])).unwrap(), None);
    // Set but empty is unset, as the specification says.
    assert_eq!(
        resolve(&file(None), env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")])).unwrap(),
        None
    );
}

#[test]
fn the_standard_endpoint_alone_turns_traces_on_with_the_defaults() {
    let t = resolve(
        &file(None),
        env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")]),
    )
    .unwrap()
    .expect("on");
    assert_eq!(t.endpoint, "http://collector:4318/v1/traces");
    assert_eq!(t.protocol, OtlpProtocol::HttpProtobuf);
    assert_eq!(
        t.sampler,
        SamplerChoice::ParentBased(Box::new(SamplerChoice::AlwaysOn))
    );
    assert_eq!(t.service_name, "vantage");
}

#[test]
fn the_environment_wins_over_the_file() {
    let settings = TelemetrySettings {
        otlp_endpoint: Some("http://file:4318".to_owned()),
        protocol: OtlpProtocol::HttpProtobuf,
        sampling: Percent::parse("10%").unwrap(),
        service_name: "from-file".to_owned(),
    };
    let from_file = resolve(&settings, env(&[])).unwrap().unwrap();
    assert_eq!(from_file.endpoint, "http://file:4318/v1/traces");
    assert_eq!(
        from_file.sampler,
        SamplerChoice::ParentBased(Box::new(SamplerChoice::Ratio(0.1)))
    );
    assert_eq!(from_file.service_name, "from-file");
    let t = resolve(
        &settings,
        env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://base:4318"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "https://traces.example/x",
            ),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            ("OTEL_TRACES_SAMPLER", "traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
            ("OTEL_SERVICE_NAME", "orders-read-side"),
        ]),
    )
    .unwrap()
    .unwrap();
    // The per-signal endpoint is used as it is.
    assert_eq!(t.endpoint, "https://traces.example/x");
    assert_eq!(t.protocol, OtlpProtocol::HttpJson);
    assert_eq!(t.sampler, SamplerChoice::Ratio(0.25));
    assert_eq!(t.service_name, "orders-read-side");
    let off = resolve(&settings, env(&[("OTEL_SDK_DISABLED", "true")])).unwrap();
    assert_eq!(off, None);
    let none = resolve(&settings, env(&[("OTEL_TRACES_EXPORTER", "none")])).unwrap();
    assert_eq!(none, None);
}

#[test]
fn bad_values_name_their_variable_and_what_would_do() {
    let on = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318")];
    let cases: &[(&[(&str, &str)], &str)] = &[
        (
            &[("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")],
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ),
        (
            &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://user:pw@c:4318")],
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ),
        (
            &[on[0], ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")],
            "gRPC is not built in",
        ),
        (
            &[on[0], ("OTEL_TRACES_SAMPLER", "sometimes")],
            "OTEL_TRACES_SAMPLER",
        ),
        (
            &[
                on[0],
                ("OTEL_TRACES_SAMPLER", "traceidratio"),
                ("OTEL_TRACES_SAMPLER_ARG", "2"),
            ],
            "OTEL_TRACES_SAMPLER_ARG",
        ),
        (
            &[on[0], ("OTEL_TRACES_EXPORTER", "zipkin")],
            "OTEL_TRACES_EXPORTER",
        ),
    ];
    for (vars, needle) in cases {
        let e = resolve(&file(None), env(vars)).unwrap_err().to_string();
        assert!(e.contains(needle), "{vars:?}: {e}");
        assert!(!e.contains("pw@"), "{e}");
    }
}

fn sampled(sampler: &QuietIdle, name: &str, attributes: &[KeyValue]) -> bool {
    let result = sampler.should_sample(
        None,
        TraceId::from_bytes(7u128.to_be_bytes()),
        name,
        &SpanKind::Internal,
        attributes,
        &[],
    );
    result.decision == SamplingDecision::RecordAndSample
}

#[test]
fn an_empty_claim_is_never_kept_and_everything_else_follows_the_sampler() {
    let on = QuietIdle::new(&SamplerChoice::ParentBased(Box::new(
        SamplerChoice::AlwaysOn,
    )));
    assert!(!sampled(&on, CLAIM_SPAN, &[KeyValue::new(CLAIMED, 0i64)]));
    assert!(sampled(&on, CLAIM_SPAN, &[KeyValue::new(CLAIMED, 3i64)]));
    assert!(sampled(
        &on,
        "vantage.batch",
        &[KeyValue::new(CLAIMED, 0i64)]
    ));
    let off = QuietIdle::new(&SamplerChoice::AlwaysOff);
    assert!(!sampled(&off, CLAIM_SPAN, &[KeyValue::new(CLAIMED, 3i64)]));
}

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[test]
fn a_traceparent_in_metadata_is_the_parent_and_garbage_is_ignored() {
    let cx =
        parent_of(&serde_json::json!({ "traceparent": PARENT, "tenant": "a" })).expect("valid");
    let sc = cx.span().span_context().clone();
    assert_eq!(
        format!("{:032x}", sc.trace_id()),
        "4bf92f3577b34da6a3ce929d0e0e4736"
    );
    assert_eq!(format!("{:016x}", sc.span_id()), "00f067aa0ba902b7");
    assert!(sc.is_remote());
    assert_eq!(sc.trace_flags(), TraceFlags::SAMPLED);
    for bad in [
        serde_json::json!({}),
        serde_json::json!(null),
        serde_json::json!("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        serde_json::json!({ "traceparent": 42 }),
        serde_json::json!({ "traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01" }),
        serde_json::json!({ "traceparent": "not a traceparent" }),
        serde_json::json!({ "traceparent": format!("{PARENT}{}", "-x".repeat(400)) }),
    ] {
        assert!(parent_of(&bad).is_none(), "{bad}");
    }
}

#[test]
fn inject_writes_what_parent_of_reads() {
    let cx = parent_of(&serde_json::json!({ "traceparent": PARENT })).unwrap();
    let mut metadata = serde_json::Map::new();
    inject(&cx, &mut metadata);
    assert_eq!(metadata["traceparent"], PARENT);
    let mut untouched = serde_json::Map::new();
    inject(&Context::new(), &mut untouched);
    assert!(untouched.is_empty());
    assert_eq!(parse_traceparent(&format!(" {PARENT} ")).unwrap(), PARENT);
    assert!(parse_traceparent("00-xyz")
        .unwrap_err()
        .contains("W3C traceparent"));
}

/// The hand-read `traceparent` against the SDK's propagator: the same context for every valid
/// header (flags, tracestate and remoteness included), and none for what W3C calls invalid.
#[test]
fn parent_of_reads_a_traceparent_exactly_as_the_sdk_propagator_does() {
    let sdk = |metadata: &serde_json::Value| {
        let map = metadata.as_object().unwrap();
        let cx = TraceContextPropagator::new().extract(&MetadataCarrier(map));
        let sc = cx.span().span_context().clone();
        sc.is_valid().then_some(sc)
    };
    let ours = |metadata: &serde_json::Value| {
        parent_of(metadata).map(|cx| cx.span().span_context().clone())
    };
    let mut valid = Vec::new();
    for flags in ["00", "01", "02", "03", "ff", "80"] {
        for trace in [
            "4bf92f3577b34da6a3ce929d0e0e4736",
            "00000000000000000000000000000001",
        ] {
            for span in ["00f067aa0ba902b7", "ffffffffffffffff", "0000000000000001"] {
                valid.push(format!("00-{trace}-{span}-{flags}"));
            }
        }
    }
    valid.push(format!(" {PARENT}\t"));
    valid.push(format!("01{}", &PARENT[2..]));
    valid.push(format!("cc{}-what-comes-later", &PARENT[2..]));
    for header in &valid {
        for state in [
            None,
            Some("vendor=value,other=x"),
            Some("not a = valid state"),
        ] {
            let mut metadata = serde_json::json!({ "traceparent": header });
            if let Some(state) = state {
                metadata["tracestate"] = state.into();
            }
            let theirs = sdk(&metadata);
            assert!(theirs.is_some(), "the SDK reads {metadata}");
            assert_eq!(ours(&metadata), theirs, "{metadata}");
            assert_eq!(
                ours(&metadata).unwrap().trace_state().header(),
                theirs.unwrap().trace_state().header()
            );
        }
    }
    for bad in [
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01".to_owned(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01".to_owned(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0A".to_owned(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01".to_owned(),
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01".to_owned(),
        format!("{PARENT}-more"),
        format!("{PARENT}x"),
        PARENT[..54].to_owned(),
        "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01".to_owned(),
        "00-4bf92f3577b34da6a3ce929d0e0e47g6-00f067aa0ba902b7-01".to_owned(),
        "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
        "".to_owned(),
    ] {
        // (The SDK accepts some of these, shorter fields for one; W3C does not.)
        let metadata = serde_json::json!({ "traceparent": bad });
        assert_eq!(ours(&metadata), None, "{metadata}");
    }
}

/// The apply spans' own sampling decision is the provider's sampler's, for every choice, with
/// a sampled, an unsampled or no parent, over trace ids across the ratio's range.
#[test]
fn the_apply_spans_keep_exactly_what_the_providers_sampler_keeps() {
    let choices = [
        SamplerChoice::AlwaysOn,
        SamplerChoice::AlwaysOff,
        SamplerChoice::Ratio(0.25),
        SamplerChoice::Ratio(0.0),
        SamplerChoice::ParentBased(Box::new(SamplerChoice::AlwaysOn)),
        SamplerChoice::ParentBased(Box::new(SamplerChoice::AlwaysOff)),
        SamplerChoice::ParentBased(Box::new(SamplerChoice::Ratio(0.5))),
    ];
    let mut kept = [0usize; 2];
    for choice in &choices {
        let keep = apply::Keep::new(choice);
        let sdk = QuietIdle::new(choice);
        for i in 0..200u128 {
            let trace_id = TraceId::from_bytes(
                (i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835)).to_be_bytes(),
            );
            for flags in [None, Some(TraceFlags::SAMPLED), Some(TraceFlags::default())] {
                let parent = flags.map(|f| {
                    SpanContext::new(
                        trace_id,
                        SpanId::from_bytes(7u64.to_be_bytes()),
                        f,
                        true,
                        TraceState::NONE,
                    )
                });
                let cx = parent
                    .clone()
                    .map_or_else(Context::new, |p| Context::new().with_remote_span_context(p));
                let theirs = sdk
                    .should_sample(
                        Some(&cx),
                        trace_id,
                        "apply x",
                        &SpanKind::Consumer,
                        &[],
                        &[],
                    )
                    .decision
                    == SamplingDecision::RecordAndSample;
                let ours = keep.keeps(parent.as_ref(), trace_id);
                assert_eq!(ours, theirs, "{choice:?} {flags:?} {trace_id}");
                kept[usize::from(ours)] += 1;
            }
        }
    }
    assert!(
        kept[0] > 0 && kept[1] > 0,
        "both decisions were tried: {kept:?}"
    );
}
