//! The steady producer: appends at a given rate over many streams, one event per stream per
//! statement, each append recorded in `soak_produced` by the same statement. A share of the
//! streams ("poison streams") also receives poison events for one perspective. The rate and the
//! poison share can change while it runs (the load and poison-burst phases). An append that
//! fails (the database restarted, backends terminated) is counted and not retried: what was
//! appended is exactly what `soak_produced` holds.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use crate::store::soak::{SoakEvent, SoakStore};

/// Event types: every perspective takes `Tick`; the rebuilt one takes only `Rare`.
pub const TICK: &str = "Tick";
/// The rare type (one event in twenty).
pub const RARE: &str = "Rare";

/// How often the producer appends (a batch per tick).
const TICK_INTERVAL: Duration = Duration::from_millis(50);

/// What the producer is asked to do, shared with the phases.
#[derive(Debug)]
pub struct Knobs {
    /// Events per second.
    pub rate: AtomicU64,
    /// Poison events per million events.
    pub poison_ppm: AtomicU64,
    /// Set to stop.
    pub stop: AtomicBool,
    /// Events appended so far.
    pub appended: AtomicU64,
    /// Batches whose append failed.
    pub failed_batches: AtomicU64,
}

impl Knobs {
    /// Knobs for `rate` events/s with `poison_ppm` poison events per million.
    pub fn new(rate: u64, poison_ppm: u64) -> Arc<Knobs> {
        Arc::new(Knobs {
            rate: AtomicU64::new(rate),
            poison_ppm: AtomicU64::new(poison_ppm),
            stop: AtomicBool::new(false),
            appended: AtomicU64::new(0),
            failed_batches: AtomicU64::new(0),
        })
    }
}

/// The streams and who they poison.
#[derive(Clone, Debug)]
pub struct Streams {
    /// Every stream id.
    pub ids: Vec<Uuid>,
    /// The first `poison_streams` of them may receive poison events.
    pub poison_streams: usize,
    /// The perspective the poison events are for.
    pub poisoned: String,
}

/// A small deterministic generator (xorshift64*): the soak needs spread, not cryptography.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeded with `seed` (zero is replaced).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Picks `n` distinct streams (n ≤ number of streams) and their events.
pub fn batch(streams: &Streams, n: usize, poison_ppm: u64, rng: &mut Rng) -> Vec<SoakEvent> {
    let total = streams.ids.len();
    let n = n.min(total);
    // Poison goes to poison streams only, so its share there is scaled up.
    let poison_share_in_stream = if streams.poison_streams == 0 {
        0
    } else {
        poison_ppm * total as u64 / streams.poison_streams as u64
    };
    let mut picked = std::collections::HashSet::with_capacity(n);
    let mut events = Vec::with_capacity(n);
    while events.len() < n {
        let i = rng.below(total as u64) as usize;
        if !picked.insert(i) {
            continue;
        }
        let poison_stream = i < streams.poison_streams;
        let poison = (poison_stream && rng.below(1_000_000) < poison_share_in_stream)
            .then(|| streams.poisoned.clone());
        let event_type = if rng.below(20) == 0 { RARE } else { TICK };
        events.push(SoakEvent {
            stream_id: streams.ids[i],
            event_type,
            poison,
            poison_stream,
        });
    }
    events
}

/// Appends until `knobs.stop`, keeping the asked rate on average (a slow append is caught up
/// on the next ticks, up to one second's worth at once).
pub async fn run(db: SoakStore, streams: Streams, knobs: Arc<Knobs>, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut owed = 0.0f64;
    let mut last = Instant::now();
    let mut tick = tokio::time::interval(TICK_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !knobs.stop.load(Ordering::SeqCst) {
        tick.tick().await;
        let now = Instant::now();
        let rate = knobs.rate.load(Ordering::Relaxed) as f64;
        owed = (owed + rate * now.duration_since(last).as_secs_f64()).min(rate.max(1.0));
        last = now;
        let n = owed.floor() as usize;
        if n == 0 {
            continue;
        }
        let events = batch(
            &streams,
            n,
            knobs.poison_ppm.load(Ordering::Relaxed),
            &mut rng,
        );
        owed -= events.len() as f64;
        match tokio::time::timeout(Duration::from_secs(30), db.append(&events)).await {
            Ok(Ok(done)) => {
                knobs.appended.fetch_add(done, Ordering::Relaxed);
            }
            _ => {
                knobs.failed_batches.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_has_distinct_streams_and_poison_only_on_poison_streams() {
        let streams = Streams {
            ids: (0..100).map(|_| Uuid::new_v4()).collect(),
            poison_streams: 10,
            poisoned: "p".into(),
        };
        let mut rng = Rng::new(7);
        let mut poison = 0;
        for _ in 0..200 {
            let b = batch(&streams, 50, 100_000, &mut rng);
            let distinct: std::collections::HashSet<_> = b.iter().map(|e| e.stream_id).collect();
            assert_eq!(distinct.len(), 50);
            for e in &b {
                if e.poison.is_some() {
                    assert!(e.poison_stream);
                    poison += 1;
                }
            }
        }
        // 10 % of 10 000 events, all on the tenth of streams that may get them.
        assert!((700..1300).contains(&poison), "{poison}");
        assert_eq!(batch(&streams, 500, 0, &mut rng).len(), 100);
    }
}
