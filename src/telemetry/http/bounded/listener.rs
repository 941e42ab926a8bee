//! The accepting side: admits a connection, closing another to make room at the cap.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::net::TcpListener;

use super::conn::{ConnState, Connection};
use super::head::HeadScan;
use super::io::BoundedIo;
use super::Limits;

/// Bytes of a new connection read when it is accepted (a request head is far smaller).
const EARLY_READ: usize = 8 * 1024;

/// How often a newcomer that finds nothing to close looks again (yielding to the connections
/// in between) before it is turned away.
const ADMIT_RETRIES: usize = 8;

type OpenConnections = Arc<Mutex<VecDeque<Arc<ConnState>>>>;

/// A TCP listener that enforces [`Limits`] (used by every HTTP surface: probes and console).
pub(super) struct BoundedListener {
    inner: TcpListener,
    limits: Limits,
    open: OpenConnections,
}

impl BoundedListener {
    /// Wraps a bound listener.
    pub(super) fn new(inner: TcpListener, limits: Limits) -> Self {
        BoundedListener {
            inner,
            limits,
            open: Arc::default(),
        }
    }

    /// Makes room for one more connection; false if every slot is busy answering (then the new
    /// connection is turned away).
    fn admit(&self, conn: &Arc<ConnState>) -> bool {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.retain(|c| !c.closed.load(Ordering::Acquire));
        let live = open.iter().filter(|c| c.live()).count();
        if live >= self.limits.max_connections.max(1) {
            // Oldest first: one that never got an answer and is part-way through a head (a
            // slowloris); else an answered one that waits for (or is part-way through) its
            // next head; else one whose head is complete but whose body is still arriving (a
            // body that trickles must not hold the slot); only then one that has sent nothing
            // yet, and only once the server has tried to read it. A newcomer's first bytes are
            // read when it is accepted, so a client that sends its request at once (a probe)
            // is being served from its first moment; one whose bytes are still on their way is
            // kept until its task has looked: attackers that come back as fast as they are
            // closed push out each other, not newcomers. When nothing may be closed, the
            // newcomer is turned away. A connection whose handler runs is never closed.
            let never_answered = |c: &&Arc<ConnState>| !c.answered.load(Ordering::Acquire);
            let started = |c: &&Arc<ConnState>| c.started_head.load(Ordering::Acquire);
            let victim = open
                .iter()
                .filter(|c| c.evictable())
                .find(|c| never_answered(c) && started(c))
                .or_else(|| open.iter().find(|c| c.evictable() && !never_answered(c)))
                .or_else(|| open.iter().find(|c| c.awaiting_body()))
                .or_else(|| {
                    open.iter()
                        .find(|c| c.evictable() && c.polled.load(Ordering::Acquire))
                });
            match victim {
                Some(victim) => victim.evict(),
                None => return false,
            }
        }
        open.push_back(Arc::clone(conn));
        true
    }
}

impl axum::serve::Listener for BoundedListener {
    type Io = BoundedIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (BoundedIo, SocketAddr) {
        loop {
            // axum's own accept: retries, and backs off on errors such as EMFILE.
            let (stream, addr) = axum::serve::Listener::accept(&mut self.inner).await;
            let conn = Arc::new(ConnState::new());
            let mut head = HeadScan::default();
            let mut early = Vec::new();
            let mut admitted = false;
            for attempt in 0..=ADMIT_RETRIES {
                if early.is_empty() {
                    // What it has sent already (a probe sends its whole request at once): read
                    // now, so that its state is known before anything is evicted for it.
                    early.resize(EARLY_READ, 0);
                    match stream.try_read(&mut early) {
                        Ok(n) => early.truncate(n),
                        Err(_) => early.clear(),
                    }
                    if !early.is_empty() {
                        conn.started_head.store(true, Ordering::Release);
                        if head.feed(&early) {
                            conn.head_complete(head.announces_body());
                        }
                    }
                }
                if self.admit(&conn) {
                    admitted = true;
                    break;
                }
                if attempt < ADMIT_RETRIES {
                    // Nothing may be closed yet: connections accepted in this burst have not
                    // been read. Let them run, then look again.
                    tokio::task::yield_now().await;
                }
            }
            if !admitted {
                tracing::debug!(%addr, "HTTP connection refused: every slot is answering a request");
                continue;
            }
            let timeout = self.limits.request_head_timeout;
            return (BoundedIo::new(stream, conn, head, early, timeout), addr);
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// (here, beside the listener, so that the connection state does not depend on it)
impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, BoundedListener>>
    for Connection
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, BoundedListener>) -> Self {
        Connection(Arc::clone(stream.io().conn()))
    }
}
