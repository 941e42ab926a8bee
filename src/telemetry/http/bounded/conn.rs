//! What the listener and a connection's reads and writes share about one open connection.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Waker;

/// What the listener knows about one open connection.
pub(super) struct ConnState {
    /// A response has been written on it.
    pub(super) answered: AtomicBool,
    /// Its request head is complete and its response not started: a request is being served.
    /// Such a connection is never evicted, and the head deadline does not apply to it.
    pub(super) serving: AtomicBool,
    /// Bytes of its current request head have arrived (it is part-way through one).
    pub(super) started_head: AtomicBool,
    /// The server has tried to read it (so a connection that has sent nothing yet was given
    /// its chance: until then it may merely not have been scheduled).
    pub(super) polled: AtomicBool,
    /// Its request's body has been read and its handler runs (set by `read_body_in_time`).
    /// Until then a request being served may still be closed to make room.
    pub(super) handling: AtomicBool,
    /// The listener closed it to make room.
    pub(super) evicted: AtomicBool,
    /// Dropped.
    pub(super) closed: AtomicBool,
    /// The task waiting to read from it, woken on eviction.
    pub(super) reader: Mutex<Option<Waker>>,
}

impl ConnState {
    pub(super) fn new() -> Self {
        ConnState {
            answered: AtomicBool::new(false),
            serving: AtomicBool::new(false),
            started_head: AtomicBool::new(false),
            polled: AtomicBool::new(false),
            handling: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            reader: Mutex::new(None),
        }
    }

    pub(super) fn evict(&self) {
        self.evicted.store(true, Ordering::Release);
        let waker = self
            .reader
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    pub(super) fn live(&self) -> bool {
        !self.closed.load(Ordering::Acquire) && !self.evicted.load(Ordering::Acquire)
    }

    /// Waiting for (or part-way through) a request head: may be evicted.
    pub(super) fn evictable(&self) -> bool {
        self.live() && !self.serving.load(Ordering::Acquire)
    }

    /// Its request head has been read: it is being served, and, with no body to wait for,
    /// its handler is as good as running.
    pub(super) fn head_complete(&self, body: bool) {
        if !body {
            self.handling.store(true, Ordering::Release);
        }
        self.serving.store(true, Ordering::Release);
    }

    /// Its request head is complete but its body not yet read: may be evicted (after those
    /// waiting for a head that have sent part of one).
    pub(super) fn awaiting_body(&self) -> bool {
        self.live()
            && self.serving.load(Ordering::Acquire)
            && !self.handling.load(Ordering::Acquire)
    }
}

/// The listener's record of a connection, handed to each request (as its `ConnectInfo`), so
/// that `read_body_in_time` can say when the request's handler starts.
#[derive(Clone)]
pub(super) struct Connection(pub(super) Arc<ConnState>);
