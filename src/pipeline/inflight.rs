//! What this process is working on right now.
//!
//! All consumer loops of a process share one lease holder id, so the database cannot tell them
//! apart: a stream is reserved here by one loop at a time, and the rows in flight are listed so
//! the renewal loop can keep their leases alive while a slow apply runs.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};

use uuid::Uuid;

/// Streams reserved by consumer loops and work rows in flight, for one process.
#[derive(Debug, Default)]
pub struct InFlight {
    inner: Mutex<Inner>,
    claim: tokio::sync::Mutex<()>,
}

#[derive(Debug, Default)]
struct Inner {
    streams: HashSet<Uuid>,
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

    /// Reserves the streams not already reserved by another loop. Returns the reservation
    /// (released on drop) and the streams that were taken.
    pub fn reserve(self: &Arc<Self>, streams: &[Uuid]) -> (Reservation, Vec<Uuid>) {
        let mut inner = self.lock();
        let mut mine = Vec::new();
        let mut taken = Vec::new();
        for s in streams {
            if inner.streams.insert(*s) {
                mine.push(*s);
            } else if !mine.contains(s) {
                taken.push(*s);
            }
        }
        (
            Reservation {
                owner: Arc::clone(self),
                streams: mine,
                rows: Vec::new(),
            },
            taken,
        )
    }

    /// Serialises "acquire lanes + reserve their streams" across the loops of this process.
    /// The claim skips streams where this instance already holds a valid head, so once one
    /// loop has reserved a stream, no other loop of ours acquires a lane of it; without the
    /// lock, two loops could acquire lanes of one stream at once and one would give back a
    /// head the other had already fetched as its own.
    pub async fn claim_lock(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.claim.lock().await
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

    /// Number of streams reserved.
    pub fn streams_reserved(&self) -> usize {
        self.lock().streams.len()
    }
}

/// Streams (and their rows in flight) held by one consumer loop; released on drop, so a loop
/// that errors out can never leave a stream reserved.
#[derive(Debug)]
pub struct Reservation {
    owner: Arc<InFlight>,
    streams: Vec<Uuid>,
    rows: Vec<Uuid>,
}

impl Reservation {
    /// The reserved streams.
    pub fn streams(&self) -> &[Uuid] {
        &self.streams
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
        for s in &self.streams {
            inner.streams.remove(s);
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

    #[test]
    fn a_stream_is_reserved_by_one_loop_at_a_time() {
        let inflight = InFlight::new();
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let (mut first, taken) = inflight.reserve(&[a]);
        assert!(taken.is_empty());
        first.track_rows(&[Uuid::new_v4()]);
        let (second, taken) = inflight.reserve(&[a, b]);
        assert_eq!(taken, vec![a]);
        assert_eq!(second.streams(), &[b]);
        assert_eq!(inflight.rows().len(), 1);
        drop(first);
        assert!(inflight.rows().is_empty());
        let (third, taken) = inflight.reserve(&[a]);
        assert!(taken.is_empty());
        assert_eq!(third.streams(), &[a]);
    }
}
