//! The memory store's handle: events in, work rows out, the clock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use uuid::Uuid;

use crate::store::events::{AppendedEvent, NewEvent};
use crate::store::instances::InstanceId;

use super::state::{Event, Op, Row, State};

/// A work row still in the memory store, as [`MemoryStore::work`] shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryWork {
    /// The work row's id (one row per event and perspective), as
    /// [`EventEnvelope::event_work_id`](crate::perspective::EventEnvelope::event_work_id).
    pub event_work_id: Uuid,
    /// Its perspective.
    pub perspective_name: String,
    /// Its event's stream.
    pub stream_id: Uuid,
    /// Its event's version within the stream.
    pub stream_version: i32,
    /// Its event's global position.
    pub global_position: i64,
    /// Claims so far (one-based once claimed).
    pub attempts: i32,
    /// Apply failures recorded (each parks the row until its backoff passes, `due_at`).
    pub failures: i32,
    /// The last error recorded or noted.
    pub last_error: Option<String>,
    /// Whether it is leased now.
    pub leased: bool,
    /// When it may be claimed again, on the store's clock (parked after a failure).
    pub due_at: Duration,
}

/// The in-memory store: events, work rows and lanes in one process, behind one lock. Cheap to
/// clone (a handle); clones share everything. Tests drive perspectives on it through the
/// [`testkit`](crate::testkit); on its own it shows what is left to do and moves its clock:
///
/// ```
/// use std::time::Duration;
/// use vantage::store::{MemoryStore, NewEvent};
///
/// let store = MemoryStore::new();
/// store.subscribe("totals", vec!["*".into()]);
/// let stream = uuid::Uuid::new_v4();
/// store.append(stream, vec![NewEvent::new("Added", serde_json::json!({ "n": 1 }))]);
///
/// let work = store.work();
/// assert_eq!(work.len(), 1);
/// assert_eq!((work[0].perspective_name.as_str(), work[0].leased), ("totals", false));
/// store.advance(Duration::from_secs(5));
/// assert_eq!(store.now(), Duration::from_secs(5));
/// ```
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    pub(super) state: Arc<Mutex<State>>,
    pub(super) clock: Arc<AtomicU64>,
}

impl MemoryStore {
    /// An empty store whose clock reads zero.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The store's clock (time since it was created, as far as it was told).
    pub fn now(&self) -> Duration {
        Duration::from_nanos(self.clock.load(Ordering::SeqCst))
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .clock
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                Some(n.saturating_add(nanos))
            });
    }

    /// Subscribes a perspective to event types (`"*"` = every type): events appended from now
    /// on get a work row for it (`wh_perspectives`' fan-out).
    pub fn subscribe(&self, perspective: &str, event_types: Vec<String>) {
        self.lock()
            .subscriptions
            .insert(perspective.to_string(), event_types);
    }

    /// Registers a lease holder (only registered instances claim, as in PostgreSQL).
    pub fn register_instance(&self, instance: InstanceId) {
        self.lock().instances.insert(instance.0);
    }

    /// Removes a lease holder: its leases may be taken over at once.
    pub fn deregister_instance(&self, instance: InstanceId) {
        self.lock().instances.remove(&instance.0);
    }

    /// Appends events to a stream, after its last version; each gets a work row per subscribed
    /// perspective.
    pub fn append(&self, stream_id: Uuid, events: Vec<NewEvent>) -> Vec<AppendedEvent> {
        let now = self.now();
        let mut state = self.lock();
        let mut appended = Vec::with_capacity(events.len());
        for ev in events {
            let version = state.versions.get(&stream_id).copied().unwrap_or(0) + 1;
            state.versions.insert(stream_id, version);
            let event_id = ev.event_id.unwrap_or_else(Uuid::new_v4);
            state.events.push(Event {
                event_id,
                event_type: ev.event_type.clone(),
                data: ev.data,
                metadata: ev
                    .metadata
                    .unwrap_or_else(|| serde_json::Value::Object(Default::default())),
            });
            let global_position = state.events.len() as i64;
            let subscribers: Vec<String> = state
                .subscriptions
                .iter()
                .filter(|(_, types)| types.iter().any(|t| t == "*" || *t == ev.event_type))
                .map(|(p, _)| p.clone())
                .collect();
            for perspective in subscribers {
                let id = Uuid::new_v4();
                state.rows.insert(
                    id,
                    Row {
                        perspective: perspective.clone(),
                        stream_id,
                        stream_version: version,
                        global_position,
                        attempts: 0,
                        failures: 0,
                        holder: None,
                        lease_expiry: Duration::ZERO,
                        scheduled_for: now,
                        refundable: false,
                        last_error: None,
                    },
                );
                state
                    .lanes
                    .entry((perspective, stream_id))
                    .or_default()
                    .insert(version, id);
            }
            appended.push(AppendedEvent {
                global_position,
                event_id,
                stream_version: version,
            });
        }
        appended
    }

    /// Every work row still to do, by perspective, stream and version.
    pub fn work(&self) -> Vec<MemoryWork> {
        let state = self.lock();
        let now = self.now();
        let mut out = Vec::new();
        for ids in state.lanes.values() {
            for id in ids.values() {
                let r = &state.rows[id];
                out.push(MemoryWork {
                    event_work_id: *id,
                    perspective_name: r.perspective.clone(),
                    stream_id: r.stream_id,
                    stream_version: r.stream_version,
                    global_position: r.global_position,
                    attempts: r.attempts,
                    failures: r.failures,
                    last_error: r.last_error.clone(),
                    leased: r.holder.is_some() && r.lease_expiry >= now,
                    due_at: r.scheduled_for,
                });
            }
        }
        out
    }

    /// The earliest moment after now at which a parked row becomes due, if any.
    pub fn next_due(&self) -> Option<Duration> {
        let now = self.now();
        self.lock()
            .rows
            .values()
            .filter(|r| r.holder.is_none() && r.scheduled_for > now)
            .map(|r| r.scheduled_for)
            .min()
    }

    /// Applies staged changes atomically, each fenced on `instance`.
    pub(super) fn commit_ops(&self, ops: Vec<Op>) {
        let now = self.now();
        let mut state = self.lock();
        for op in ops {
            state.apply(op, now);
        }
    }
}
