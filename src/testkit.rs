//! A test kit for perspectives, without PostgreSQL: append events, drain them through the real
//! pipeline on the [`MemoryStore`], inspect what was applied, inject failures, move time.
//!
//! The pipeline is the daemon's own (claim → DLQ filter → envelope → cooldown → apply →
//! complete: the same lanes, head-of-line gate, attempts, backoff and cooldown cache); only the
//! store is in memory. Everything is deterministic: the kit runs one pass at a time, and the
//! store's clock moves only when told (`advance`, or `run_for`, which jumps from one due retry
//! to the next). Nothing sleeps.
//!
//! What differs from PostgreSQL (docs/cli.md, "In-memory mode"): there are no dead letters, so a
//! row past `max_perspective_event_attempts`, or one that failed permanently, stays and is retried;
//! and there is no database transaction, so a perspective gets [`ApplyTx::none`] and one that asks
//! for the connection fails (permanently, with
//! [`NO_TRANSACTION`](crate::perspective::NO_TRANSACTION) as its error). Keep the logic that
//! decides what an event does in plain Rust, and test it here.
//!
//! ```
//! use async_trait::async_trait;
//! use std::sync::{Arc, Mutex};
//! use vantage::perspective::{ApplyError, ApplyTx, Typed, TypedEnvelope, TypedPerspective};
//! use vantage::testkit::TestKit;
//!
//! #[derive(serde::Deserialize)]
//! enum Counted { Clicked { by: u32 } }
//!
//! #[derive(Default)]
//! struct Clicks(Arc<Mutex<u32>>);
//!
//! #[async_trait]
//! impl TypedPerspective for Clicks {
//!     type Event = Counted;
//!     fn name(&self) -> &str { "clicks" }
//!     fn event_types(&self) -> Vec<String> { vec!["Clicked".into()] }
//!     async fn apply(&self, ev: &TypedEnvelope<Counted>, _tx: &mut ApplyTx<'_>)
//!         -> Result<(), ApplyError> {
//!         let Counted::Clicked { by } = ev.data;
//!         *self.0.lock().unwrap() += by;
//!         Ok(())
//!     }
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let clicks = Clicks::default();
//! let total = Arc::clone(&clicks.0);
//! let kit = TestKit::new(Typed(clicks));
//! let stream = uuid::Uuid::new_v4();
//! kit.append(stream, "Clicked", serde_json::json!({ "by": 2 }));
//! let second = kit.append(stream, "Clicked", serde_json::json!({ "by": 3 }));
//!
//! // The second event fails once: it is parked for its backoff, then retried.
//! kit.fail(second.global_position, ApplyError::Retryable("flaky".into()), 1);
//! kit.drain().await.unwrap();
//! assert_eq!(*total.lock().unwrap(), 2);
//! assert_eq!(kit.work()[0].failures, 1);
//!
//! kit.run_for(std::time::Duration::from_secs(60)).await.unwrap();
//! assert_eq!(*total.lock().unwrap(), 5);
//! assert!(kit.work().is_empty());
//! assert_eq!(kit.applied().len(), 2);
//! # });
//! ```

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use crate::config::{CooldownSettings, WorkerSettings};
use crate::perspective::{
    ApplyError, ApplyTx, EventEnvelope, Perspective, PerspectiveRegistry, RegistryError,
};
use crate::pipeline::cooldown::CooldownCache;
use crate::pipeline::{DrainError, Pipeline};
use crate::store::{AppendedEvent, InstanceId, MemoryStore, MemoryWork, NewEvent};

/// How many passes [`TestKit::drain`] runs at most before it calls the kit not quiescent.
pub const DEFAULT_MAX_PASSES: usize = 10_000;

/// An event a perspective applied (its handler returned `Ok`), in the order of the applies.
#[derive(Clone, Debug, PartialEq)]
pub struct AppliedEvent {
    /// The name of the perspective that applied it (a kit may run several).
    pub perspective: String,
    /// The event's stream.
    pub stream_id: Uuid,
    /// Its version in the stream.
    pub stream_version: i32,
    /// Its global position.
    pub global_position: i64,
    /// The type it was appended with.
    pub event_type: String,
    /// The claim it was applied in (one-based).
    pub attempts: i32,
}

/// What [`TestKit::drain`] or [`TestKit::run_for`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Pipeline passes run.
    pub passes: usize,
    /// Events applied.
    pub applied: usize,
    /// Failures recorded (rows parked for their backoff).
    pub failed: usize,
    /// Work rows left (parked, or past the maximum and retried forever: there are no dead
    /// letters in memory).
    pub remaining: usize,
}

/// Why the kit could not do what it was asked.
#[derive(Debug, thiserror::Error)]
pub enum TestKitError {
    /// Passes kept finding work: something is retried without end at this moment (a bound,
    /// so a test fails instead of hanging).
    #[error("not quiescent after {passes} passes ({remaining} work row(s) left)")]
    NotQuiescent {
        /// Passes run.
        passes: usize,
        /// Work rows left.
        remaining: usize,
    },
    /// A pass failed as a whole.
    #[error(transparent)]
    Drain(#[from] DrainError),
    /// Two perspectives with one name.
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

/// A failure to inject.
#[derive(Debug)]
struct Fault {
    global_position: i64,
    perspective: Option<String>,
    error: ApplyError,
    /// Deliveries (claims) still to fail.
    remaining: u32,
    /// The delivery failing now (its `attempts`): every apply of it fails, the optimistic
    /// pass's and the careful pass's, as a real failure would.
    failing: Option<i32>,
}

/// What the kit's perspectives did, and the failures still to inject.
#[derive(Debug, Default)]
struct Journal {
    applied: Mutex<Vec<AppliedEvent>>,
    faults: Mutex<Vec<Fault>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Journal {
    /// The injected failure for this delivery of the event, if any (counting deliveries).
    fn injected(&self, event: &EventEnvelope) -> Option<ApplyError> {
        let mut faults = lock(&self.faults);
        let fault = faults.iter_mut().find(|f| {
            f.global_position == event.global_position
                && f.perspective
                    .as_deref()
                    .map_or(true, |p| p == event.perspective_name)
                && (f.failing == Some(event.attempts) || f.remaining > 0)
        })?;
        if fault.failing != Some(event.attempts) {
            fault.remaining -= 1;
            fault.failing = Some(event.attempts);
        }
        Some(fault.error.clone())
    }
}

/// A perspective as the kit runs it: injected failures first, then the perspective itself,
/// and a record of each successful apply.
struct Instrumented {
    inner: Arc<dyn Perspective>,
    journal: Arc<Journal>,
}

#[async_trait]
impl Perspective for Instrumented {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn event_types(&self) -> Vec<String> {
        self.inner.event_types()
    }

    async fn apply(&self, event: &EventEnvelope, tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        if let Some(error) = self.journal.injected(event) {
            return Err(error);
        }
        self.inner.apply(event, tx).await?;
        lock(&self.journal.applied).push(AppliedEvent {
            perspective: event.perspective_name.clone(),
            stream_id: event.stream_id,
            stream_version: event.stream_version,
            global_position: event.global_position,
            event_type: event.event_type.clone(),
            attempts: event.attempts,
        });
        Ok(())
    }

    fn effects_in_transaction(&self) -> bool {
        self.inner.effects_in_transaction()
    }
}

/// Builds a [`TestKit`] with several perspectives or other settings.
pub struct TestKitBuilder {
    perspectives: Vec<Arc<dyn Perspective>>,
    worker: WorkerSettings,
    cooldown: CooldownSettings,
    max_passes: usize,
}

impl TestKitBuilder {
    /// Adds a perspective.
    pub fn perspective(mut self, perspective: impl Perspective) -> Self {
        self.perspectives.push(Arc::new(perspective));
        self
    }

    /// Adds a shared perspective (to keep a handle on its state).
    pub fn perspective_arc(mut self, perspective: Arc<dyn Perspective>) -> Self {
        self.perspectives.push(perspective);
        self
    }

    /// The `[worker]` settings (batch size, lanes per claim, lease, attempts, backoff);
    /// `consumers`, `poll_interval` and `shutdown_grace` have no meaning here.
    pub fn worker(mut self, worker: WorkerSettings) -> Self {
        self.worker = worker;
        self
    }

    /// The cooldown cache's size and time to live. It is always on here: without a database
    /// it is what keeps an event applied in a pass that then rolls back from being applied
    /// again.
    pub fn cooldown(mut self, cooldown: CooldownSettings) -> Self {
        self.cooldown = cooldown;
        self
    }

    /// The bound of [`TestKit::drain`] (default [`DEFAULT_MAX_PASSES`]).
    pub fn max_passes(mut self, passes: usize) -> Self {
        self.max_passes = passes.max(1);
        self
    }

    /// The kit: a memory store subscribed to every perspective, one registered instance.
    pub fn build(self) -> Result<TestKit, TestKitError> {
        let store = MemoryStore::new();
        let journal = Arc::new(Journal::default());
        let mut registry = PerspectiveRegistry::new();
        for p in self.perspectives {
            store.subscribe(p.name(), p.event_types());
            registry.add(Arc::new(Instrumented {
                inner: p,
                journal: Arc::clone(&journal),
            }))?;
        }
        let instance = InstanceId::new();
        store.register_instance(instance);
        let cooldown = Arc::new(CooldownCache::new(
            self.cooldown.ttl,
            self.cooldown.max_entries.max(1),
        ));
        let pipeline = Pipeline::new(
            store.clone(),
            instance,
            registry,
            Some(cooldown),
            &self.worker,
        );
        Ok(TestKit {
            store,
            pipeline,
            journal,
            max_passes: self.max_passes,
        })
    }
}

/// Perspectives over the in-memory store, driven by hand. See the [module](self) docs.
pub struct TestKit {
    store: MemoryStore,
    pipeline: Pipeline<MemoryStore>,
    journal: Arc<Journal>,
    max_passes: usize,
}

impl TestKit {
    /// A kit with one perspective and the default settings.
    ///
    /// # Panics
    /// Never: one perspective cannot clash with another.
    pub fn new(perspective: impl Perspective) -> TestKit {
        TestKit::builder()
            .perspective(perspective)
            .build()
            .expect("one perspective has no name to clash with")
    }

    /// A builder, for several perspectives or other settings.
    pub fn builder() -> TestKitBuilder {
        TestKitBuilder {
            perspectives: Vec::new(),
            worker: WorkerSettings::default(),
            cooldown: CooldownSettings::default(),
            max_passes: DEFAULT_MAX_PASSES,
        }
    }

    /// Appends one event to a stream (after its last version).
    pub fn append(
        &self,
        stream_id: Uuid,
        event_type: &str,
        data: serde_json::Value,
    ) -> AppendedEvent {
        self.append_events(stream_id, vec![NewEvent::new(event_type, data)])
            .remove(0)
    }

    /// Appends events to a stream, in order.
    pub fn append_events(&self, stream_id: Uuid, events: Vec<NewEvent>) -> Vec<AppendedEvent> {
        self.store.append(stream_id, events)
    }

    /// The next `times` deliveries (claims) of the event at `global_position` fail with
    /// `error`, in every perspective, before its handler runs (every apply of such a delivery
    /// fails, as a real failure would).
    pub fn fail(&self, global_position: i64, error: ApplyError, times: u32) {
        self.inject(global_position, None, error, times);
    }

    /// As [`TestKit::fail`], in one perspective only.
    pub fn fail_in(&self, perspective: &str, global_position: i64, error: ApplyError, times: u32) {
        self.inject(global_position, Some(perspective.to_string()), error, times);
    }

    fn inject(
        &self,
        global_position: i64,
        perspective: Option<String>,
        error: ApplyError,
        times: u32,
    ) {
        lock(&self.journal.faults).push(Fault {
            global_position,
            perspective,
            error,
            remaining: times,
            failing: None,
        });
    }

    /// Runs pipeline passes until one finds nothing to claim now (parked rows wait for the
    /// clock). Errs after the kit's bound of passes.
    pub async fn drain(&self) -> Result<DrainReport, TestKitError> {
        let mut report = DrainReport::default();
        self.drain_into(&mut report).await?;
        report.remaining = self.store.work().len();
        Ok(report)
    }

    async fn drain_into(&self, report: &mut DrainReport) -> Result<(), TestKitError> {
        let mut passes = 0;
        loop {
            let outcome = self.pipeline.drain_once().await?;
            passes += 1;
            report.passes += 1;
            report.applied += outcome.batch.applied;
            report.failed += outcome.batch.failed;
            if outcome.claimed == 0 {
                return Ok(());
            }
            if passes >= self.max_passes {
                return Err(TestKitError::NotQuiescent {
                    passes,
                    remaining: self.store.work().len(),
                });
            }
        }
    }

    /// Lets `span` of time pass: drains, then moves the clock to the next retry that falls
    /// due within `span` and drains again, until none is left before its end; the clock ends
    /// `span` later than it started.
    pub async fn run_for(&self, span: Duration) -> Result<DrainReport, TestKitError> {
        let end = self.store.now() + span;
        let mut report = DrainReport::default();
        loop {
            self.drain_into(&mut report).await?;
            match self.store.next_due() {
                Some(due) if due <= end => self.store.advance(due - self.store.now()),
                _ => break,
            }
        }
        let now = self.store.now();
        if end > now {
            self.store.advance(end - now);
            self.drain_into(&mut report).await?;
        }
        report.remaining = self.store.work().len();
        Ok(report)
    }

    /// Moves the clock forward (nothing runs until the next `drain`).
    pub fn advance(&self, by: Duration) {
        self.store.advance(by);
    }

    /// The clock: time since the kit was built, as far as it was moved.
    pub fn now(&self) -> Duration {
        self.store.now()
    }

    /// Every successful apply so far, in order.
    pub fn applied(&self) -> Vec<AppliedEvent> {
        lock(&self.journal.applied).clone()
    }

    /// The work rows still to do (parked, failing, or never claimed), by perspective, stream
    /// and version.
    pub fn work(&self) -> Vec<MemoryWork> {
        self.store.work()
    }

    /// The memory store underneath.
    pub fn store(&self) -> &MemoryStore {
        &self.store
    }

    /// The pipeline the kit drives (to run single passes, or reach the cooldown cache).
    pub(crate) fn pipeline(&self) -> &Pipeline<MemoryStore> {
        &self.pipeline
    }
}
