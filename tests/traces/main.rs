//! Traces from append to apply, against a real PostgreSQL, with the SDK's in-memory exporter
//! (docs/operations.md, "Traces"): the span tree the pipeline exports.
//!
//! The subscriber is this test's own (`set_default` on a current-thread runtime, so every task
//! of the test runs under it), never the global one. A binary of its own: in a process where
//! other tests install subscribers while this one runs, `tracing` rebuilds every callsite's
//! interest, and a span created during a rebuild can come out disabled (a claim missing under
//! its batch), which is the test harness's race, not the daemon's (a daemon sets its one
//! subscriber once, at start).

#[path = "../support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use opentelemetry::trace::{SpanId, Status, TraceId};
use opentelemetry::Value;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SpanData};
use tracing_subscriber::layer::SubscriberExt;
use uuid::Uuid;
use vantage::config::WorkerSettings;
use vantage::internals::perspective::PerspectiveRegistry;
use vantage::internals::pipeline::{DrainOutcome, Pipeline};
use vantage::internals::store::{InstanceInfo, StoreInternals as _};
use vantage::perspective::{ApplyError, ApplyTx, EventEnvelope, Perspective};
use vantage::store::{InstanceId, NewEvent};
use vantage::telemetry::traces::{self, SamplerChoice};

use crate::support::Env;

/// A perspective that fails the events its script names, on their first `attempts` claims
/// (every pass of those claims: the optimistic one and the careful one).
struct Scripted {
    name: &'static str,
    script: Mutex<HashMap<i64, (ApplyError, i32)>>,
}

impl Scripted {
    fn new(name: &'static str) -> Arc<Scripted> {
        Arc::new(Scripted {
            name,
            script: Mutex::new(HashMap::new()),
        })
    }

    fn fail(&self, position: i64, error: ApplyError, attempts: i32) {
        self.script
            .lock()
            .unwrap()
            .insert(position, (error, attempts));
    }
}

#[async_trait]
impl Perspective for Scripted {
    fn name(&self) -> &str {
        self.name
    }

    fn event_types(&self) -> Vec<String> {
        vec!["*".into()]
    }

    async fn apply(&self, e: &EventEnvelope, _tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        if let Some((error, attempts)) = self.script.lock().unwrap().get(&e.global_position) {
            if e.attempts <= *attempts {
                return Err(error.clone());
            }
        }
        Ok(())
    }
}

const TRACE_1: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SPAN_1: &str = "00f067aa0ba902b7";
const TRACE_2: &str = "0af7651916cd43dd8448eb211c80319c";
const SPAN_2: &str = "b7ad6b7169203331";

fn traced(event_type: &str, trace: &str, span: &str) -> NewEvent {
    let mut e = NewEvent::new(event_type, serde_json::json!({}));
    e.metadata = Some(serde_json::json!({ "traceparent": format!("00-{trace}-{span}-01") }));
    e
}

fn attr<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

fn int(span: &SpanData, key: &str) -> i64 {
    match attr(span, key) {
        Some(Value::I64(n)) => *n,
        other => panic!("{key} of {} is {other:?}", span.name),
    }
}

fn text(span: &SpanData, key: &str) -> String {
    match attr(span, key) {
        Some(v) => v.as_str().into_owned(),
        None => panic!("{} has no {key}: {:?}", span.name, span.attributes),
    }
}

fn trace_id(hex: &str) -> TraceId {
    TraceId::from_hex(hex).unwrap()
}

fn span_id(hex: &str) -> SpanId {
    SpanId::from_hex(hex).unwrap()
}

#[tokio::test]
async fn the_apply_of_a_traced_event_is_a_child_of_the_producers_span_then_a_linked_retry() {
    let exporter = InMemorySpanExporter::default();
    let provider = traces::provider_with(
        exporter.clone(),
        &SamplerChoice::ParentBased(Box::new(SamplerChoice::AlwaysOn)),
    );
    let subscriber = tracing_subscriber::registry().with(traces::layer(&provider));
    let _guard = tracing::subscriber::set_default(subscriber);

    let db = Env::migrated().await;
    let ledger = Scripted::new("ledger");
    let audit = Scripted::new("audit");
    for p in [&ledger, &audit] {
        db.store
            .register_perspective(p.name, &p.event_types())
            .await
            .unwrap();
    }
    let instance = InstanceId::new();
    db.store
        .heartbeat(instance, &InstanceInfo::current("traces"))
        .await
        .unwrap();
    let mut registry = PerspectiveRegistry::new();
    registry.add(ledger.clone()).unwrap();
    registry.add(audit.clone()).unwrap();
    let worker = WorkerSettings {
        retry_backoff_base: Duration::from_millis(20),
        retry_backoff_max: Duration::from_millis(20),
        ..WorkerSettings::default()
    };
    let pipeline = Pipeline::new(db.store.clone(), instance, registry, None, &worker);

    // An idle claim first: it exports nothing.
    assert_eq!(pipeline.drain_once().await.unwrap().claimed, 0);

    let stream = Uuid::new_v4();
    let poison = Uuid::new_v4();
    let appended = db
        .store
        .append_events(
            stream,
            None,
            &[
                traced("OrderPlaced", TRACE_1, SPAN_1),
                traced("OrderPaid", TRACE_2, SPAN_2),
                NewEvent::new("OrderShipped", serde_json::json!({})),
            ],
        )
        .await
        .unwrap();
    let bad = db
        .store
        .append_events(
            poison,
            None,
            &[NewEvent::new("Garbage", serde_json::json!({}))],
        )
        .await
        .unwrap();
    let paid = appended[1].global_position;
    ledger.fail(paid, ApplyError::Retryable("ledger is locked".into()), 1);
    ledger.fail(
        bad[0].global_position,
        ApplyError::Permanent("cannot parse \u{1b}[2J".into()),
        1,
    );

    // Drain until every row is settled (the retry waits out its 20 ms backoff).
    let mut total = DrainOutcome::default();
    for _ in 0..500 {
        let o = pipeline.drain_once().await.unwrap();
        total.batch.applied += o.batch.applied;
        total.batch.failed += o.batch.failed;
        total.batch.dead_lettered += o.batch.dead_lettered;
        if total.batch.applied == 7 && total.batch.dead_lettered == 1
            || o.claimed == 0 && total.batch.applied > 7
        {
            break;
        }
        if o.claimed == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    assert_eq!(
        (
            total.batch.applied,
            total.batch.failed,
            total.batch.dead_lettered
        ),
        (7, 1, 1),
        "3 events in 2 perspectives + 1 in audit, one retry, one dead letter"
    );
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let named = |name: &'static str| spans.iter().filter(move |s| s.name == name);

    // No claim span without rows; each batch is a child of a claim that found rows.
    assert!(named("vantage.claim").all(|c| int(c, "vantage.claimed") > 0));
    let claims: HashMap<SpanId, &SpanData> = named("vantage.claim")
        .map(|c| (c.span_context.span_id(), c))
        .collect();
    let batches: HashMap<SpanId, &SpanData> = named("vantage.batch")
        .map(|b| (b.span_context.span_id(), b))
        .collect();
    assert!(!batches.is_empty());
    for b in batches.values() {
        let claim = claims
            .get(&b.parent_span_id)
            .expect("a batch's parent is its claim");
        assert_eq!(b.span_context.trace_id(), claim.span_context.trace_id());
        assert_eq!(int(b, "vantage.claimed"), int(claim, "vantage.claimed"));
    }

    let applies: Vec<&SpanData> = named("apply ledger").chain(named("apply audit")).collect();
    let of = |position: i64, perspective: &str| -> Vec<&SpanData> {
        applies
            .iter()
            .copied()
            .filter(|s| {
                int(s, "vantage.global_position") == position
                    && text(s, "vantage.perspective") == perspective
            })
            .collect()
    };
    // Every apply span is linked to a batch that was exported.
    for s in &applies {
        assert!(
            s.links
                .iter()
                .any(|l| batches.contains_key(&l.span_context.span_id())),
            "{} is linked to its batch",
            s.name
        );
    }

    // The first event, in each perspective: one apply, a child of the producer's span (and,
    // when another lane of its batch failed, the optimistic pass that was rolled back for it,
    // in the same place).
    let placed = appended[0].global_position;
    for perspective in ["ledger", "audit"] {
        let spans = of(placed, perspective);
        assert!(spans.iter().all(|s| s.parent_span_id == span_id(SPAN_1)));
        let (applied, rest): (Vec<&SpanData>, Vec<&SpanData>) = spans
            .iter()
            .partition(|s| text(s, "vantage.outcome") == "applied");
        assert!(rest
            .iter()
            .all(|s| text(s, "vantage.outcome") == "rolled_back"));
        assert_eq!(applied.len(), 1, "{perspective}: {spans:?}");
        let s = applied[0];
        assert_eq!(s.span_context.trace_id(), trace_id(TRACE_1));
        assert_eq!(s.parent_span_id, span_id(SPAN_1));
        assert_eq!(text(s, "vantage.outcome"), "applied");
        assert_eq!(text(s, "vantage.stream_id"), stream.to_string());
        assert_eq!(int(s, "vantage.attempts"), 1);
        assert_eq!(s.status, Status::Ok);
        assert_eq!(s.span_kind, opentelemetry::trace::SpanKind::Consumer);
    }

    // The second event in the ledger: the first attempt (rolled back optimistically, then
    // failed) in the producer's trace; the retry in a trace of its own, linked to the producer.
    let paid_spans = of(paid, "ledger");
    let (first, retry): (Vec<&SpanData>, Vec<&SpanData>) = paid_spans
        .iter()
        .partition(|s| s.span_context.trace_id() == trace_id(TRACE_2));
    assert!(first.iter().all(|s| s.parent_span_id == span_id(SPAN_2)));
    let outcomes: Vec<String> = first.iter().map(|s| text(s, "vantage.outcome")).collect();
    assert!(outcomes.contains(&"failed".to_owned()), "{outcomes:?}");
    let failed = first
        .iter()
        .find(|s| text(s, "vantage.outcome") == "failed")
        .unwrap();
    assert!(
        matches!(&failed.status, Status::Error { description } if description.contains("ledger is locked"))
    );
    assert_eq!(retry.len(), 1, "{paid_spans:?}");
    let retry = retry[0];
    assert_eq!(text(retry, "vantage.outcome"), "applied");
    assert_eq!(retry.parent_span_id, SpanId::INVALID, "a root of its own");
    assert_eq!(int(retry, "vantage.attempts"), 2);
    assert!(retry
        .links
        .iter()
        .any(|l| l.span_context.trace_id() == trace_id(TRACE_2)
            && l.span_context.span_id() == span_id(SPAN_2)));
    // In the audit perspective the same event applied once, in the producer's trace.
    let audit_paid = of(paid, "audit");
    assert!(audit_paid
        .iter()
        .all(|s| s.parent_span_id == span_id(SPAN_2)));
    assert_eq!(
        audit_paid
            .iter()
            .filter(|s| text(s, "vantage.outcome") == "applied")
            .count(),
        1
    );

    // An event without a traceparent has no apply span.
    assert!(of(appended[2].global_position, "ledger").is_empty());

    // The dead-letter move: a span under a batch, with what an operator needs.
    let moves: Vec<&SpanData> = named("vantage.dead_letter").collect();
    assert_eq!(moves.len(), 1);
    let mv = moves[0];
    assert!(batches.contains_key(&mv.parent_span_id));
    assert_eq!(text(mv, "vantage.perspective"), "ledger");
    assert_eq!(int(mv, "vantage.global_position"), bad[0].global_position);
    assert_eq!(text(mv, "vantage.stream_id"), poison.to_string());
    assert_eq!(text(mv, "vantage.reason"), "PermanentFailure");
    assert_eq!(int(mv, "vantage.attempts"), 1);
}
