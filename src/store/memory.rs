//! The in-memory store (docs/cli.md, "In-memory mode"): the drain pipeline's [`WorkStore`]
//! without PostgreSQL, for unit tests of perspectives (see [`testkit`](crate::testkit), which
//! drives it).
//!
//! It keeps what the PostgreSQL store keeps, by the same rules: one work row per event and
//! subscribed perspective (the fan-out), lanes (stream, perspective) claimed as a prefix from
//! their head and never past a row that is parked or validly leased (the head-of-line gate),
//! attempts + 1 on every claim that takes a row over (refunded when it is given back unseen),
//! failures parked for their backoff, every change fenced on the lease holder. What it does
//! not have:
//! - **dead letters**: the DLQ pre-filter passes everything through and a permanent failure is
//!   recorded as a failure, so rows past the maximum stay and are retried (seed 000: "in-memory
//!   hosts with no persistence layer");
//! - **a database transaction**: perspectives get [`ApplyTx::none`](crate::perspective::ApplyTx::none);
//!   a batch's own changes (completions, failures, give-backs) still commit together or not at
//!   all;
//! - **real time**: its clock starts at zero and moves only when told ([`MemoryStore::advance`]),
//!   so backoffs and leases are deterministic.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::PgConnection;
use uuid::Uuid;

use super::apply::StatementBatch;
use super::claims::WorkRow;
use super::dead_letters::MoveOutcome;
use super::error::StoreError;
use super::events::{AppendedEvent, NewEvent};
use super::instances::InstanceId;
use super::work::{WorkStore, WorkTx};

/// A work row still in the memory store, as [`MemoryStore::work`] shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryWork {
    /// The work row.
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
    /// Failures recorded.
    pub failures: i32,
    /// The last error recorded or noted.
    pub last_error: Option<String>,
    /// Whether it is leased now.
    pub leased: bool,
    /// When it may be claimed again, on the store's clock (parked after a failure).
    pub due_at: Duration,
}

/// An event in the memory store.
#[derive(Clone, Debug)]
struct Event {
    event_id: Uuid,
    event_type: String,
    data: serde_json::Value,
    metadata: serde_json::Value,
}

#[derive(Clone, Debug)]
struct Row {
    perspective: String,
    stream_id: Uuid,
    stream_version: i32,
    global_position: i64,
    attempts: i32,
    failures: i32,
    holder: Option<Uuid>,
    lease_expiry: Duration,
    scheduled_for: Duration,
    refundable: bool,
    last_error: Option<String>,
}

#[derive(Debug, Default)]
struct State {
    /// Index = global position - 1.
    events: Vec<Event>,
    versions: HashMap<Uuid, i32>,
    /// Perspective → subscribed event types (`*` = all).
    subscriptions: BTreeMap<String, Vec<String>>,
    /// Lane (perspective, stream) → version → work row.
    lanes: BTreeMap<(String, Uuid), BTreeMap<i32, Uuid>>,
    rows: HashMap<Uuid, Row>,
    instances: HashSet<Uuid>,
}

/// The in-memory store: events, work rows and lanes in one process, behind one lock. Cheap to
/// clone (a handle); clones share everything. Most tests want it through the
/// [`testkit`](crate::testkit); on its own it is the pipeline's [`WorkStore`]:
///
/// ```
/// use std::time::Duration;
/// use vantage::store::{InstanceId, MemoryStore, NewEvent, WorkStore};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let store = MemoryStore::new();
/// store.subscribe("totals", vec!["*".into()]);
/// let me = InstanceId::new();
/// store.register_instance(me);
/// let stream = uuid::Uuid::new_v4();
/// store.append(stream, vec![NewEvent::new("Added", serde_json::json!({ "n": 1 }))]);
///
/// let lease = Duration::from_secs(60);
/// let rows = store.claim_work(me, lease, 10, 100, &["totals".into()]).await.unwrap();
/// assert_eq!((rows.len(), rows[0].attempts), (1, 1));
///
/// // A failure parks the row for its backoff, on the store's clock.
/// let id = rows[0].event_work_id;
/// store.record_failure(me, id, "boom", Duration::from_secs(5)).await.unwrap();
/// assert!(store.claim_work(me, lease, 10, 100, &["totals".into()]).await.unwrap().is_empty());
/// store.advance(Duration::from_secs(5));
/// let again = store.claim_work(me, lease, 10, 100, &["totals".into()]).await.unwrap();
/// assert_eq!((again[0].attempts, again[0].failures), (2, 1));
/// # });
/// ```
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
    clock: Arc<AtomicU64>,
}

impl MemoryStore {
    /// An empty store whose clock reads zero.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
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
    fn commit_ops(&self, ops: Vec<Op>) {
        let now = self.now();
        let mut state = self.lock();
        for op in ops {
            state.apply(op, now);
        }
    }
}

/// A change to leased rows, made at once or staged in a [`MemoryTx`].
#[derive(Clone, Debug)]
enum Op {
    Complete(InstanceId, Vec<Uuid>),
    Fail(InstanceId, Uuid, String, Duration),
    ReleaseUnstarted(InstanceId, Vec<Uuid>),
    ReleaseStarted(InstanceId, Vec<Uuid>),
}

impl State {
    fn ours(&self, instance: InstanceId, id: &Uuid) -> bool {
        self.rows
            .get(id)
            .is_some_and(|r| r.holder == Some(instance.0))
    }

    /// Applies one change; returns how many rows it changed.
    fn apply(&mut self, op: Op, now: Duration) -> u64 {
        match op {
            Op::Complete(instance, ids) => {
                let mut n = 0;
                for id in ids {
                    if !self.ours(instance, &id) {
                        continue;
                    }
                    let row = self.rows.remove(&id).expect("checked above");
                    let lane = (row.perspective, row.stream_id);
                    if let Some(versions) = self.lanes.get_mut(&lane) {
                        versions.remove(&row.stream_version);
                        if versions.is_empty() {
                            self.lanes.remove(&lane);
                        }
                    }
                    n += 1;
                }
                n
            }
            Op::Fail(instance, id, error, retry_after) => {
                if !self.ours(instance, &id) {
                    return 0;
                }
                let r = self.rows.get_mut(&id).expect("checked above");
                r.failures += 1;
                r.last_error = Some(error);
                r.holder = None;
                r.refundable = false;
                r.scheduled_for = now + retry_after;
                1
            }
            Op::ReleaseUnstarted(instance, ids) => self.release(instance, &ids, true),
            Op::ReleaseStarted(instance, ids) => self.release(instance, &ids, false),
        }
    }

    /// Gives rows back; `refund` takes back exactly the bump their claim made.
    fn release(&mut self, instance: InstanceId, ids: &[Uuid], refund: bool) -> u64 {
        let mut n = 0;
        let unique: HashSet<&Uuid> = ids.iter().collect();
        for id in unique {
            if !self.ours(instance, id) {
                continue;
            }
            let r = self.rows.get_mut(id).expect("checked above");
            if refund && r.refundable {
                r.attempts = (r.attempts - 1).max(0);
            }
            r.holder = None;
            r.refundable = false;
            n += 1;
        }
        n
    }

    /// A row a claim may take now: unleased and due, or leased by a lapsed or departed holder.
    fn claimable(&self, row: &Row, now: Duration) -> bool {
        match row.holder {
            None => row.scheduled_for <= now,
            Some(holder) => row.lease_expiry < now || !self.instances.contains(&holder),
        }
    }

    /// The claim of `wh_claim_lanes`, in memory: lanes whose head is claimable, a fair share
    /// per perspective (oldest head first), each lane's claimable prefix, the row budget dealt
    /// round-robin over the lanes.
    fn claim(
        &mut self,
        instance: InstanceId,
        lease: Duration,
        max_lanes: u32,
        max_rows: u32,
        perspectives: &[String],
        now: Duration,
    ) -> Vec<WorkRow> {
        if !self.instances.contains(&instance.0) || max_lanes == 0 || max_rows == 0 {
            return Vec::new();
        }
        // Due lanes per perspective, oldest head first: (head's global position, lane).
        type Lane = (String, Uuid);
        let mut due: BTreeMap<String, Vec<(i64, Lane)>> = BTreeMap::new();
        for (lane, versions) in &self.lanes {
            if !perspectives.contains(&lane.0) {
                continue;
            }
            let Some(head) = versions.values().next() else {
                continue;
            };
            let row = &self.rows[head];
            if self.claimable(row, now) {
                due.entry(lane.0.clone())
                    .or_default()
                    .push((row.global_position, lane.clone()));
            }
        }
        for lanes in due.values_mut() {
            lanes.sort();
            lanes.reverse(); // popped from the back: oldest first
        }
        // Round-robin over perspectives: each gets its share, what one leaves goes to the next.
        let mut chosen: Vec<Lane> = Vec::new();
        while chosen.len() < max_lanes as usize {
            let mut took = false;
            for lanes in due.values_mut() {
                if chosen.len() >= max_lanes as usize {
                    break;
                }
                if let Some((_, lane)) = lanes.pop() {
                    chosen.push(lane);
                    took = true;
                }
            }
            if !took {
                break;
            }
        }
        // Each chosen lane's claimable prefix.
        let prefixes: Vec<Vec<Uuid>> = chosen
            .iter()
            .map(|lane| {
                self.lanes[lane]
                    .values()
                    .take_while(|id| self.claimable(&self.rows[*id], now))
                    .copied()
                    .collect()
            })
            .collect();
        // The budget, dealt round-robin: first rows of every lane, then second rows, …
        let mut taken: Vec<Uuid> = Vec::new();
        let longest = prefixes.iter().map(Vec::len).max().unwrap_or(0);
        'deal: for rank in 0..longest {
            for prefix in &prefixes {
                if taken.len() >= max_rows as usize {
                    break 'deal;
                }
                if let Some(id) = prefix.get(rank) {
                    taken.push(*id);
                }
            }
        }
        let mut out = Vec::with_capacity(taken.len());
        for id in taken {
            let row = self.rows.get_mut(&id).expect("a lane's row exists");
            let takeover = row.holder != Some(instance.0);
            if takeover {
                row.attempts += 1;
            }
            row.refundable = takeover;
            row.holder = Some(instance.0);
            row.lease_expiry = now + lease;
            let event = &self.events[(row.global_position - 1) as usize];
            out.push(WorkRow {
                event_work_id: id,
                stream_id: row.stream_id,
                event_id: event.event_id,
                perspective_name: row.perspective.clone(),
                global_position: row.global_position,
                stream_version: row.stream_version,
                event_type: Some(event.event_type.clone()),
                event_data: Some(event.data.clone()),
                metadata: Some(event.metadata.clone()),
                attempts: row.attempts,
                failures: row.failures,
            });
        }
        out.sort_by(|a, b| {
            (a.stream_id, &a.perspective_name, a.stream_version).cmp(&(
                b.stream_id,
                &b.perspective_name,
                b.stream_version,
            ))
        });
        out
    }
}

/// The store has no dead letters: the pipeline never asks it to move one (its DLQ filter is
/// a pass-through), so a call is a programming error, reported as such.
fn no_dead_letters() -> StoreError {
    StoreError::Unsupported("the memory store has no dead letters".into())
}

#[async_trait]
impl WorkStore for MemoryStore {
    type Tx = MemoryTx;

    async fn claim_work(
        &self,
        instance: InstanceId,
        lease: Duration,
        max_lanes: u32,
        max_rows: u32,
        perspectives: &[String],
    ) -> Result<Vec<WorkRow>, StoreError> {
        let now = self.now();
        Ok(self
            .lock()
            .claim(instance, lease, max_lanes, max_rows, perspectives, now))
    }

    async fn release_unstarted(
        &self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        let now = self.now();
        Ok(self
            .lock()
            .apply(Op::ReleaseUnstarted(instance, ids.to_vec()), now))
    }

    async fn release_started(&self, instance: InstanceId, ids: &[Uuid]) -> Result<u64, StoreError> {
        let now = self.now();
        Ok(self
            .lock()
            .apply(Op::ReleaseStarted(instance, ids.to_vec()), now))
    }

    async fn record_failure(
        &self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
        retry_after: Duration,
    ) -> Result<bool, StoreError> {
        let now = self.now();
        Ok(self
            .lock()
            .apply(Op::Fail(instance, id, error.to_string(), retry_after), now)
            == 1)
    }

    async fn note_error(
        &self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
    ) -> Result<bool, StoreError> {
        let mut state = self.lock();
        if !state.ours(instance, &id) {
            return Ok(false);
        }
        if let Some(r) = state.rows.get_mut(&id) {
            r.last_error = Some(error.to_string());
        }
        Ok(true)
    }

    fn has_dead_letters(&self) -> bool {
        false
    }

    async fn move_to_dead_letters(
        &self,
        _instance: InstanceId,
        _id: Uuid,
        _reason: &str,
        _error: &str,
    ) -> Result<MoveOutcome, StoreError> {
        Err(no_dead_letters())
    }

    async fn move_many_to_dead_letters(
        &self,
        _instance: InstanceId,
        _moves: &[(Uuid, String)],
        _reason: &str,
    ) -> Result<Vec<(Uuid, Uuid)>, StoreError> {
        Err(no_dead_letters())
    }

    async fn begin_batch(&self, _statement_timeout: Duration) -> Result<MemoryTx, StoreError> {
        Ok(MemoryTx {
            store: self.clone(),
            ops: Vec::new(),
            savepoint: None,
        })
    }

    async fn cancel_backend(&self, _backend: i32) -> Result<bool, StoreError> {
        Ok(false)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// A batch transaction of the memory store: its changes are staged and applied together, each
/// fenced on the lease holder again, when it commits; dropped, it changes nothing. It has no
/// database: perspectives' own effects are theirs to keep.
#[derive(Debug)]
pub struct MemoryTx {
    store: MemoryStore,
    ops: Vec<Op>,
    savepoint: Option<usize>,
}

impl MemoryTx {
    /// Rows of `ids` ours now and not already changed in this transaction.
    fn still_ours(&self, instance: InstanceId, ids: &[Uuid]) -> Vec<Uuid> {
        let staged: HashSet<Uuid> = self
            .ops
            .iter()
            .flat_map(|op| match op {
                Op::Complete(_, ids)
                | Op::ReleaseUnstarted(_, ids)
                | Op::ReleaseStarted(_, ids) => ids.as_slice(),
                Op::Fail(_, id, _, _) => std::slice::from_ref(id),
            })
            .copied()
            .collect();
        let state = self.store.lock();
        let mut seen = HashSet::new();
        ids.iter()
            .copied()
            .filter(|id| !staged.contains(id) && state.ours(instance, id) && seen.insert(*id))
            .collect()
    }
}

#[async_trait]
impl WorkTx for MemoryTx {
    fn connection(&mut self) -> Option<&mut PgConnection> {
        None
    }

    fn backend(&self) -> Option<i32> {
        None
    }

    fn has_database(&self) -> bool {
        false
    }

    async fn savepoint(&mut self) -> Result<(), StoreError> {
        self.savepoint = Some(self.ops.len());
        Ok(())
    }

    async fn release_savepoint(&mut self) -> Result<(), StoreError> {
        self.savepoint = None;
        Ok(())
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), StoreError> {
        if let Some(at) = self.savepoint.take() {
            self.ops.truncate(at);
        }
        Ok(())
    }

    async fn complete(&mut self, instance: InstanceId, ids: &[Uuid]) -> Result<u64, StoreError> {
        let ours = self.still_ours(instance, ids);
        let n = ours.len() as u64;
        self.ops.push(Op::Complete(instance, ours));
        Ok(n)
    }

    async fn apply_statements_and_complete(
        &mut self,
        _batch: &StatementBatch<'_>,
        _instance: InstanceId,
        _ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        Err(StoreError::Unsupported(
            "the memory store runs no SQL statements".into(),
        ))
    }

    async fn record_failure(
        &mut self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
        retry_after: Duration,
    ) -> Result<bool, StoreError> {
        if self.still_ours(instance, &[id]).is_empty() {
            return Ok(false);
        }
        self.ops
            .push(Op::Fail(instance, id, error.to_string(), retry_after));
        Ok(true)
    }

    async fn release_unstarted(
        &mut self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        let ours = self.still_ours(instance, ids);
        let n = ours.len() as u64;
        self.ops.push(Op::ReleaseUnstarted(instance, ours));
        Ok(n)
    }

    async fn release_started(
        &mut self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        let ours = self.still_ours(instance, ids);
        let n = ours.len() as u64;
        self.ops.push(Op::ReleaseStarted(instance, ours));
        Ok(n)
    }

    async fn move_to_dead_letters(
        &mut self,
        _instance: InstanceId,
        _id: Uuid,
        _reason: &str,
        _error: &str,
    ) -> Result<MoveOutcome, StoreError> {
        Err(no_dead_letters())
    }

    async fn commit(self) -> Result<(), StoreError> {
        self.store.commit_ops(self.ops);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const LEASE: Duration = Duration::from_secs(60);

    fn store_with(perspectives: &[&str]) -> MemoryStore {
        let store = MemoryStore::new();
        for p in perspectives {
            store.subscribe(p, vec!["*".into()]);
        }
        store
    }

    fn instance(store: &MemoryStore) -> InstanceId {
        let i = InstanceId::new();
        store.register_instance(i);
        i
    }

    fn events(n: usize) -> Vec<NewEvent> {
        (0..n).map(|_| NewEvent::new("E", json!({}))).collect()
    }

    async fn claim(store: &MemoryStore, i: InstanceId, lanes: u32, rows: u32) -> Vec<WorkRow> {
        store
            .claim_work(i, LEASE, lanes, rows, &["p".into(), "q".into()])
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_lapsed_lease_is_taken_over_as_an_attempt_and_refunded_exactly() {
        let store = store_with(&["p"]);
        let (a, b) = (instance(&store), instance(&store));
        store.append(Uuid::new_v4(), events(1));
        assert_eq!(claim(&store, a, 10, 10).await[0].attempts, 1);
        assert!(claim(&store, b, 10, 10).await.is_empty(), "validly leased");
        store.advance(LEASE + Duration::from_secs(1));
        let taken = claim(&store, b, 10, 10).await;
        assert_eq!(taken[0].attempts, 2);
        store
            .release_unstarted(b, &[taken[0].event_work_id])
            .await
            .unwrap();
        assert_eq!(
            store.work()[0].attempts,
            1,
            "the takeover's bump, and only it"
        );
    }

    #[tokio::test]
    async fn the_old_holder_changes_nothing_after_a_takeover() {
        let store = store_with(&["p"]);
        let (a, b) = (instance(&store), instance(&store));
        store.append(Uuid::new_v4(), events(1));
        let id = claim(&store, a, 10, 10).await[0].event_work_id;
        store.advance(LEASE + Duration::from_secs(1));
        claim(&store, b, 10, 10).await;
        let mut tx = store.begin_batch(LEASE).await.unwrap();
        assert_eq!(tx.complete(a, &[id]).await.unwrap(), 0);
        tx.commit().await.unwrap();
        assert!(!store.record_failure(a, id, "late", LEASE).await.unwrap());
        assert_eq!(store.work().len(), 1);
        assert!(store.work()[0].leased);
    }

    #[tokio::test]
    async fn a_transaction_that_does_not_commit_changes_nothing() {
        let store = store_with(&["p"]);
        let a = instance(&store);
        store.append(Uuid::new_v4(), events(2));
        let ids: Vec<Uuid> = claim(&store, a, 10, 10)
            .await
            .iter()
            .map(|r| r.event_work_id)
            .collect();
        let mut tx = store.begin_batch(LEASE).await.unwrap();
        assert_eq!(tx.complete(a, &ids).await.unwrap(), 2);
        drop(tx);
        assert_eq!(store.work().len(), 2);
        let mut tx = store.begin_batch(LEASE).await.unwrap();
        tx.savepoint().await.unwrap();
        tx.complete(a, &ids[..1]).await.unwrap();
        tx.rollback_to_savepoint().await.unwrap();
        tx.complete(a, &ids[1..]).await.unwrap();
        tx.commit().await.unwrap();
        let left: Vec<Uuid> = store.work().iter().map(|w| w.event_work_id).collect();
        assert_eq!(left, ids[..1]);
    }

    #[tokio::test]
    async fn a_claim_stops_at_a_row_leased_to_someone_else() {
        let store = store_with(&["p"]);
        let (a, b) = (instance(&store), instance(&store));
        store.append(Uuid::new_v4(), events(3));
        let rows = claim(&store, a, 10, 10).await;
        assert_eq!(rows.len(), 3);
        // The first and the last go back; the middle one stays leased to `a`.
        store
            .release_unstarted(a, &[rows[0].event_work_id, rows[2].event_work_id])
            .await
            .unwrap();
        let taken = claim(&store, b, 10, 10).await;
        assert_eq!(taken.len(), 1, "only the prefix before a held row");
        assert_eq!(taken[0].stream_version, 1);
    }

    #[tokio::test]
    async fn lanes_are_shared_fairly_between_perspectives() {
        let store = store_with(&["p", "q"]);
        let a = instance(&store);
        for _ in 0..5 {
            store.append(Uuid::new_v4(), events(1));
        }
        let rows = claim(&store, a, 2, 10).await;
        let mut names: Vec<&str> = rows.iter().map(|r| r.perspective_name.as_str()).collect();
        names.sort();
        assert_eq!(names, ["p", "q"]);
    }

    #[tokio::test]
    async fn a_parked_row_waits_for_the_clock_and_holds_its_lane() {
        let store = store_with(&["p"]);
        let a = instance(&store);
        store.append(Uuid::new_v4(), events(2));
        let head = claim(&store, a, 10, 1).await[0].event_work_id;
        assert!(store
            .record_failure(a, head, "boom", Duration::from_secs(5))
            .await
            .unwrap());
        assert!(claim(&store, a, 10, 10).await.is_empty());
        assert_eq!(store.next_due(), Some(Duration::from_secs(5)));
        store.advance(Duration::from_secs(5));
        let rows = claim(&store, a, 10, 10).await;
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].attempts, rows[0].failures), (2, 1));
    }

    #[tokio::test]
    async fn an_unregistered_instance_claims_nothing() {
        let store = store_with(&["p"]);
        store.append(Uuid::new_v4(), events(1));
        assert!(claim(&store, InstanceId::new(), 10, 10).await.is_empty());
    }
}
