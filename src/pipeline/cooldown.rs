//! The cooldown stage and its cache (seed: `RecentlyProcessedEventCache`; docs/pipeline.md,
//! "The cooldown cache").
//!
//! The stage, [`cooled`], runs between the envelopes and the apply stage: it says which rows of
//! the batch were applied recently, and the apply stage completes those without applying them.
//!
//! Remembers the `event_work_id`s applied recently so that a row claimed again before its
//! completion became visible (completion lost, or still in flight) is completed without being
//! re-applied. It is an optimisation, not a correctness primitive: SQL perspectives get
//! exactly-once from applying and completing in one transaction.
//!
//! Keyed by work id, which is per (event, perspective), so marking one perspective never cools
//! another. Entries expire after `ttl` (lazily on lookup, and by [`CooldownCache::sweep`]); when
//! the cache is full the oldest tenth is evicted.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use uuid::Uuid;

/// The cooldown stage: which of `events` were applied recently (looked up under one lock).
/// Without a cache (disabled), none.
pub fn cooled(
    cache: Option<&CooldownCache>,
    events: &[crate::perspective::EventEnvelope],
) -> std::collections::HashSet<Uuid> {
    match cache {
        Some(cache) => cache
            .cooled_among(events.iter().map(|e| e.event_work_id))
            .into_iter()
            .collect(),
        None => Default::default(),
    }
}

/// A source of monotonic time, injected so tests can move time by hand.
pub trait Clock: Send + Sync {
    /// The current instant; must never go backwards.
    fn now(&self) -> Instant;
}

/// The real monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// Lets one clock be shared between a cache and the test that drives it.
impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Instant {
        (**self).now()
    }
}

/// A clock that only moves when told to, for tests.
#[derive(Debug)]
pub struct ManualClock {
    start: Instant,
    offset_nanos: AtomicU64,
}

impl ManualClock {
    /// A clock frozen at the current instant.
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
            offset_nanos: AtomicU64::new(0),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.offset_nanos
            .fetch_add(saturating_nanos(by), Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.start + Duration::from_nanos(self.offset_nanos.load(Ordering::SeqCst))
    }
}

/// The recently-applied work ids, bounded in time (`ttl`) and size (`max_entries`).
///
/// Thread-safe behind one mutex: it is touched once per event, briefly, and every operation is
/// O(1) amortised. Its memory is reserved (and made resident) at start: two 32-byte map slots
/// and two 24-byte queue slots per entry of `max_entries`, about 13 MiB for 100 000.
pub struct CooldownCache<C: Clock = SystemClock> {
    ttl_nanos: u64,
    max_entries: usize,
    clock: C,
    /// Times are nanoseconds since `epoch` (u64, not `Instant`): 8 bytes instead of 16 per
    /// entry, and 584 years of range.
    epoch: Instant,
    inner: Mutex<Inner>,
}

#[derive(Clone, Copy)]
struct Entry {
    /// When it was last marked, in nanoseconds since the epoch.
    at: u64,
    /// Which mark that was: matches exactly one pair in `Inner::order`.
    seq: u64,
}

/// Hashes a work id by mixing its two halves (a 64-bit finaliser, as in MurmurHash3): the
/// standard SipHash was a tenth of the daemon's CPU in this cache, touched several times per
/// event. Work ids are random (`gen_random_uuid()`) or at least unique, and the cache is
/// bounded, so flooding resistance buys nothing here; the finaliser still spreads ids that
/// differ in any bit (sequential or time-ordered ones) over the whole table. The in-flight
/// record ([`super::inflight`]) keys its rows by work id with it too ([`IdMap`]).
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

/// A map keyed by work id, hashed with [`IdHasher`].
pub(crate) type IdMap<V> = HashMap<Uuid, V, BuildHasherDefault<IdHasher>>;

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0.rotate_left(29) ^ u64::from_le_bytes(word))
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_usize(&mut self, n: usize) {
        // (the length prefix of the id's bytes: the same for every key)
        self.0 ^= n as u64;
    }

    fn finish(&self) -> u64 {
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        h ^= h >> 33;
        h = h.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
        h ^ (h >> 33)
    }
}

#[derive(Default)]
struct Inner {
    /// Work id → its latest mark. The source of truth for membership.
    entries: IdMap<Entry>,
    /// `(work id, mark seq)` in mark order, oldest first, hence also in time order. A re-mark
    /// pushes a new pair and leaves the old one behind; a pair whose seq is not the entry's
    /// is stale and skipped when popped. (A sequence number rather than the time tells them
    /// apart even when two marks happen at the same instant.)
    order: VecDeque<(Uuid, u64)>,
    next_seq: u64,
}

/// Stale queue pairs tolerated beyond two per entry before the queue is compacted.
const QUEUE_SLACK: usize = 64;
/// Caches larger than this grow as they fill instead of reserving everything at start.
const RESERVED_ENTRIES_MAX: usize = 4_000_000;

impl Inner {
    /// Room for `max_entries` reserved at start, so that a full cache's memory never changes
    /// afterwards. The map gets twice the room it needs: removals leave tombstones, and a map
    /// more than half full of live entries grows (doubling, mid-run) instead of clearing them in
    /// place. The queue holds at most two pairs per entry plus slack
    /// ([`Inner::compact_if_bloated`] runs after every push).
    ///
    /// The reserved memory is also written once here, so that it is resident from the start:
    /// otherwise the process's resident size climbs for minutes as the queue's ring and the
    /// map's slots are first touched, which looks like a leak on a memory graph (and hides one
    /// in the first minutes of a soak's slope).
    fn with_room_for(max_entries: usize) -> Self {
        let reserved = max_entries.min(RESERVED_ENTRIES_MAX);
        if reserved == 0 {
            return Self::default();
        }
        let mut entries = IdMap::with_capacity_and_hasher(2 * reserved + 2, Default::default());
        let room = entries.capacity();
        // (exactly `capacity()` inserts never grow the map; the ids are spread by the hasher
        //  over every slot, and `clear` keeps the table)
        for i in 0..room {
            entries.insert(Uuid::from_u128(i as u128), Entry { at: 0, seq: 0 });
        }
        entries.clear();
        debug_assert_eq!(entries.capacity(), room);
        let mut order = VecDeque::with_capacity(2 * reserved + QUEUE_SLACK + 2);
        order.resize(order.capacity(), (Uuid::nil(), 0));
        order.clear();
        Self {
            entries,
            order,
            next_seq: 0,
        }
    }

    /// The time of the queue pair `(id, seq)` if it is still the live mark of `id`.
    fn live_at(&self, id: &Uuid, seq: u64) -> Option<u64> {
        self.entries
            .get(id)
            .filter(|entry| entry.seq == seq)
            .map(|entry| entry.at)
    }

    /// Drops expired entries from the front of the queue (and stale pairs on the way).
    fn pop_expired(&mut self, now: u64, ttl: u64) -> usize {
        let mut removed = 0;
        while let Some(&(id, seq)) = self.order.front() {
            if let Some(at) = self.live_at(&id, seq) {
                if now.saturating_sub(at) < ttl {
                    break;
                }
                self.entries.remove(&id);
                removed += 1;
            }
            self.order.pop_front();
        }
        removed
    }

    /// Evicts the `n` oldest entries.
    fn evict_oldest(&mut self, n: usize) {
        let mut evicted = 0;
        while evicted < n {
            let Some((id, seq)) = self.order.pop_front() else {
                break;
            };
            if self.live_at(&id, seq).is_some() {
                self.entries.remove(&id);
                evicted += 1;
            }
        }
    }

    /// Rebuilds the queue without stale pairs once they outnumber live ones, so re-marks and
    /// lazy removals cannot grow it without bound. Amortised O(1): it runs only after as many
    /// stale pairs as live entries have piled up.
    fn compact_if_bloated(&mut self) {
        if self.order.len() > 2 * self.entries.len() + QUEUE_SLACK {
            let entries = &self.entries;
            self.order
                .retain(|(id, seq)| entries.get(id).is_some_and(|e| e.seq == *seq));
        }
    }
}

impl CooldownCache {
    /// A cache on the system clock. `max_entries == 0` makes it remember nothing.
    pub fn new(ttl: Duration, max_entries: usize) -> Self {
        Self::with_clock(ttl, max_entries, SystemClock)
    }
}

impl<C: Clock> CooldownCache<C> {
    /// A cache on the given clock.
    pub fn with_clock(ttl: Duration, max_entries: usize, clock: C) -> Self {
        let epoch = clock.now();
        Self {
            ttl_nanos: saturating_nanos(ttl),
            max_entries,
            clock,
            epoch,
            inner: Mutex::new(Inner::with_room_for(max_entries)),
        }
    }

    /// Records that `work_id` was just applied (call right after a successful apply, before
    /// the completion is written). Re-marking refreshes the entry's time.
    ///
    /// When the cache is full, expired entries go first; if that frees nothing, the oldest
    /// tenth (at least one) is evicted.
    pub fn mark(&self, work_id: Uuid) {
        if self.max_entries == 0 {
            return;
        }
        let now = self.now();
        let mut inner = self.lock();
        let seq = inner.next_seq;
        inner.next_seq += 1;
        // Queued before making room, so the entry just marked, the newest, is never evicted.
        inner.order.push_back((work_id, seq));
        let entry = Entry { at: now, seq };
        if inner.entries.insert(work_id, entry).is_none() && inner.entries.len() > self.max_entries
        {
            inner.pop_expired(now, self.ttl_nanos);
            if inner.entries.len() > self.max_entries {
                inner.evict_oldest((self.max_entries / 10).max(1));
            }
        }
        inner.compact_if_bloated();
    }

    /// Whether `work_id` was marked less than `ttl` ago. An expired entry is removed here and
    /// reports `false`.
    pub fn is_cooled(&self, work_id: Uuid) -> bool {
        let now = self.now();
        let mut inner = self.lock();
        match inner.entries.get(&work_id) {
            Some(entry) if now.saturating_sub(entry.at) < self.ttl_nanos => true,
            Some(_) => {
                // Its queue pair turns stale and is skipped later.
                inner.entries.remove(&work_id);
                false
            }
            None => false,
        }
    }

    /// [`CooldownCache::mark`] for many work ids at once (one lock, one clock read: a batch's
    /// marks, not one lock per event).
    pub fn mark_all(&self, work_ids: &[Uuid]) {
        if self.max_entries == 0 || work_ids.is_empty() {
            return;
        }
        let now = self.now();
        let mut inner = self.lock();
        for &work_id in work_ids {
            let seq = inner.next_seq;
            inner.next_seq += 1;
            inner.order.push_back((work_id, seq));
            let entry = Entry { at: now, seq };
            if inner.entries.insert(work_id, entry).is_none()
                && inner.entries.len() > self.max_entries
            {
                inner.pop_expired(now, self.ttl_nanos);
                if inner.entries.len() > self.max_entries {
                    inner.evict_oldest((self.max_entries / 10).max(1));
                }
            }
            // (after every push: the queue stays within the room reserved for it)
            inner.compact_if_bloated();
        }
    }

    /// The work ids among `work_ids` that [`CooldownCache::is_cooled`] would report, looked
    /// up under one lock (expired entries are removed, as there).
    pub fn cooled_among(&self, work_ids: impl IntoIterator<Item = Uuid>) -> Vec<Uuid> {
        let now = self.now();
        let mut inner = self.lock();
        if inner.entries.is_empty() {
            return Vec::new();
        }
        let mut cooled = Vec::new();
        for work_id in work_ids {
            match inner.entries.get(&work_id) {
                Some(entry) if now.saturating_sub(entry.at) < self.ttl_nanos => {
                    cooled.push(work_id)
                }
                Some(_) => {
                    inner.entries.remove(&work_id);
                }
                None => {}
            }
        }
        cooled
    }

    /// Drops the mark of `work_id`: its apply was rolled back with the transaction, so the
    /// row must be applied again when it is re-claimed.
    pub fn forget(&self, work_id: Uuid) {
        let mut inner = self.lock();
        // Its queue pair turns stale and is skipped later.
        inner.entries.remove(&work_id);
        inner.compact_if_bloated();
    }

    /// Removes every expired entry; returns how many. Run periodically so an idle daemon
    /// releases the memory of entries nobody looks up again.
    pub fn sweep(&self) -> usize {
        let now = self.now();
        let mut inner = self.lock();
        let removed = inner.pop_expired(now, self.ttl_nanos);
        inner.compact_if_bloated();
        removed
    }

    /// The capacities of the map and the queue (tests: they never change).
    #[cfg(test)]
    fn capacities(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.entries.capacity(), inner.order.capacity())
    }

    /// Number of entries, expired ones not yet removed included.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether the cache holds no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn now(&self) -> u64 {
        saturating_nanos(self.clock.now().saturating_duration_since(self.epoch))
    }

    /// A panic while the lock was held cannot leave the maps inconsistent in a way that
    /// matters (worst case a stale queue pair), so a poisoned lock is used as is rather than
    /// spreading the panic to every consumer.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<C: Clock> fmt::Debug for CooldownCache<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CooldownCache")
            .field("ttl", &Duration::from_nanos(self.ttl_nanos))
            .field("max_entries", &self.max_entries)
            .field("len", &self.len())
            .finish()
    }
}

fn saturating_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(300);

    fn cache(max_entries: usize) -> (Arc<ManualClock>, CooldownCache<Arc<ManualClock>>) {
        let clock = Arc::new(ManualClock::new());
        let cache = CooldownCache::with_clock(TTL, max_entries, Arc::clone(&clock));
        (clock, cache)
    }

    fn ids(n: usize) -> Vec<Uuid> {
        (0..n).map(|_| Uuid::new_v4()).collect()
    }

    #[test]
    fn forget_uncools_only_that_id() {
        let (_clock, cache) = cache(10);
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        cache.mark(a);
        cache.mark(b);
        cache.forget(a);
        assert!(!cache.is_cooled(a));
        assert!(cache.is_cooled(b));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn marked_is_cooled_until_ttl() {
        let (clock, cache) = cache(10);
        let id = Uuid::new_v4();
        assert!(!cache.is_cooled(id));
        cache.mark(id);
        assert!(cache.is_cooled(id));
        clock.advance(TTL - Duration::from_nanos(1));
        assert!(cache.is_cooled(id));
        clock.advance(Duration::from_nanos(1));
        assert!(!cache.is_cooled(id));
        // Lazy expiry removed it.
        assert!(cache.is_empty());
    }

    #[test]
    fn different_work_ids_are_independent() {
        // Two perspectives' rows of one event have different work ids.
        let (_clock, cache) = cache(10);
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        cache.mark(a);
        assert!(cache.is_cooled(a));
        assert!(!cache.is_cooled(b));
    }

    #[test]
    fn overflow_evicts_the_oldest_tenth_and_keeps_the_newest() {
        let (clock, cache) = cache(100);
        let ids = ids(101);
        for id in &ids[..100] {
            cache.mark(*id);
            clock.advance(Duration::from_millis(1));
        }
        assert_eq!(cache.len(), 100);
        cache.mark(ids[100]);
        assert_eq!(cache.len(), 91);
        for id in &ids[..10] {
            assert!(!cache.is_cooled(*id));
        }
        for id in &ids[10..] {
            assert!(cache.is_cooled(*id));
        }
    }

    #[test]
    fn overflow_evicts_at_least_one() {
        let (_clock, cache) = cache(3);
        let ids = ids(4);
        for id in &ids {
            cache.mark(*id);
        }
        assert_eq!(cache.len(), 3);
        assert!(!cache.is_cooled(ids[0]));
        assert!(ids[1..].iter().all(|id| cache.is_cooled(*id)));
    }

    #[test]
    fn overflow_drops_expired_entries_before_live_ones() {
        let (clock, cache) = cache(10);
        let old = ids(5);
        let fresh = ids(6);
        for id in &old {
            cache.mark(*id);
        }
        clock.advance(TTL);
        for id in &fresh {
            cache.mark(*id);
        }
        // 11 > 10: the 5 expired ones went, no live one was evicted.
        assert_eq!(cache.len(), 6);
        assert!(fresh.iter().all(|id| cache.is_cooled(*id)));
    }

    #[test]
    fn sweep_removes_only_expired() {
        let (clock, cache) = cache(10);
        let (old, young) = (Uuid::new_v4(), Uuid::new_v4());
        cache.mark(old);
        clock.advance(TTL / 2);
        cache.mark(young);
        clock.advance(TTL / 2);
        assert_eq!(cache.sweep(), 1);
        assert_eq!(cache.len(), 1);
        assert!(cache.is_cooled(young));
        assert_eq!(cache.sweep(), 0);
        clock.advance(TTL);
        assert_eq!(cache.sweep(), 1);
        assert!(cache.is_empty());
    }

    #[test]
    fn re_mark_refreshes_the_entry() {
        let (clock, cache) = cache(10);
        let id = Uuid::new_v4();
        cache.mark(id);
        clock.advance(TTL / 2);
        cache.mark(id);
        assert_eq!(cache.len(), 1);
        clock.advance(TTL / 2);
        // Past the first mark's ttl, within the second's.
        assert_eq!(cache.sweep(), 0);
        assert!(cache.is_cooled(id));
        clock.advance(TTL / 2);
        assert!(!cache.is_cooled(id));
    }

    #[test]
    fn re_mark_moves_the_entry_to_the_back_of_the_eviction_order() {
        let (clock, cache) = cache(10);
        let ids = ids(11);
        for id in &ids[..10] {
            cache.mark(*id);
            clock.advance(Duration::from_millis(1));
        }
        cache.mark(ids[0]);
        cache.mark(ids[10]);
        // ids[1] is now the oldest.
        assert!(cache.is_cooled(ids[0]));
        assert!(!cache.is_cooled(ids[1]));
        assert_eq!(cache.len(), 10);
    }

    #[test]
    fn repeated_re_marks_do_not_grow_the_queue() {
        let (_clock, cache) = cache(10);
        let id = Uuid::new_v4();
        for _ in 0..10_000 {
            cache.mark(id);
        }
        assert_eq!(cache.len(), 1);
        assert!(cache.lock().order.len() <= 2 + 64 + 1);
    }

    #[test]
    fn id_hasher_spreads_ids_that_differ_in_one_byte() {
        use std::hash::{BuildHasher, BuildHasherDefault};
        let build = BuildHasherDefault::<IdHasher>::default();
        let mut buckets = std::collections::HashSet::new();
        for i in 0..=255u8 {
            for at in [0usize, 7, 8, 15] {
                let mut bytes = [0u8; 16];
                bytes[at] = i;
                // the low bits pick the bucket: they must differ too
                buckets.insert((at, build.hash_one(Uuid::from_bytes(bytes)) & 0xFFFF));
            }
        }
        assert!(buckets.len() > 4 * 250, "{} distinct", buckets.len());
    }

    /// The soak's finding: a full cache's map doubled mid-run (its removals leave tombstones,
    /// and hashbrown grows rather than rehashes when they fill it past half), and its queue
    /// doubled when re-marks left stale pairs: steps of resident memory mid-run (the map's
    /// doubling, 4.3 → 8.6 MiB, in the catch-up after an outage).
    #[test]
    fn a_full_cache_under_churn_never_grows_its_memory() {
        const MAX: usize = 1_000;
        let (clock, cache) = cache(MAX);
        let at_start = cache.capacities();
        let mut ids_seen = Vec::new();
        for round in 0..200 {
            let batch = ids(MAX / 4);
            cache.mark_all(&batch);
            // Re-marks (stale pairs), lookups of expired entries (lazy removals), forgets
            // (removals in the middle of the map), and single marks beside the batches.
            cache.mark_all(&batch[..MAX / 8]);
            for id in &batch[MAX / 8..MAX / 8 + 20] {
                cache.forget(*id);
            }
            cache.mark(Uuid::new_v4());
            if round % 7 == 0 {
                clock.advance(TTL);
                cache.cooled_among(ids_seen.drain(..));
            }
            ids_seen.extend_from_slice(&batch);
            // (A map's capacity counts out its tombstones until it clears them in place: it may
            // dip, never rise.)
            let (map, queue) = cache.capacities();
            assert!(
                map <= at_start.0 && queue == at_start.1,
                "round {round}: capacities ({map}, {queue}) grew from {at_start:?}"
            );
            assert!(cache.len() <= MAX);
        }
    }

    #[test]
    fn a_new_cache_has_its_room_and_remembers_nothing() {
        let (_clock, cache) = cache(1_000);
        let room = cache.capacities();
        assert!(cache.is_empty());
        // (the ids written to make the memory resident are gone)
        assert!(!cache.is_cooled(Uuid::from_u128(0)));
        assert!(!cache.is_cooled(Uuid::from_u128(5)));
        cache.mark_all(&ids(1_000));
        assert_eq!(cache.len(), 1_000);
        assert_eq!(cache.capacities(), room);
    }

    #[test]
    fn zero_capacity_remembers_nothing() {
        let (_clock, cache) = cache(0);
        let id = Uuid::new_v4();
        cache.mark(id);
        assert!(!cache.is_cooled(id));
        assert!(cache.is_empty());
    }

    #[test]
    fn shared_across_threads() {
        let cache = Arc::new(CooldownCache::new(TTL, 100_000));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let cache = Arc::clone(&cache);
                std::thread::spawn(move || {
                    for id in ids(1_000) {
                        cache.mark(id);
                        assert!(cache.is_cooled(id));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(cache.len(), 4_000);
    }

    #[test]
    fn batch_marks_and_lookups_agree_with_single_ones() {
        let clock = Arc::new(ManualClock::new());
        let cache = CooldownCache::with_clock(Duration::from_secs(10), 3, Arc::clone(&clock));
        let ids: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
        cache.mark_all(&ids[..2]);
        assert_eq!(cache.cooled_among(ids.iter().copied()), ids[..2].to_vec());
        // Full: marking two more evicts the oldest, as one mark at a time would.
        cache.mark_all(&ids[2..]);
        let cooled = cache.cooled_among(ids.iter().copied());
        assert!(
            !cooled.contains(&ids[0]) && cooled.contains(&ids[3]),
            "{cooled:?}"
        );
        assert!(cooled.iter().all(|id| cache.is_cooled(*id)));
        clock.advance(Duration::from_secs(10));
        assert!(
            cache.cooled_among(ids.iter().copied()).is_empty(),
            "expired"
        );
        assert_eq!(cache.len(), 0, "expired entries are removed by the lookup");
    }
}
