//! The producer: another application appending the sample, [`PRODUCERS`] orders at a time,
//! each order's events one by one with the stream version its writer last saw.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures::StreamExt;
use tokio::task::JoinHandle;

use tracing::Instrument;

use super::sample::Order;
use crate::store::{NewEvent, Store, StoreError};

/// Concurrent producers appending the sample (and the producer's connections).
pub(super) const PRODUCERS: usize = 8;

#[derive(Default)]
pub(super) struct Counters {
    /// Events appended so far.
    pub(super) events: AtomicU64,
    /// Work rows they fanned out to.
    pub(super) work: AtomicU64,
}

/// What the producer appended.
#[derive(Debug)]
pub(super) struct Produced {
    pub(super) first_position: i64,
    pub(super) last_position: i64,
    pub(super) poison_positions: Vec<i64>,
}

impl Produced {
    fn new() -> Self {
        Produced {
            first_position: i64::MAX,
            last_position: i64::MIN,
            poison_positions: Vec::new(),
        }
    }

    fn merge(&mut self, other: Produced) {
        self.first_position = self.first_position.min(other.first_position);
        self.last_position = self.last_position.max(other.last_position);
        self.poison_positions.extend(other.poison_positions);
    }
}

/// Appends every order, [`PRODUCERS`] at a time.
pub(super) async fn append_sample(
    store: Store,
    orders: Vec<Order>,
    fan_out: Arc<HashMap<String, u64>>,
    counters: Arc<Counters>,
) -> Result<Produced, StoreError> {
    let mut appends = futures::stream::iter(orders)
        .map(|order| {
            append_order(
                store.clone(),
                order,
                Arc::clone(&fan_out),
                Arc::clone(&counters),
            )
        })
        .buffer_unordered(PRODUCERS);
    let mut produced = Produced::new();
    while let Some(result) = appends.next().await {
        produced.merge(result?);
    }
    produced.poison_positions.sort_unstable();
    Ok(produced)
}

/// Appends one order's events one by one, as the commands of an application would, each with
/// the stream version its writer last saw.
async fn append_order(
    store: Store,
    order: Order,
    fan_out: Arc<HashMap<String, u64>>,
    counters: Arc<Counters>,
) -> Result<Produced, StoreError> {
    let mut produced = Produced::new();
    for (version, event) in order.events.iter().enumerate() {
        let (span, traced) = producer_span(order.stream_id, version, event);
        let appended = store
            .append_events(
                order.stream_id,
                Some(version as i32),
                std::slice::from_ref(traced.as_ref().unwrap_or(event)),
            )
            .instrument(span)
            .await?;
        for a in &appended {
            produced.first_position = produced.first_position.min(a.global_position);
            produced.last_position = produced.last_position.max(a.global_position);
            if order.poison_event == Some(version) {
                produced.poison_positions.push(a.global_position);
            }
        }
        counters
            .events
            .fetch_add(appended.len() as u64, Ordering::Relaxed);
        counters.work.fetch_add(
            fan_out.get(&event.event_type).copied().unwrap_or(0),
            Ordering::Relaxed,
        );
    }
    Ok(produced)
}

/// With traces on, the producer's span of one append (as an application's request would have)
/// and the event with that span's `traceparent` in its metadata: the apply of the event in
/// each perspective is then a child of it. With traces off, a disabled span and no copy.
fn producer_span(
    stream_id: uuid::Uuid,
    version: usize,
    event: &NewEvent,
) -> (tracing::Span, Option<NewEvent>) {
    use crate::telemetry::traces::{self, TARGET};
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if !tracing::enabled!(target: TARGET, tracing::Level::TRACE) {
        return (tracing::Span::none(), None);
    }
    let span = tracing::trace_span!(
        target: TARGET,
        parent: None,
        "demo.append",
        otel.name = %format_args!("append {}", event.event_type),
        otel.kind = "producer",
        vantage.stream_id = %stream_id,
        vantage.expected_version = version as i64,
    );
    let mut traced = event.clone();
    let mut metadata = match traced.metadata.take() {
        Some(serde_json::Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    traces::inject(&span.context(), &mut metadata);
    traced.metadata = Some(serde_json::Value::Object(metadata));
    (span, Some(traced))
}

/// Aborts the task when dropped (an early return must not leave the producer running).
pub(super) struct AbortOnDrop<T>(pub(super) Option<JoinHandle<T>>);

impl<T> AbortOnDrop<T> {
    pub(super) fn is_finished(&self) -> bool {
        self.0.as_ref().is_some_and(|h| h.is_finished())
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        if let Some(handle) = &self.0 {
            handle.abort();
        }
    }
}
