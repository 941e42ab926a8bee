//! What this process holds right now: the one record of lease ownership.
//!
//! All consumer loops of a process share one lease holder id, so the database cannot tell them
//! apart. This registry can: each lane is reserved by one loop at a time, and each work row
//! leased to the process is recorded here once, with the batch that holds it and whether a
//! handler has seen it. The lease handle ([`LeasedBatch`](super::lease::LeasedBatch)) reads and
//! changes its rows only through this record; the renewal loop keeps the leases of every row
//! recorded alive; at shutdown the record says which rows were started (given back without a
//! refund) and which server processes run batch transactions (cancelled).
//!
//! It also counts the events each perspective applied since the sampler last took the counts
//! (the console's chart history, docs/operations.md "The metric history"): the settle stage
//! adds a committed pass's tally, the sampler takes and writes them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{BuildHasher, Hash};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::cooldown::IdMap;

use crate::store::{leases, InstanceId, Store, StoreError, WorkRow, WorkStore};

/// A lane: (stream, perspective).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LaneKey {
    /// The stream.
    pub stream_id: Uuid,
    /// The perspective.
    pub perspective: String,
}

impl LaneKey {
    /// The lane of a work row.
    pub fn of(row: &WorkRow) -> Self {
        Self {
            stream_id: row.stream_id,
            perspective: row.perspective_name.clone(),
        }
    }
}

/// What is recorded of a row leased to this process (its log lines need the rest).
#[derive(Clone, Debug)]
pub(crate) struct Held {
    /// The batch holding it.
    batch: u64,
    pub(crate) perspective: String,
    pub(crate) stream_id: Uuid,
    pub(crate) event_id: Uuid,
    pub(crate) global_position: i64,
    pub(crate) attempts: i32,
    pub(crate) failures: i32,
    /// Handed to a handler at least once under this lease (no refund when given back).
    pub(crate) started: bool,
    /// How long it had been queued when the claim returned it, and when that was on this
    /// process's clock: its append → applied time at completion (`None`: unknown).
    pub(crate) queued: Option<(Duration, Instant)>,
}

impl Held {
    /// Append → applied, if it completes now.
    pub(crate) fn lag(&self) -> Option<Duration> {
        self.queued
            .map(|(queued_for, claimed)| queued_for + claimed.elapsed())
    }
}

/// Lanes reserved by consumer loops and work rows leased to this process.
#[derive(Debug, Default)]
pub struct InFlight {
    inner: Mutex<Inner>,
    next_batch: AtomicU64,
    /// Events applied per perspective since [`InFlight::take_applied`] (a lock of its own: the
    /// lease record's is on every row's path).
    applied: Mutex<BTreeMap<String, u64>>,
    /// Set when a claim failed: it may have committed with its answer lost (the session
    /// terminated, the server restarted, the network dropped), leaving rows validly leased to
    /// us that no batch knows of. No claim takes a live instance's valid lease, so their lanes
    /// would wait out the lease; [`InFlight::settle_lost_claims`] gives them back.
    claim_lost: AtomicBool,
    /// Held shared by each claim from its statement until its rows are recorded, and
    /// exclusively by [`InFlight::settle_lost_claims`]: so the sweep never takes a claim in
    /// flight for a lost one.
    claims: tokio::sync::RwLock<()>,
}

#[derive(Debug, Default)]
struct Inner {
    lanes: HashSet<LaneKey>,
    rows: IdMap<Held>,
    /// Server processes running a batch transaction right now (cancelled at an abandoned
    /// shutdown so their transactions roll back and release their locks).
    backends: HashSet<i32>,
    /// Rows still leased to us that no batch holds: their batch ended without giving them
    /// back (the give-back failed with the database, or was never reached), with whether a
    /// handler saw each. No claim, ours or another instance's, takes a live instance's valid
    /// lease, so left alone they would stall their lanes until the lease ran out; the consumer
    /// loops give them back before their next claim ([`InFlight::settle_owed`]).
    owed: IdMap<bool>,
    /// Per row, how often a pass that died with its session at a step of its own gave it back
    /// refunded although a handler had seen it ([`InFlight::forgive_started`]).
    forgiven: Forgiven,
}

/// The forgiven rows' counts, in two generations of [`Forgiven::GENERATION`]. A row leaves
/// when it leaves the work table ([`InFlight::gone`]), but a row another instance completes is
/// never seen leaving here: after a storm of cut sessions the map held such rows (up to
/// [`FORGIVEN_ROWS`], with the room they took) for the rest of the process's life, a step of
/// resident memory in every soak's terminate phase. A row not forgiven again for a whole
/// generation is forgotten at the end of the next, and the memory goes with it. Forgetting only
/// gives a row its budget again; a row that keeps killing its session is claimed again within
/// seconds (its claim was refunded), so it stays remembered until its budget is spent.
#[derive(Debug, Default)]
struct Forgiven {
    young: IdMap<u32>,
    old: IdMap<u32>,
    /// When `young` began (`None` until a row was first forgiven).
    since: Option<Instant>,
}

impl Forgiven {
    /// How long a generation lasts.
    const GENERATION: Duration = Duration::from_secs(300);

    /// Starts a new generation once the current one is over: the old one is dropped.
    fn age(&mut self, now: Instant) {
        match self.since {
            Some(since) if now.saturating_duration_since(since) < Self::GENERATION => {}
            Some(_) => {
                self.old = std::mem::take(&mut self.young);
                self.since = Some(now);
            }
            None => self.since = Some(now),
        }
    }

    fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }

    fn is_empty(&self) -> bool {
        self.young.is_empty() && self.old.is_empty()
    }

    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.young.capacity() + self.old.capacity()
    }

    /// The row's count, carried into the current generation.
    fn times(&mut self, id: Uuid) -> &mut u32 {
        let carried = self.old.remove(&id).unwrap_or(0);
        self.young.entry(id).or_insert(carried)
    }

    fn remove(&mut self, id: &Uuid) {
        self.young.remove(id);
        self.old.remove(id);
    }

    fn shrink(&mut self) {
        shrink_when_sparse(&mut self.young);
        shrink_when_sparse(&mut self.old);
    }
}

/// A map or set whose memory can be given back.
trait Room {
    fn len(&self) -> usize;
    fn capacity(&self) -> usize;
    fn shrink_to(&mut self, min_capacity: usize);
}

impl<K: Eq + Hash, V, S: BuildHasher> Room for HashMap<K, V, S> {
    fn len(&self) -> usize {
        HashMap::len(self)
    }
    fn capacity(&self) -> usize {
        HashMap::capacity(self)
    }
    fn shrink_to(&mut self, min_capacity: usize) {
        HashMap::shrink_to(self, min_capacity)
    }
}

impl<K: Eq + Hash, S: BuildHasher> Room for HashSet<K, S> {
    fn len(&self) -> usize {
        HashSet::len(self)
    }
    fn capacity(&self) -> usize {
        HashSet::capacity(self)
    }
    fn shrink_to(&mut self, min_capacity: usize) {
        HashSet::shrink_to(self, min_capacity)
    }
}

/// Gives a map's memory back once it is mostly empty, keeping room to grow again: a map keeps
/// its peak capacity otherwise, and a burst (a catch-up after an outage) would leave every
/// daemon that much larger for good. Shrinking at a quarter to twice the length makes each
/// reallocation pay for itself (the length must double or halve again before the next one).
fn shrink_when_sparse(map: &mut impl Room) {
    let len = map.len();
    if map.capacity() > 1024 && len * 4 < map.capacity() {
        map.shrink_to(len * 2);
    }
}

/// Rows [`Inner::forgiven`] remembers at most (besides one batch's): renewed when it reaches
/// this, which only gives rows their budget again. Kept small (under 200 KiB) for a storm of
/// cut sessions shorter than a generation; at 50 000 it made a step of resident memory in each
/// soak's terminate phase.
const FORGIVEN_ROWS: usize = 4_096;

/// The rows one claim recorded for a batch, and those it must give back at once.
pub(crate) struct Recorded {
    pub(crate) batch: u64,
    pub(crate) lanes: Vec<LaneKey>,
    /// Rows of lanes another loop of ours holds, not in flight there: leased to us by this
    /// claim, recorded for this batch, to be given back unworked.
    pub(crate) give_back: Vec<Uuid>,
    /// Rows of lanes another loop holds that are in flight there (their lease lapsed under it
    /// and this claim re-leased them): that loop's, left to it.
    pub(crate) theirs: HashSet<Uuid>,
}

impl InFlight {
    /// An empty registry.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds applied events per perspective (a committed pass's, or counts a failed write of the
    /// sampler gives back). One entry per perspective name: bounded by the configuration.
    pub(crate) fn add_applied<'a>(&self, counts: impl IntoIterator<Item = (&'a str, u64)>) {
        let mut applied = self.applied.lock().unwrap_or_else(|e| e.into_inner());
        for (perspective, n) in counts {
            match applied.get_mut(perspective) {
                Some(total) => *total = total.saturating_add(n),
                None => {
                    applied.insert(perspective.to_owned(), n);
                }
            }
        }
    }

    /// The applied events per perspective since the last call, the counts reset.
    pub(crate) fn take_applied(&self) -> BTreeMap<String, u64> {
        std::mem::take(&mut *self.applied.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Records the rows of one claim for a new batch, under one lock: the lanes no other loop
    /// reserves are reserved for it; rows of lanes another loop reserves are recorded too
    /// unless that loop has them in flight.
    pub(crate) fn record(&self, rows: &[WorkRow]) -> Recorded {
        let batch = self.next_batch.fetch_add(1, Ordering::Relaxed);
        let claimed = Instant::now();
        let mut inner = self.lock();
        let mut lanes: Vec<LaneKey> = Vec::new();
        let mut taken: Vec<LaneKey> = Vec::new();
        let mut give_back = Vec::new();
        let mut theirs = HashSet::new();
        let mut last: Option<(LaneKey, bool)> = None;
        for row in rows {
            let mine = match &last {
                Some((key, mine))
                    if key.stream_id == row.stream_id
                        && key.perspective == row.perspective_name =>
                {
                    *mine
                }
                _ => {
                    let key = LaneKey::of(row);
                    let mine = if lanes.contains(&key) {
                        true
                    } else if taken.contains(&key) || !inner.lanes.insert(key.clone()) {
                        if !taken.contains(&key) {
                            taken.push(key.clone());
                        }
                        false
                    } else {
                        lanes.push(key.clone());
                        true
                    };
                    last = Some((key, mine));
                    mine
                }
            };
            let id = row.event_work_id;
            // Claimed again (a lease still ours comes back with its stream): no longer owed.
            inner.owed.remove(&id);
            if !mine {
                if inner.rows.contains_key(&id) {
                    theirs.insert(id);
                    continue;
                }
                give_back.push(id);
            }
            inner.rows.insert(
                id,
                Held {
                    batch,
                    perspective: row.perspective_name.clone(),
                    stream_id: row.stream_id,
                    event_id: row.event_id,
                    global_position: row.global_position,
                    attempts: row.attempts,
                    failures: row.failures,
                    started: false,
                    queued: row.queued_for.map(|q| (q, claimed)),
                },
            );
        }
        Recorded {
            batch,
            lanes,
            give_back,
            theirs,
        }
    }

    /// Whether `batch` holds `id`.
    pub(crate) fn holds(&self, batch: u64, id: Uuid) -> bool {
        self.lock().rows.get(&id).is_some_and(|h| h.batch == batch)
    }

    /// How many rows `batch` holds.
    pub(crate) fn held_by(&self, batch: u64) -> usize {
        self.lock()
            .rows
            .values()
            .filter(|h| h.batch == batch)
            .count()
    }

    /// The rows `batch` holds.
    pub(crate) fn rows_of(&self, batch: u64) -> Vec<Uuid> {
        self.lock()
            .rows
            .iter()
            .filter(|(_, h)| h.batch == batch)
            .map(|(id, _)| *id)
            .collect()
    }

    /// Splits the rows of `ids` that `batch` holds into (started, unstarted).
    pub(crate) fn split_started(&self, batch: u64, ids: &[Uuid]) -> (Vec<Uuid>, Vec<Uuid>) {
        let inner = self.lock();
        let mut started = Vec::new();
        let mut unstarted = Vec::new();
        for id in ids {
            match inner.rows.get(id) {
                Some(h) if h.batch == batch && h.started => started.push(*id),
                Some(h) if h.batch == batch => unstarted.push(*id),
                _ => {}
            }
        }
        (started, unstarted)
    }

    /// Marks rows of `batch` as seen by a handler (or not, `started = false`: handed over
    /// again later).
    pub(crate) fn set_started(
        &self,
        batch: u64,
        ids: impl IntoIterator<Item = Uuid>,
        started: bool,
    ) {
        let mut inner = self.lock();
        for id in ids {
            if let Some(h) = inner.rows.get_mut(&id) {
                if h.batch == batch {
                    h.started = started;
                }
            }
        }
    }

    /// The rows of `batch` a handler saw count as unseen again (given back with a refund),
    /// each at most `budget` times in this process's life: for a pass that died with its
    /// session at a step of its own (BEGIN, SAVEPOINT, COMMIT), not at a handler's statement.
    /// The budget keeps a commit that kills its own session (a deferred trigger) charged in
    /// the end, so it is dead-lettered rather than failing its batch forever. Returns how many.
    pub(crate) fn forgive_started(&self, batch: u64, budget: u32) -> usize {
        let mut inner = self.lock();
        if inner.forgiven.len() >= FORGIVEN_ROWS {
            // Fresh maps, not `clear`: a cleared map keeps its room.
            inner.forgiven = Forgiven::default();
        }
        inner.forgiven.age(Instant::now());
        let Inner { rows, forgiven, .. } = &mut *inner;
        let mut n = 0;
        for (id, h) in rows.iter_mut() {
            if h.batch != batch || !h.started {
                continue;
            }
            let times = forgiven.times(*id);
            if *times < budget {
                *times += 1;
                h.started = false;
                n += 1;
            }
        }
        n
    }

    /// Forgets rows of `batch` that are settled; returns what was recorded of each (None for a
    /// row the batch did not hold), in order.
    pub(crate) fn forget(&self, batch: u64, ids: &[Uuid]) -> Vec<Option<Held>> {
        let mut inner = self.lock();
        let held = ids
            .iter()
            .map(|id| match inner.rows.get(id) {
                Some(h) if h.batch == batch => inner.rows.remove(id),
                _ => None,
            })
            .collect();
        shrink_when_sparse(&mut inner.rows);
        held
    }

    /// Rows that left the work table (completed, dead-lettered): nothing is remembered of them.
    /// A long-lived process would otherwise keep every row a terminated session ever had
    /// forgiven (up to [`FORGIVEN_ROWS`]), and the map's peak capacity, until the rows age out.
    pub(crate) fn gone<'a>(&self, ids: impl IntoIterator<Item = &'a Uuid>) {
        let mut inner = self.lock();
        if inner.forgiven.is_empty() {
            return;
        }
        inner.forgiven.age(Instant::now());
        for id in ids {
            inner.forgiven.remove(id);
        }
        inner.forgiven.shrink();
    }

    /// How many rows are remembered as forgiven (see [`InFlight::forgive_started`]).
    pub fn forgiven(&self) -> usize {
        self.lock().forgiven.len()
    }

    /// The batch is over: its lanes are free, and whatever it still recorded (rows it did not
    /// give back: the give-back failed, or the batch ended early) is owed back.
    pub(crate) fn end(&self, batch: u64, lanes: &[LaneKey]) {
        let mut inner = self.lock();
        for l in lanes {
            inner.lanes.remove(l);
        }
        let Inner { rows, owed, .. } = &mut *inner;
        rows.retain(|id, h| {
            if h.batch == batch {
                owed.insert(*id, h.started);
                false
            } else {
                true
            }
        });
        shrink_when_sparse(rows);
        shrink_when_sparse(&mut inner.lanes);
    }

    /// Rows owed back (see [`InFlight::settle_owed`]).
    pub fn owed(&self) -> usize {
        self.lock().owed.len()
    }

    /// Gives back the rows ended batches did not (fenced on `instance`: a row taken over
    /// meanwhile is not touched), those no handler saw with a refund of their claim's bump, the
    /// others without, exactly as their batch would have. Kept owed if the database still does
    /// not answer. Returns how many were still ours.
    pub async fn settle_owed<S: WorkStore>(
        &self,
        store: &S,
        instance: InstanceId,
    ) -> Result<u64, StoreError> {
        let owed = {
            let mut inner = self.lock();
            if inner.owed.is_empty() {
                return Ok(0);
            }
            std::mem::take(&mut inner.owed)
        };
        let (started, unstarted): (Vec<_>, Vec<_>) = owed.iter().partition(|(_, s)| **s);
        let started: Vec<Uuid> = started.into_iter().map(|(id, _)| *id).collect();
        let unstarted: Vec<Uuid> = unstarted.into_iter().map(|(id, _)| *id).collect();
        let mut released = 0;
        let result = async {
            if !unstarted.is_empty() {
                released += store.release_unstarted(instance, &unstarted).await?;
            }
            if !started.is_empty() {
                released += store.release_started(instance, &started).await?;
            }
            Ok::<(), StoreError>(())
        }
        .await;
        if let Err(error) = result {
            // (A part given back already is fenced: giving it back again changes nothing.)
            let mut inner = self.lock();
            for (id, s) in owed {
                inner.owed.entry(id).or_insert(s);
            }
            return Err(error);
        }
        count_released(released);
        if released > 0 {
            tracing::info!(
                rows = released,
                "gave back rows whose batch could not (the database was unavailable); their lanes can be claimed again"
            );
        }
        Ok(released)
    }

    /// Held by a claim from before its statement until its rows are recorded here.
    pub(crate) async fn claiming(&self) -> tokio::sync::RwLockReadGuard<'_, ()> {
        self.claims.read().await
    }

    /// A claim failed: its rows may be leased to us with nobody knowing (its answer was lost).
    pub(crate) fn claim_failed(&self) {
        self.claim_lost.store(true, Ordering::SeqCst);
    }

    /// After a claim failed, gives back the rows leased to us that no batch holds and none
    /// owes: the rows of a claim whose answer was lost, which no handler saw (so with the
    /// refund of their claim's bump). Waits for the claims in flight to record their rows
    /// first, and claims wait for it. Kept for the next call if the database does not answer.
    /// Returns how many were given back.
    pub async fn settle_lost_claims<S: WorkStore>(
        &self,
        store: &S,
        instance: InstanceId,
    ) -> Result<u64, StoreError> {
        if !self.claim_lost.load(Ordering::SeqCst) {
            return Ok(0);
        }
        let _no_claim_in_flight = self.claims.write().await;
        // Another loop may have swept while this one waited.
        if !self.claim_lost.swap(false, Ordering::SeqCst) {
            return Ok(0);
        }
        let result = async {
            let leased = store.leased_to(instance).await?;
            let unknown: Vec<Uuid> = {
                let inner = self.lock();
                leased
                    .into_iter()
                    .filter(|id| !inner.rows.contains_key(id) && !inner.owed.contains_key(id))
                    .collect()
            };
            store.release_unstarted(instance, &unknown).await
        }
        .await;
        match result {
            Ok(released) => {
                count_released(released);
                if released > 0 {
                    tracing::info!(
                        rows = released,
                        "gave back rows leased to this process by a claim whose answer was lost; their lanes can be claimed again"
                    );
                }
                Ok(released)
            }
            Err(error) => {
                self.claim_failed();
                Err(error)
            }
        }
    }

    /// Work rows currently leased to this process (their leases are renewed).
    pub fn rows(&self) -> Vec<Uuid> {
        self.lock().rows.keys().copied().collect()
    }

    /// Rows leased to this process that a handler has seen.
    pub fn started_rows(&self) -> Vec<Uuid> {
        self.lock()
            .rows
            .iter()
            .filter(|(_, h)| h.started)
            .map(|(id, _)| *id)
            .collect()
    }

    /// Registers the server process of a batch transaction until the guard is dropped.
    pub fn register_backend(self: &Arc<Self>, pid: i32) -> BackendGuard {
        self.lock().backends.insert(pid);
        BackendGuard {
            owner: Arc::clone(self),
            pid,
        }
    }

    /// Server processes of batch transactions running now.
    pub fn backends(&self) -> Vec<i32> {
        self.lock().backends.iter().copied().collect()
    }

    /// Number of lanes reserved.
    pub fn lanes_reserved(&self) -> usize {
        self.lock().lanes.len()
    }

    /// Extends the leases of every row recorded here (the renewal loop, while slow applies run):
    /// returns how many rows were recorded and how many leases were still ours.
    pub async fn renew(
        &self,
        store: &Store,
        instance: InstanceId,
        lease: std::time::Duration,
    ) -> Result<(usize, u64), StoreError> {
        let rows = self.rows();
        if rows.is_empty() {
            return Ok((0, 0));
        }
        let renewed = leases::renew_leases(store.pool(), instance, &rows, lease).await?;
        Ok((rows.len(), renewed))
    }

    /// Takes the leases of batches abandoned at shutdown out of the record at once (before their
    /// tasks are aborted): [`Abandoned`] then cancels their statements and gives their started
    /// rows back. The one owner of leases once no batch does.
    pub fn abandon(&self) -> Abandoned {
        let mut inner = self.lock();
        let started = inner
            .rows
            .iter()
            .filter(|(_, h)| h.started)
            .map(|(id, _)| *id)
            .chain(inner.owed.iter().filter(|(_, s)| **s).map(|(id, _)| *id))
            .collect();
        inner.rows.clear();
        // (The unstarted ones owed go back with deregistration, refunded.)
        inner.owed.clear();
        Abandoned {
            started,
            backends: inner.backends.iter().copied().collect(),
        }
    }
}

/// What abandoned batches held: their server processes and the rows their handlers saw.
#[derive(Debug)]
pub struct Abandoned {
    started: Vec<Uuid>,
    backends: Vec<i32>,
}

impl Abandoned {
    /// Cancels the statements the abandoned batches run, so their transactions roll back and
    /// release their locks.
    pub async fn cancel_statements<S: WorkStore>(&self, store: &S) {
        for pid in &self.backends {
            if let Err(error) = store.cancel_backend(*pid).await {
                tracing::debug!(%error, pid, "could not cancel a batch statement");
            }
        }
    }

    /// Gives back the rows a handler saw, without a refund (the attempt was used), fenced on
    /// `instance`; counted once it is done. Returns how many were still ours.
    pub async fn give_back<S: WorkStore>(
        &self,
        store: &S,
        instance: InstanceId,
    ) -> Result<u64, StoreError> {
        if self.started.is_empty() {
            return Ok(0);
        }
        let released = store.release_started(instance, &self.started).await?;
        count_released(released);
        Ok(released)
    }
}

/// Counts rows given back (once each, after the give-back committed).
pub(crate) fn count_released(n: u64) {
    if n > 0 {
        metrics::counter!(crate::telemetry::metrics::LEASES_RELEASED_TOTAL).increment(n);
    }
}

/// Keeps a batch's server process listed in [`InFlight::backends`] while it runs.
#[derive(Debug)]
pub struct BackendGuard {
    owner: Arc<InFlight>,
    pid: i32,
}

impl BackendGuard {
    /// The server process id.
    pub fn pid(&self) -> i32 {
        self.pid
    }
}

impl Drop for BackendGuard {
    fn drop(&mut self) {
        self.owner.lock().backends.remove(&self.pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(perspective: &str, stream_id: Uuid) -> WorkRow {
        WorkRow::sample(perspective, stream_id)
    }

    #[test]
    fn a_lane_is_reserved_by_one_loop_at_a_time_and_a_row_is_recorded_once() {
        let inflight = InFlight::new();
        let s = Uuid::new_v4();
        let a = row("P", s);
        let first = inflight.record(std::slice::from_ref(&a));
        assert!(first.give_back.is_empty());
        assert_eq!(first.lanes.len(), 1);
        // Another perspective's lane of the same stream is another lane; a row of a lane the
        // first batch holds is recorded for the second only to be given back.
        let a_again = row("P", s);
        let b = row("Q", s);
        let second = inflight.record(&[a_again.clone(), b.clone()]);
        assert_eq!(second.give_back, vec![a_again.event_work_id]);
        assert_eq!(second.lanes, vec![LaneKey::of(&b)]);
        // The first batch's own row, re-leased by the second claim, stays the first batch's.
        let third = inflight.record(std::slice::from_ref(&a));
        assert!(third.theirs.contains(&a.event_work_id));
        assert!(inflight.holds(first.batch, a.event_work_id));
        assert!(!inflight.holds(third.batch, a.event_work_id));
        assert_eq!(inflight.rows().len(), 3);
        inflight.end(first.batch, &first.lanes);
        inflight.end(third.batch, &third.lanes);
        assert_eq!(inflight.rows().len(), 2);
        inflight.end(second.batch, &second.lanes);
        assert!(inflight.rows().is_empty());
        assert_eq!(inflight.lanes_reserved(), 0);
    }

    /// The soak's RSS steps: after a burst (a catch-up after an outage: every loop's batch full,
    /// rows owed), the maps of rows and lanes kept their peak size for good, half a megabyte
    /// and more each time a larger burst came.
    #[test]
    fn after_a_burst_the_record_gives_its_memory_back() {
        let inflight = InFlight::new();
        let rows: Vec<WorkRow> = (0..5000).map(|_| row("P", Uuid::new_v4())).collect();
        let batch = inflight.record(&rows);
        let ids: Vec<Uuid> = rows.iter().map(|r| r.event_work_id).collect();
        let (rows_at_peak, lanes_at_peak) = {
            let inner = inflight.lock();
            (inner.rows.capacity(), inner.lanes.capacity())
        };
        inflight.forget(batch.batch, &ids[..4990]);
        inflight.end(batch.batch, &batch.lanes);
        let inner = inflight.lock();
        assert!(inner.rows.is_empty() && inner.lanes.is_empty());
        assert!(
            inner.rows.capacity() < rows_at_peak / 16
                && inner.lanes.capacity() < lanes_at_peak / 16,
            "rows {} of {rows_at_peak}, lanes {} of {lanes_at_peak}",
            inner.rows.capacity(),
            inner.lanes.capacity()
        );
        // The ten rows the batch did not settle are owed, and the owed map is not kept at a
        // burst's size either once given back (settle_owed takes it whole).
        assert_eq!(inner.owed.len(), 10);
    }

    /// The 60-minute soak's RSS slope: every row a terminated session's pass had forgiven stayed
    /// remembered (up to 50 000) after it completed, and the map kept its peak size for good.
    #[test]
    fn a_forgiven_row_is_forgotten_when_it_leaves_the_work_table() {
        let inflight = InFlight::new();
        let rows = fresh_rows(5000);
        let ids: Vec<Uuid> = rows.iter().map(|r| r.event_work_id).collect();
        assert_eq!(pass_dies_at_its_own_step(&inflight, &rows, 10), 5000);
        assert_eq!(inflight.forgiven(), 5000);
        let capacity = inflight.lock().forgiven.capacity();
        inflight.gone(&ids[..4990]);
        assert_eq!(inflight.forgiven(), 10);
        assert!(inflight.lock().forgiven.capacity() < capacity / 16);
        // A row still in the table keeps its count: its budget is not reset by others leaving.
        assert_eq!(pass_dies_at_its_own_step(&inflight, &rows[4995..], 1), 0);
    }

    fn fresh_rows(n: usize) -> Vec<WorkRow> {
        (0..n).map(|_| row("P", Uuid::new_v4())).collect()
    }

    /// A batch of `rows` whose handlers saw every row, and whose pass then died with its
    /// session at a step of its own: its rows are forgiven (within `budget`) and the batch
    /// ends. Returns how many were forgiven.
    fn pass_dies_at_its_own_step(inflight: &InFlight, rows: &[WorkRow], budget: u32) -> usize {
        let batch = inflight.record(rows);
        let ids: Vec<Uuid> = rows.iter().map(|r| r.event_work_id).collect();
        inflight.set_started(batch.batch, ids.iter().copied(), true);
        let forgiven = inflight.forgive_started(batch.batch, budget);
        inflight.forget(batch.batch, &ids);
        inflight.end(batch.batch, &batch.lanes);
        forgiven
    }

    /// The soaks' terminate step (RELIABILITY.md, "What the terminate step is made of"): a row
    /// forgiven here and then completed by another instance is never seen leaving, so such
    /// rows piled up to the cap (50 000, about 2 MiB with the map's room, kept after a clear).
    #[test]
    fn rows_forgiven_here_and_completed_elsewhere_keep_little_memory() {
        let inflight = InFlight::new();
        for _ in 0..20 {
            assert_eq!(
                pass_dies_at_its_own_step(&inflight, &fresh_rows(1000), 10),
                1000
            );
            // Another instance claims and completes them: `gone` is never called for them.
            let inner = inflight.lock();
            assert!(
                inner.forgiven.len() <= 5000 && inner.forgiven.capacity() <= 7168,
                "{} forgiven rows remembered, room for {}",
                inner.forgiven.len(),
                inner.forgiven.capacity()
            );
        }
    }

    /// After a storm of cut sessions a daemon kept the rows it had forgiven and another
    /// instance then completed (never seen leaving here) for the rest of its life: the step of
    /// resident memory every 60-minute soak showed in its terminate phase. Two generations
    /// later they are forgotten, and their memory goes with them.
    #[test]
    fn rows_forgiven_and_completed_elsewhere_are_forgotten_two_generations_later() {
        let inflight = InFlight::new();
        // Another instance claims and completes them: `gone` is never called for them.
        assert_eq!(
            pass_dies_at_its_own_step(&inflight, &fresh_rows(3000), 10),
            3000
        );
        let start = Instant::now();
        let mut inner = inflight.lock();
        inner.forgiven.age(start + Forgiven::GENERATION);
        assert_eq!(
            inner.forgiven.len(),
            3000,
            "one generation on: still remembered"
        );
        inner.forgiven.age(start + 2 * Forgiven::GENERATION);
        assert_eq!(
            (inner.forgiven.len(), inner.forgiven.capacity()),
            (0, 0),
            "two generations on: forgotten, with the room they took"
        );
    }

    /// A row forgiven again in the next generation keeps its count: ageing never gives a row
    /// that keeps killing its session its budget again.
    #[test]
    fn a_row_forgiven_again_carries_its_count_into_the_next_generation() {
        let inflight = InFlight::new();
        let rows = fresh_rows(1);
        let forgive = |budget| pass_dies_at_its_own_step(&inflight, &rows, budget);
        assert_eq!(forgive(2), 1);
        let start = Instant::now();
        inflight.lock().forgiven.age(start + Forgiven::GENERATION);
        assert_eq!(forgive(2), 1);
        inflight
            .lock()
            .forgiven
            .age(start + 2 * Forgiven::GENERATION);
        assert_eq!(forgive(2), 0, "a budget of two, spent across generations");
    }
}
