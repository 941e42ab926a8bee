//! One behavioural suite, two stores: every scenario runs on the memory store (through the
//! test kit) and on PostgreSQL (a throwaway server, or `DATABASE_URL`), with the same pipeline
//! and the same recording perspective. Ordering, attempts, backoff, cooldown and permanent
//! failures behave alike; the dead-letter rules differ exactly where the memory store has no
//! dead letters (docs/cli.md, "In-memory mode").

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;
use vantage::config::WorkerSettings;
use vantage::internals::perspective::PerspectiveRegistry;
use vantage::internals::pipeline::cooldown::CooldownCache;
use vantage::internals::pipeline::{DrainOutcome, Pipeline};
use vantage::internals::store::{InstanceInfo, StoreInternals as _, WorkStore};
use vantage::perspective::{ApplyError, ApplyTx, EventEnvelope, Perspective};
use vantage::store::{InstanceId, NewEvent, Store};
use vantage::testkit::TestKit;

use crate::support::Env;

const PERSPECTIVE: &str = "recorder";
const MAX_ATTEMPTS: u32 = 3;

/// global position → (error, deliveries left to fail (u32::MAX = always), the delivery failing).
type Script = HashMap<i64, (ApplyError, u32, Option<i32>)>;

/// What the recorder saw: applies in order, and the failures it was told to produce.
#[derive(Default)]
struct Log {
    /// (global position, attempts) of every successful apply, in order.
    applied: Mutex<Vec<(i64, i32)>>,
    /// The failures to produce.
    script: Mutex<Script>,
}

/// A perspective that records its applies and fails as scripted (per delivery, like a real
/// failure: every apply of a failing delivery fails).
struct Recorder(Arc<Log>);

#[async_trait]
impl Perspective for Recorder {
    fn name(&self) -> &str {
        PERSPECTIVE
    }

    fn event_types(&self) -> Vec<String> {
        vec!["*".into()]
    }

    async fn apply(&self, e: &EventEnvelope, _tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        if let Some((error, left, failing)) =
            self.0.script.lock().unwrap().get_mut(&e.global_position)
        {
            if *failing == Some(e.attempts) {
                return Err(error.clone());
            }
            if *left > 0 {
                if *left != u32::MAX {
                    *left -= 1;
                }
                *failing = Some(e.attempts);
                return Err(error.clone());
            }
        }
        self.0
            .applied
            .lock()
            .unwrap()
            .push((e.global_position, e.attempts));
        Ok(())
    }

    /// Its log is kept outside any transaction: an apply in a pass that rolls back stays
    /// recorded, so the cooldown cache must keep it from being applied (and recorded) twice.
    fn effects_in_transaction(&self) -> bool {
        false
    }
}

/// A work row's state.
#[derive(Clone, Debug, PartialEq)]
struct RowState {
    id: Uuid,
    global_position: i64,
    attempts: i32,
    failures: i32,
}

/// One store under test.
#[async_trait]
trait Harness: Send + Sync {
    /// Appends events of these types to a stream; their global positions.
    async fn append(&self, stream: Uuid, types: &[&str]) -> Vec<i64>;
    /// One pipeline pass.
    async fn pass(&self) -> DrainOutcome;
    /// Every parked row becomes due (memory: the clock moves; PostgreSQL: they are rescheduled).
    async fn time_passes(&self);
    /// Work rows left, by global position.
    async fn rows(&self) -> Vec<RowState>;
    /// (global position, reason) of the dead letters; None without a dead-letter store.
    async fn dead_letters(&self) -> Option<Vec<(i64, String)>>;
    /// The pipeline's cooldown cache.
    fn cooldown(&self) -> Arc<CooldownCache>;
    /// The recorder's log.
    fn log(&self) -> &Log;
    /// Claims as another instance, which then dies holding its leases (no give-back); how many
    /// rows it took.
    async fn claim_and_die(&self) -> usize;

    /// Passes until one claims nothing (bounded).
    async fn drain(&self) {
        for _ in 0..1000 {
            if self.pass().await.claimed == 0 {
                return;
            }
        }
        panic!("not quiescent after 1000 passes");
    }

    fn applied(&self) -> Vec<(i64, i32)> {
        self.log().applied.lock().unwrap().clone()
    }

    fn script(&self, global_position: i64, error: ApplyError, deliveries: u32) {
        self.log()
            .script
            .lock()
            .unwrap()
            .insert(global_position, (error, deliveries, None));
    }
}

fn worker() -> WorkerSettings {
    WorkerSettings {
        max_perspective_event_attempts: Some(MAX_ATTEMPTS),
        retry_backoff_base: Duration::from_secs(10),
        retry_backoff_max: Duration::from_secs(60),
        ..WorkerSettings::default()
    }
}

// ---- the memory store, through the test kit -------------------------------------------------

struct Memory {
    kit: TestKit,
    log: Arc<Log>,
}

impl Memory {
    fn new() -> Memory {
        let log = Arc::new(Log::default());
        let kit = TestKit::builder()
            .perspective(Recorder(Arc::clone(&log)))
            .worker(worker())
            .build()
            .unwrap();
        Memory { kit, log }
    }
}

#[async_trait]
impl Harness for Memory {
    async fn append(&self, stream: Uuid, types: &[&str]) -> Vec<i64> {
        let events = types
            .iter()
            .map(|t| NewEvent::new(*t, serde_json::json!({})))
            .collect();
        self.kit
            .append_events(stream, events)
            .into_iter()
            .map(|a| a.global_position)
            .collect()
    }

    async fn pass(&self) -> DrainOutcome {
        vantage::internals::testkit::pipeline(&self.kit)
            .drain_once()
            .await
            .unwrap()
    }

    async fn time_passes(&self) {
        self.kit.advance(Duration::from_secs(3600));
    }

    async fn rows(&self) -> Vec<RowState> {
        let mut rows: Vec<RowState> = self
            .kit
            .work()
            .into_iter()
            .map(|w| RowState {
                id: w.event_work_id,
                global_position: w.global_position,
                attempts: w.attempts,
                failures: w.failures,
            })
            .collect();
        rows.sort_by_key(|r| r.global_position);
        rows
    }

    async fn dead_letters(&self) -> Option<Vec<(i64, String)>> {
        None
    }

    fn cooldown(&self) -> Arc<CooldownCache> {
        Arc::clone(
            vantage::internals::testkit::pipeline(&self.kit)
                .ctx
                .cooldown
                .as_ref()
                .unwrap(),
        )
    }

    fn log(&self) -> &Log {
        &self.log
    }

    async fn claim_and_die(&self) -> usize {
        let store = self.kit.store();
        let other = InstanceId::new();
        store.register_instance(other);
        let rows = store
            .claim_work(
                other,
                Duration::from_secs(60),
                10,
                100,
                &[PERSPECTIVE.into()],
            )
            .await
            .unwrap();
        store.deregister_instance(other);
        rows.len()
    }
}

// ---- PostgreSQL --------------------------------------------------------------------------

struct Postgres {
    db: Env,
    pipeline: Pipeline<Store>,
    log: Arc<Log>,
}

impl Postgres {
    async fn new() -> Postgres {
        let db = Env::migrated().await;
        let log = Arc::new(Log::default());
        let recorder = Recorder(Arc::clone(&log));
        db.store
            .register_perspective(PERSPECTIVE, &recorder.event_types())
            .await
            .unwrap();
        let instance = InstanceId::new();
        db.store
            .heartbeat(instance, &InstanceInfo::current("behaviour"))
            .await
            .unwrap();
        let mut registry = PerspectiveRegistry::new();
        registry.add(Arc::new(recorder)).unwrap();
        let cooldown = Arc::new(CooldownCache::new(Duration::from_secs(300), 10_000));
        let pipeline = Pipeline::new(
            db.store.clone(),
            instance,
            registry,
            Some(cooldown),
            &worker(),
        );
        Postgres { db, pipeline, log }
    }
}

#[async_trait]
impl Harness for Postgres {
    async fn append(&self, stream: Uuid, types: &[&str]) -> Vec<i64> {
        let events: Vec<NewEvent> = types
            .iter()
            .map(|t| NewEvent::new(*t, serde_json::json!({})))
            .collect();
        self.db
            .store
            .append_events(stream, None, &events)
            .await
            .unwrap()
            .into_iter()
            .map(|a| a.global_position)
            .collect()
    }

    async fn pass(&self) -> DrainOutcome {
        self.pipeline.drain_once().await.unwrap()
    }

    async fn time_passes(&self) {
        // Parked rows and their lanes' hints, due now (the test's stand-in for waiting).
        self.db
            .exec(
                "UPDATE wh_perspective_events SET scheduled_for = now() \
                 WHERE instance_id IS NULL AND scheduled_for > now(); \
                 UPDATE wh_perspective_lanes SET due_at = now();",
            )
            .await;
    }

    async fn rows(&self) -> Vec<RowState> {
        let rows: Vec<(Uuid, i64, i32, i32)> = sqlx::query_as(
            "SELECT event_work_id, global_position, attempts, failures \
             FROM wh_perspective_events ORDER BY global_position",
        )
        .fetch_all(self.db.store.pool())
        .await
        .unwrap();
        rows.into_iter()
            .map(|(id, global_position, attempts, failures)| RowState {
                id,
                global_position,
                attempts,
                failures,
            })
            .collect()
    }

    async fn dead_letters(&self) -> Option<Vec<(i64, String)>> {
        Some(
            sqlx::query_as(
                "SELECT global_position, failure_reason FROM wh_dead_letters \
                 ORDER BY global_position",
            )
            .fetch_all(self.db.store.pool())
            .await
            .unwrap(),
        )
    }

    fn cooldown(&self) -> Arc<CooldownCache> {
        Arc::clone(self.pipeline.ctx.cooldown.as_ref().unwrap())
    }

    fn log(&self) -> &Log {
        &self.log
    }

    async fn claim_and_die(&self) -> usize {
        let store = &self.db.store;
        let other = InstanceId::new();
        store
            .heartbeat(other, &InstanceInfo::current("doomed"))
            .await
            .unwrap();
        let rows = WorkStore::claim_work(
            store,
            other,
            Duration::from_secs(60),
            10,
            100,
            &[PERSPECTIVE.into()],
        )
        .await
        .unwrap();
        // Gone without giving anything back (what the orphan cleanup does to a dead instance).
        sqlx::query("DELETE FROM wh_service_instances WHERE instance_id = $1")
            .bind(other.0)
            .execute(store.pool())
            .await
            .unwrap();
        rows.len()
    }
}

// ---- the scenarios ---------------------------------------------------------------------------

/// Every event applied once, each stream's in version order, whatever the interleaving.
async fn ordering(h: &dyn Harness) {
    let streams: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
    let mut by_stream: HashMap<Uuid, Vec<i64>> = HashMap::new();
    for _round in 0..4 {
        for s in &streams {
            let gp = h.append(*s, &["A", "B"]).await;
            by_stream.entry(*s).or_default().extend(gp);
        }
    }
    h.drain().await;
    let applied: Vec<i64> = h.applied().into_iter().map(|(gp, _)| gp).collect();
    assert_eq!(applied.len(), 24, "every event once: {applied:?}");
    for positions in by_stream.values() {
        let seen: Vec<i64> = applied
            .iter()
            .copied()
            .filter(|gp| positions.contains(gp))
            .collect();
        assert_eq!(&seen, positions, "one stream's events in version order");
    }
    assert!(h.rows().await.is_empty());
}

/// A retryable failure charges its row (failures + 1), parks it for the backoff and holds its
/// lane; once due, the next claim bumps attempts and the lane goes on.
async fn attempts_and_backoff(h: &dyn Harness) {
    let stream = Uuid::new_v4();
    let gp = h.append(stream, &["A", "B", "C"]).await;
    h.script(gp[1], ApplyError::Retryable("flaky".into()), 1);
    h.drain().await;
    assert_eq!(h.applied(), vec![(gp[0], 1)]);
    let rows = h.rows().await;
    assert_eq!(
        rows.iter()
            .map(|r| (r.global_position, r.attempts, r.failures))
            .collect::<Vec<_>>(),
        vec![(gp[1], 1, 1), (gp[2], 0, 0)],
        "the failed row charged and parked; the one behind it given back with a refund"
    );
    assert_eq!(
        h.pass().await.claimed,
        0,
        "parked until its backoff has passed"
    );
    h.time_passes().await;
    h.drain().await;
    assert_eq!(h.applied(), vec![(gp[0], 1), (gp[1], 2), (gp[2], 1)]);
    assert!(h.rows().await.is_empty());
}

/// A row whose work id is in the cooldown cache is completed without being applied again.
async fn cooldown(h: &dyn Harness) {
    let stream = Uuid::new_v4();
    let gp = h.append(stream, &["A", "B"]).await;
    let head = h.rows().await[0].clone();
    assert_eq!(head.global_position, gp[0]);
    h.cooldown().mark(head.id);
    h.drain().await;
    assert_eq!(
        h.applied(),
        vec![(gp[1], 1)],
        "the cooled row is not applied"
    );
    assert!(h.rows().await.is_empty(), "and it is completed");
}

/// A permanent failure: dead-lettered at once (`PermanentFailure`) and the lane goes on, where
/// there are dead letters; without, it is charged like any failure and the row stays.
async fn permanent_failure(h: &dyn Harness) {
    let stream = Uuid::new_v4();
    let gp = h.append(stream, &["A", "B", "C"]).await;
    h.script(gp[1], ApplyError::Permanent("never".into()), u32::MAX);
    h.drain().await;
    match h.dead_letters().await {
        Some(dead) => {
            assert_eq!(dead, vec![(gp[1], "PermanentFailure".to_string())]);
            assert_eq!(h.applied(), vec![(gp[0], 1), (gp[2], 1)]);
            assert!(h.rows().await.is_empty());
        }
        None => {
            assert_eq!(h.applied(), vec![(gp[0], 1)]);
            let rows = h.rows().await;
            assert_eq!(rows[0].global_position, gp[1]);
            assert_eq!(rows[0].failures, 1);
            assert_eq!(rows.len(), 2, "the lane waits behind it");
        }
    }
}

/// A row that keeps failing: past `max_perspective_event_attempts` claims the pre-filter
/// dead-letters it (`MaxAttemptsExceeded`) and the lane goes on; without dead letters the
/// filter passes it through and it is retried for good.
async fn max_attempts(h: &dyn Harness) {
    let stream = Uuid::new_v4();
    let gp = h.append(stream, &["A", "B"]).await;
    h.script(gp[0], ApplyError::Retryable("poison".into()), u32::MAX);
    for _ in 0..(MAX_ATTEMPTS + 2) {
        h.drain().await;
        h.time_passes().await;
    }
    h.drain().await;
    match h.dead_letters().await {
        Some(dead) => {
            assert_eq!(dead, vec![(gp[0], "MaxAttemptsExceeded".to_string())]);
            assert_eq!(h.applied(), vec![(gp[1], 1)]);
            assert!(h.rows().await.is_empty());
        }
        None => {
            assert!(h.applied().is_empty());
            let rows = h.rows().await;
            assert_eq!(rows[0].global_position, gp[0]);
            assert!(
                rows[0].attempts > MAX_ATTEMPTS as i32,
                "retried past the maximum: {rows:?}"
            );
        }
    }
}

/// Rows leased by an instance that died are taken over at once, and the takeover is an
/// attempt: the handler sees attempts = 2.
async fn takeover(h: &dyn Harness) {
    let stream = Uuid::new_v4();
    let gp = h.append(stream, &["A", "B"]).await;
    assert_eq!(h.claim_and_die().await, 2);
    h.drain().await;
    assert_eq!(h.applied(), vec![(gp[0], 2), (gp[1], 2)]);
    assert!(h.rows().await.is_empty());
}

macro_rules! on_both_stores {
    ($($scenario:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test]
                async fn $scenario() {
                    super::$scenario(&super::Memory::new()).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(&super::Postgres::new().await).await;
                }
            )*
        }
    };
}

on_both_stores!(
    ordering,
    attempts_and_backoff,
    cooldown,
    permanent_failure,
    max_attempts,
    takeover
);
