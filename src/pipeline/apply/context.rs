//! What the apply stage works with: its context, and a batch's events as lanes.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use crate::perspective::{EventEnvelope, Perspective, PerspectiveRegistry};
use crate::pipeline::cooldown::CooldownCache;
use crate::pipeline::inflight::InFlight;
use crate::store::{InstanceId, WorkStore};

/// Everything the apply stage needs.
#[derive(Clone)]
pub struct ApplyContext<S: WorkStore> {
    /// The store.
    pub store: S,
    /// Our lease holder id.
    pub instance: InstanceId,
    /// Handlers by perspective name.
    pub registry: PerspectiveRegistry,
    /// The cooldown cache (None when disabled).
    pub cooldown: Option<Arc<CooldownCache>>,
    /// `worker.retry_backoff_base`.
    pub backoff_base: Duration,
    /// `worker.retry_backoff_max`.
    pub backoff_max: Duration,
    /// `worker.max_perspective_event_attempts`, for log lines.
    pub max_attempts: Option<u32>,
    /// `worker.apply_timeout`: the deadline of one apply.
    pub apply_timeout: Duration,
    /// Batches still to run one lane per transaction, shared by the consumer loops of the
    /// process: set after a lock conflict, counted down per batch (see [`apply_batch`](super::apply_batch)).
    pub small_transactions: Arc<AtomicU32>,
    /// The process's work in flight (batch transactions are listed there for shutdown).
    pub inflight: Arc<InFlight>,
}

/// One lane's events, in stream_version order, with its handler.
#[derive(Clone)]
pub(super) struct Lane {
    pub(super) perspective: Arc<dyn Perspective>,
    pub(super) events: Vec<EventEnvelope>,
}

impl Lane {
    pub(super) fn ids(&self) -> Vec<Uuid> {
        self.events.iter().map(|e| e.event_work_id).collect()
    }

    /// Whether an event of the lane has failed before: it usually fails again, so the lane
    /// goes straight to the careful pass instead of failing the optimistic one for everyone.
    pub(super) fn retries(&self) -> bool {
        self.events.iter().any(|e| e.failures > 0)
    }
}

/// The batch's events as lanes, with the rows no handler of ours reads.
pub(super) fn lanes<S: WorkStore>(
    ctx: &ApplyContext<S>,
    events: Vec<EventEnvelope>,
) -> (Vec<Lane>, Vec<Uuid>) {
    let mut lanes: Vec<Lane> = Vec::new();
    let mut unhandled = Vec::new();
    for ev in events {
        let Some(perspective) = ctx.registry.get(&ev.perspective_name) else {
            // Claims are filtered by our perspective names, so this is a row we should not hold.
            unhandled.push(ev.event_work_id);
            continue;
        };
        match lanes.last_mut() {
            Some(lane)
                if lane.events[0].stream_id == ev.stream_id
                    && lane.events[0].perspective_name == ev.perspective_name =>
            {
                lane.events.push(ev)
            }
            _ => lanes.push(Lane {
                perspective: Arc::clone(perspective),
                events: vec![ev],
            }),
        }
    }
    (lanes, unhandled)
}
