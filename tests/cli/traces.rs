//! One event followed from `vantage append --traceparent` to its apply in a running daemon,
//! through an OTLP/HTTP export to a receiver in the test (docs/operations.md, "Traces"): the
//! standard `OTEL_*` variables alone turn traces on.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use nix::sys::signal::Signal;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use prost::Message;

use crate::support::fresh_database;
use crate::support::process::{self, Daemon};

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SPAN: &str = "00f067aa0ba902b7";

/// One span as received: its resource's `service.name`, and the span.
#[derive(Clone, Debug)]
struct Received {
    service: String,
    /// The request's `api-key` header (`OTEL_EXPORTER_OTLP_HEADERS`).
    api_key: Option<String>,
    span: opentelemetry_proto::tonic::trace::v1::Span,
}

type Inbox = Arc<Mutex<Vec<Received>>>;

/// An OTLP/HTTP receiver on a free port: every span posted to `/v1/traces`, decoded.
async fn receiver() -> (SocketAddr, Inbox) {
    async fn traces(
        State(inbox): State<Inbox>,
        headers: axum::http::HeaderMap,
        body: Bytes,
    ) -> Vec<u8> {
        let api_key = headers
            .get("api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf request");
        let mut inbox = inbox.lock().unwrap();
        for rs in request.resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| string(&r.attributes, "service.name"))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    inbox.push(Received {
                        service: service.clone(),
                        api_key: api_key.clone(),
                        span,
                    });
                }
            }
        }
        // An empty ExportTraceServiceResponse.
        Vec::new()
    }
    let inbox = Inbox::default();
    let app = axum::Router::new()
        .route("/v1/traces", post(traces))
        .with_state(Arc::clone(&inbox));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (addr, inbox)
}

fn string(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes.iter().find(|kv| kv.key == key).and_then(|kv| {
        match kv.value.as_ref()?.value.as_ref()? {
            any_value::Value::StringValue(s) => Some(s.clone()),
            any_value::Value::IntValue(n) => Some(n.to_string()),
            _ => None,
        }
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A running daemon exporting spans to `endpoint` (every 100 ms), with one versioned SQL
/// perspective `orders` (its work is that of `orders@v1`), its directory and configuration.
struct Traced {
    daemon: Daemon,
    dir: tempfile::TempDir,
    config: String,
    addr: SocketAddr,
    _db: crate::support::TestDatabase,
}

async fn traced_daemon(endpoint: &str) -> Traced {
    let db = fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("vantage.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[database]
url = "{url}"
[worker]
consumers = 1
[http]
listen = "127.0.0.1:0"

[[perspectives]]
name = "orders"
read_schema = "traces_rm"
tables = ["placed"]
setup = "CREATE TABLE placed (stream_id uuid PRIMARY KEY)"
events = ["OrderPlaced"]
[perspectives.sql]
OrderPlaced = "INSERT INTO placed (stream_id) VALUES ($2)"
"#,
            url = db.url
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap().to_owned();
    let mut daemon = Daemon::spawn(
        process::vantage(
            dir.path(),
            &["--config", &config, "run"],
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
                ("OTEL_SERVICE_NAME", "orders-read-side"),
                // Sent with every export, percent-decoded.
                ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=k%3Dv"),
                // Export every 100 ms instead of every 5 s.
                ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ],
        ),
        dir.path(),
        "vantage",
    );
    let addr = daemon
        .wait_running(Duration::from_secs(60))
        .await
        .expect("the daemon logs its HTTP address");
    Traced {
        daemon,
        dir,
        config,
        addr,
        _db: db,
    }
}

/// `vantage append --traceparent` of one `OrderPlaced` to a new stream, which it returns.
async fn append_traced(t: &Traced, traceparent: &str) -> uuid::Uuid {
    let events = t.dir.path().join("events.jsonl");
    let stream = uuid::Uuid::new_v4();
    std::fs::write(
        &events,
        format!("{{\"stream_id\":\"{stream}\",\"event_type\":\"OrderPlaced\",\"data\":{{}}}}\n"),
    )
    .unwrap();
    let appended = process::run(
        process::vantage(
            t.dir.path(),
            &[
                "--config",
                &t.config,
                "append",
                "--file",
                events.to_str().unwrap(),
                "--traceparent",
                traceparent,
            ],
            &[],
        ),
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(appended.code, Some(0), "{appended:?}");
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_appended_events_apply_is_exported_over_otlp_http_as_a_child_of_its_traceparent() {
    let (collector, inbox) = receiver().await;
    let mut t = traced_daemon(&format!("http://{collector}")).await;
    let stream = append_traced(&t, &format!("00-{TRACE}-{SPAN}-01")).await;

    // Wait for the apply span (the exporter sends every 100 ms). A perspective with a read
    // schema is versioned: its work (and span) is that of `orders@v1`.
    let deadline = Instant::now() + Duration::from_secs(60);
    let apply = loop {
        let found = inbox
            .lock()
            .unwrap()
            .iter()
            .find(|r| {
                r.span.name == "apply orders@v1"
                    && string(&r.span.attributes, "vantage.outcome").as_deref() == Some("applied")
            })
            .cloned();
        if let Some(found) = found {
            break found;
        }
        assert!(
            Instant::now() < deadline,
            "no applied span arrived; received: {:?}\ndaemon log:\n{}",
            inbox
                .lock()
                .unwrap()
                .iter()
                .map(|r| &r.span.name)
                .collect::<Vec<_>>(),
            t.daemon.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(apply.service, "orders-read-side");
    assert_eq!(apply.api_key.as_deref(), Some("k=v"));
    assert_eq!(hex(&apply.span.trace_id), TRACE);
    assert_eq!(hex(&apply.span.parent_span_id), SPAN);
    assert_eq!(
        string(&apply.span.attributes, "vantage.stream_id"),
        Some(stream.to_string())
    );
    assert_eq!(
        string(&apply.span.attributes, "vantage.attempts").as_deref(),
        Some("1")
    );
    // Its batch and claim came too, linked.
    let batch_id = apply
        .span
        .links
        .first()
        .map(|l| l.span_id.clone())
        .expect("a link to the batch");
    let all = inbox.lock().unwrap().clone();
    let batch = all
        .iter()
        .find(|r| r.span.span_id == batch_id)
        .expect("the batch span was exported");
    assert_eq!(batch.span.name, "vantage.batch");
    assert!(all
        .iter()
        .any(|r| r.span.name == "vantage.claim" && r.span.span_id == batch.span.parent_span_id));
    // Idle claims (every poll) were not exported.
    assert!(all
        .iter()
        .filter(|r| r.span.name == "vantage.claim")
        .all(|r| { string(&r.span.attributes, "vantage.claimed").as_deref() != Some("0") }));

    t.daemon.signal(Signal::SIGTERM);
    assert_eq!(t.daemon.wait(Duration::from_secs(60)).await, Some(0));
}

/// A collector that is down loses spans, never the drain: the event is applied, the failure is
/// counted and said once (not once per batch).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_is_counted_and_logged_and_the_drain_goes_on() {
    let closed = format!("http://127.0.0.1:{}", process::closed_port());
    let mut t = traced_daemon(&closed).await;
    for _ in 0..3 {
        append_traced(&t, &format!("00-{TRACE}-{SPAN}-01")).await;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, metrics) = process::http_get(t.addr, "/metrics").await.unwrap();
        assert_eq!(status, 200);
        let failed = process::metric_value(&metrics, "vantage_trace_spans_failed_total", &[]);
        let applied = process::metric_value(
            &metrics,
            "vantage_events_applied_total",
            &[("perspective", "orders@v1")],
        );
        if failed > 0.0 && applied >= 3.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "failed spans {failed}, applied {applied}; log:\n{}",
            t.daemon.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = t.daemon.log_text();
    let warnings = log
        .matches("could not export spans to the OTLP collector")
        .count();
    assert_eq!(warnings, 1, "{log}");
    t.daemon.signal(Signal::SIGTERM);
    assert_eq!(t.daemon.wait(Duration::from_secs(60)).await, Some(0));
}

#[tokio::test]
async fn otel_variables_that_cannot_be_used_stop_run_and_config_check_with_78_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "postgres://vantage:pw-s3cret@127.0.0.1:{}/db",
        process::closed_port()
    );
    let cases: &[(&[(&str, &str)], &str)] = &[
        (
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ],
            "OTEL_EXPORTER_OTLP_PROTOCOL = \"grpc\"",
        ),
        (
            &[("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")],
            "OTEL_EXPORTER_OTLP_ENDPOINT = \"collector:4318\"",
        ),
        (
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
                ("OTEL_TRACES_SAMPLER", "sometimes"),
            ],
            "OTEL_TRACES_SAMPLER = \"sometimes\"",
        ),
        (
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
                ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=s3cret-token,broken"),
            ],
            "OTEL_EXPORTER_OTLP_HEADERS = \"(not shown: it may hold a secret)\"",
        ),
        (
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"),
                ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "10s"),
            ],
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT = \"10s\"",
        ),
    ];
    for (env, want) in cases {
        for command in [&["config", "check"][..], &["run"][..]] {
            let mut args = vec!["--database-url", url.as_str()];
            args.extend_from_slice(command);
            let out = process::run(
                process::vantage(dir.path(), &args, env),
                Duration::from_secs(60),
            )
            .await;
            out.assert_no_panic();
            assert_eq!(out.code, Some(78), "{command:?} {env:?}: {out:?}");
            assert!(out.stderr.contains(want), "{command:?}: {}", out.stderr);
            assert!(!out.stderr.contains("pw-s3cret"), "{}", out.stderr);
            assert!(!out.stderr.contains("s3cret-token"), "{}", out.stderr);
        }
    }
    // Set and usable: config check says where spans go.
    let out = process::run(
        process::vantage(
            dir.path(),
            &["--database-url", &url, "config", "check"],
            &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")],
        ),
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(
        out.stdout.contains(
            "# traces: on, to http://collector:4318/v1/traces (http/protobuf), service vantage"
        ),
        "{}",
        out.stdout
    );
}

/// The README's promise: the demo with a trace endpoint shows each append with the applies of
/// its event under it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_with_an_endpoint_exports_each_append_with_its_applies_under_it() {
    let (collector, inbox) = receiver().await;
    let db = fresh_database().await;
    let url = db.url.clone();
    let endpoint = format!("http://{collector}");
    let run = tokio::task::spawn_blocking(move || {
        crate::demo::run_demo(|cmd| {
            cmd.args(["--orders", "30"])
                .env("DATABASE_URL", &url)
                .env("VANTAGE__HTTP__LISTEN", "127.0.0.1:0")
                .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
                .env("OTEL_BSP_SCHEDULE_DELAY", "100");
        })
    })
    .await
    .expect("the demo runner");
    assert_eq!(run.code, Some(0), "{run}");
    // The demo exits after flushing its spans: everything is in by now.
    let spans = inbox.lock().unwrap().clone();
    let appends: std::collections::HashMap<(Vec<u8>, Vec<u8>), &Received> = spans
        .iter()
        .filter(|r| r.span.name.starts_with("append "))
        .map(|r| ((r.span.trace_id.clone(), r.span.span_id.clone()), r))
        .collect();
    assert!(
        !appends.is_empty(),
        "no producer span among {} spans",
        spans.len()
    );
    let under_an_append = spans
        .iter()
        .filter(|r| r.span.name.starts_with("apply "))
        .filter(|r| appends.contains_key(&(r.span.trace_id.clone(), r.span.parent_span_id.clone())))
        .count();
    assert!(
        under_an_append >= appends.len(),
        "{under_an_append} applies under {} appends (every event reaches at least one perspective)",
        appends.len()
    );
    assert!(spans.iter().all(|r| r.service == "vantage"));
}
