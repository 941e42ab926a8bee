//! What this process is working on right now.
//!
//! All consumer loops of a process share one lease holder id, so the database cannot tell them
//! apart: a lane is reserved here by one loop at a time, and the rows in flight are listed so
//! the renewal loop can keep their leases alive while a slow apply runs.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};

use uuid::Uuid;

use crate::store::WorkRow;

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

/// Lanes reserved by consumer loops and work rows in flight, for one process.
#[derive(Debug, Default)]
pub struct InFlight {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    lanes: HashSet<LaneKey>,
    rows: HashSet<Uuid>,
    /// Rows a handler has seen under their current lease (given back without a refund).
    started: HashSet<Uuid>,
    /// Server processes running a batch transaction right now (cancelled at an abandoned
    /// shutdown so their transactions roll back and release their locks).
    backends: HashSet<i32>,
}

impl InFlight {
    /// An empty registry.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reserves the lanes not already reserved by another loop. Returns the reservation
    /// (released on drop) and the lanes that were taken.
    pub fn reserve(self: &Arc<Self>, lanes: &[LaneKey]) -> (Reservation, Vec<LaneKey>) {
        let mut inner = self.lock();
        let mut mine = Vec::new();
        let mut taken = Vec::new();
        for l in lanes {
            if inner.lanes.insert(l.clone()) {
                mine.push(l.clone());
            } else if !mine.contains(l) {
                taken.push(l.clone());
            }
        }
        (
            Reservation {
                owner: Arc::clone(self),
                lanes: mine,
                rows: Vec::new(),
            },
            taken,
        )
    }

    /// Work rows currently in flight (their leases are renewed).
    pub fn rows(&self) -> Vec<Uuid> {
        self.lock().rows.iter().copied().collect()
    }

    /// Rows in flight that a handler has seen.
    pub fn started_rows(&self) -> Vec<Uuid> {
        let inner = self.lock();
        inner
            .started
            .iter()
            .filter(|r| inner.rows.contains(r))
            .copied()
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
}

/// Lanes (and their rows in flight) held by one consumer loop; released on drop, so a loop
/// that errors out can never leave a lane reserved.
#[derive(Debug)]
pub struct Reservation {
    owner: Arc<InFlight>,
    lanes: Vec<LaneKey>,
    rows: Vec<Uuid>,
}

impl Reservation {
    /// The reserved lanes.
    pub fn lanes(&self) -> &[LaneKey] {
        &self.lanes
    }

    /// Lists rows as in flight (leases renewed until the reservation is dropped or they are done).
    pub fn track_rows(&mut self, rows: &[Uuid]) {
        let mut inner = self.owner.lock();
        inner.rows.extend(rows.iter().copied());
        drop(inner);
        self.rows.extend_from_slice(rows);
    }

    /// A row is done with (completed, failed, dead-lettered or given back): no more renewal.
    pub fn untrack(&mut self, row: &Uuid) {
        let mut inner = self.owner.lock();
        inner.rows.remove(row);
        inner.started.remove(row);
    }

    /// A handler is about to see this row.
    pub fn mark_started(&mut self, row: Uuid) {
        self.owner.lock().started.insert(row);
    }

    /// Undoes [`mark_started`](Self::mark_started): the row is handed over again later.
    pub fn unmark_started(&mut self, row: &Uuid) {
        self.owner.lock().started.remove(row);
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

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut inner = self.owner.lock();
        for l in &self.lanes {
            inner.lanes.remove(l);
        }
        for r in &self.rows {
            inner.rows.remove(r);
            inner.started.remove(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(perspective: &str, stream_id: Uuid) -> LaneKey {
        LaneKey {
            stream_id,
            perspective: perspective.to_string(),
        }
    }

    #[test]
    fn a_lane_is_reserved_by_one_loop_at_a_time() {
        let inflight = InFlight::new();
        let s = Uuid::new_v4();
        let (a, b) = (lane("P", s), lane("Q", s));
        let (mut first, taken) = inflight.reserve(std::slice::from_ref(&a));
        assert!(taken.is_empty());
        first.track_rows(&[Uuid::new_v4()]);
        // Another perspective's lane of the same stream is another lane.
        let (second, taken) = inflight.reserve(&[a.clone(), b.clone()]);
        assert_eq!(taken, vec![a.clone()]);
        assert_eq!(second.lanes(), &[b]);
        assert_eq!(inflight.rows().len(), 1);
        drop(first);
        assert!(inflight.rows().is_empty());
        let (third, taken) = inflight.reserve(std::slice::from_ref(&a));
        assert!(taken.is_empty());
        assert_eq!(third.lanes(), &[a]);
    }
}
