//! The daemon's small HTTP surface (SPEC §5), on `http.listen`:
//!
//! - `GET /metrics`: Prometheus text from the process recorder ([`super::recorder`]);
//! - `GET /healthz`: liveness, 200 while every registered background loop is alive, i.e. has
//!   beaten recently and has not died (a Kubernetes liveness probe restarts the process
//!   otherwise);
//! - `GET /readyz`: readiness, 200 while the database is reachable, the migrations are current
//!   and the process is not shutting down; 503 with a short reason otherwise.
//!
//! Both probes read flags the daemon keeps current in a [`Health`] (its sampler loop pings the
//! database and calls [`Health::set_database_ok`]), so a probe never waits on a slow database.
//! Their body is a small JSON object: `{"status":"ok"}` or
//! `{"status":"unavailable","reason":"database unreachable"}`.
//!
//! Connections are bounded so that slow or half-sent requests cannot starve the probes (nor
//! use up the process's file descriptors): a connection must send its request head within
//! [`Limits::request_head_timeout`] of being accepted or answered (that deadline bounds reading
//! the head, nothing else: a long request is never cut), its body within
//! [`REQUEST_BODY_TIMEOUT`], and at most [`Limits::max_connections`] are open at once. At the
//! cap, a new connection is taken and the oldest of the first kind there is is closed: one
//! never answered that is part-way through a head, then one answered that waits for (or is
//! part-way through) its next head, then one whose head is complete but whose announced body
//! is still arriving, then one that has sent nothing although the server tried to read it. A
//! new connection's first bytes are read when it is accepted, so a probe, which sends its
//! request at once, is being served from its first moment; a request being handled (no body,
//! or its body read) is never closed. A newcomer finding nothing to close looks again a few
//! times, letting the connections accepted before it be read, then is turned away. So a probe
//! gets in unless every slot is handling a request, whatever mix of slow, half-sent, trickled
//! or returning connections an attacker keeps up.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;

pub use super::health::{Health, LoopHeartbeat, Unavailable};
use super::recorder::TelemetryError;

/// `Content-Type` of `GET /metrics`: the Prometheus text exposition format.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How often histogram samples are folded into their buckets when nobody scrapes (the
/// recorder is installed without the exporter's own upkeep task).
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------------------------------------
// Server

/// What the HTTP handlers read: the metrics handle and the daemon's [`Health`]. Cheap to clone.
#[derive(Clone)]
pub struct HttpState {
    metrics: PrometheusHandle,
    health: Health,
}

impl HttpState {
    /// Bundles the recorder's handle (from [`super::recorder::install`]) and the health state.
    pub fn new(metrics: PrometheusHandle, health: Health) -> Self {
        Self { metrics, health }
    }

    /// The health state the probes read.
    pub fn health(&self) -> &Health {
        &self.health
    }
}

impl fmt::Debug for HttpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpState")
            .field("health", &self.health)
            .finish_non_exhaustive()
    }
}

/// The routes: `GET /metrics`, `GET /healthz`, `GET /readyz` (and `HEAD` of each).
pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// Binds `listen` (port 0 picks a free port) and returns the listener with its real address.
///
/// # Errors
/// [`TelemetryError::Bind`] naming the address.
pub async fn bind(listen: SocketAddr) -> Result<(TcpListener, SocketAddr), TelemetryError> {
    let bind_error = |source| TelemetryError::Bind {
        addr: listen,
        source,
    };
    let listener = TcpListener::bind(listen).await.map_err(bind_error)?;
    let local = listener.local_addr().map_err(bind_error)?;
    Ok((listener, local))
}

/// Binds `listen` and serves until `shutdown` is cancelled ([`bind`] then [`serve_on`]).
///
/// # Errors
/// [`TelemetryError::Bind`] if the address cannot be bound, [`TelemetryError::Serve`] if the
/// server fails.
pub async fn serve(
    listen: SocketAddr,
    state: HttpState,
    shutdown: CancellationToken,
) -> Result<(), TelemetryError> {
    let (listener, _) = bind(listen).await?;
    serve_on(listener, state, shutdown).await
}

/// Serves the routes on an already bound listener until `shutdown` is cancelled, then stops
/// accepting and returns once open requests are answered. While running it also performs the
/// recorder's periodic upkeep (folding histogram samples into buckets between scrapes).
/// Connections are bounded by the default [`Limits`].
///
/// Cancel the token only after the rest of the daemon has drained, so `/readyz` can report
/// "shutting down" and `/metrics` stays scrapable meanwhile.
///
/// # Errors
/// [`TelemetryError::Serve`] if the server fails.
pub async fn serve_on(
    listener: TcpListener,
    state: HttpState,
    shutdown: CancellationToken,
) -> Result<(), TelemetryError> {
    serve_with(listener, state, shutdown, Limits::default()).await
}

/// [`serve_on`] with other connection limits.
///
/// # Errors
/// [`TelemetryError::Serve`] if the server fails.
pub async fn serve_with(
    listener: TcpListener,
    state: HttpState,
    shutdown: CancellationToken,
    limits: Limits,
) -> Result<(), TelemetryError> {
    let upkeep = tokio::spawn(upkeep(state.metrics.clone(), shutdown.clone()));
    let result = serve_router(listener, router(state), shutdown, limits)
        .await
        .map_err(TelemetryError::Serve);
    upkeep.abort();
    result
}

/// Serves any `router` on `listener` under `limits` until `shutdown` is cancelled (the probes'
/// server and the console's both go through here).
pub(crate) async fn serve_router(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
    limits: Limits,
) -> io::Result<()> {
    let listener = BoundedListener::new(listener, limits);
    let router = router.layer(axum::middleware::from_fn(read_body_in_time));
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<Connection>(),
    )
    .with_graceful_shutdown(shutdown.cancelled_owned())
    .await
}

/// How long a request body may take to arrive, in all (counted from when its head was read).
/// The head deadline no longer covers a request once its head is complete, so this is what
/// keeps a body sent a byte at a time from holding a connection slot.
pub const REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest request body read (the console's forms are far smaller): 2 MiB.
pub const MAX_REQUEST_BODY: usize = 2 * 1024 * 1024;

/// Reads the whole request body within [`REQUEST_BODY_TIMEOUT`] and [`MAX_REQUEST_BODY`]
/// before the handler runs: `408` if it is too slow, `413` if it is too big.
///
/// Until its body is read, a request's connection may still be closed to make room (see
/// [`BoundedListener`]): a body that trickles must not hold a slot the probes need. From then
/// on, while its handler runs, it never is.
async fn read_body_in_time(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (parts, body) = request.into_parts();
    let connection = parts
        .extensions
        .get::<axum::extract::ConnectInfo<Connection>>()
        .map(|c| Arc::clone(&c.0 .0));
    match tokio::time::timeout(
        REQUEST_BODY_TIMEOUT,
        axum::body::to_bytes(body, MAX_REQUEST_BODY),
    )
    .await
    {
        Ok(Ok(bytes)) => {
            if let Some(c) = connection {
                c.handling.store(true, Ordering::Release);
            }
            next.run(axum::extract::Request::from_parts(parts, bytes.into()))
                .await
        }
        Ok(Err(_)) => (StatusCode::PAYLOAD_TOO_LARGE, "request body too large\n").into_response(),
        Err(_) => (
            StatusCode::REQUEST_TIMEOUT,
            "request body not sent in time\n",
        )
            .into_response(),
    }
}

// ---------------------------------------------------------------------------------------------
// Connection limits

/// How long a connection may take to send a request head, counted from when it was accepted
/// or last answered (so it is also how long an idle keep-alive connection is kept). It bounds
/// reading the head and nothing else: a request whose head is complete runs as long as its
/// handler takes.
pub const REQUEST_HEAD_TIMEOUT: Duration = Duration::from_secs(5);

/// Bytes of a new connection read when it is accepted (a request head is far smaller).
const EARLY_READ: usize = 8 * 1024;

/// How often a newcomer that finds nothing to close looks again (yielding to the connections
/// in between) before it is turned away.
const ADMIT_RETRIES: usize = 8;

/// Most connections served at once (far below the unit's `LimitNOFILE`, leaving room for the
/// database pool).
pub const MAX_CONNECTIONS: usize = 256;

/// Bounds on the HTTP connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most connections served at once.
    pub max_connections: usize,
    /// Time to send a request head, from accept or from the last response.
    pub request_head_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: MAX_CONNECTIONS,
            request_head_timeout: REQUEST_HEAD_TIMEOUT,
        }
    }
}

/// What the listener knows about one open connection.
struct ConnState {
    /// A response has been written on it.
    answered: AtomicBool,
    /// Its request head is complete and its response not started: a request is being served.
    /// Such a connection is never evicted, and the head deadline does not apply to it.
    serving: AtomicBool,
    /// Bytes of its current request head have arrived (it is part-way through one).
    started_head: AtomicBool,
    /// The server has tried to read it (so a connection that has sent nothing yet was given
    /// its chance: until then it may merely not have been scheduled).
    polled: AtomicBool,
    /// Its request's body has been read and its handler runs (set by `read_body_in_time`).
    /// Until then a request being served may still be closed to make room.
    handling: AtomicBool,
    /// The listener closed it to make room.
    evicted: AtomicBool,
    /// Dropped.
    closed: AtomicBool,
    /// The task waiting to read from it, woken on eviction.
    reader: Mutex<Option<Waker>>,
}

impl ConnState {
    fn new() -> Self {
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

    fn evict(&self) {
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

    fn live(&self) -> bool {
        !self.closed.load(Ordering::Acquire) && !self.evicted.load(Ordering::Acquire)
    }

    /// Waiting for (or part-way through) a request head: may be evicted.
    fn evictable(&self) -> bool {
        self.live() && !self.serving.load(Ordering::Acquire)
    }

    /// Its request head has been read: it is being served, and, with no body to wait for,
    /// its handler is as good as running.
    fn head_complete(&self, body: bool) {
        if !body {
            self.handling.store(true, Ordering::Release);
        }
        self.serving.store(true, Ordering::Release);
    }

    /// Its request head is complete but its body not yet read: may be evicted (after those
    /// waiting for a head that have sent part of one).
    fn awaiting_body(&self) -> bool {
        self.live()
            && self.serving.load(Ordering::Acquire)
            && !self.handling.load(Ordering::Acquire)
    }
}

/// The listener's record of a connection, handed to each request (as its `ConnectInfo`), so
/// that `read_body_in_time` can say when the request's handler starts.
#[derive(Clone)]
pub(crate) struct Connection(Arc<ConnState>);

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, BoundedListener>>
    for Connection
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, BoundedListener>) -> Self {
        Connection(Arc::clone(&stream.io().conn))
    }
}

/// Finds the end of a request head (an empty line, `\r\n\r\n` or `\n\n`) in the bytes read,
/// across reads. Empty lines before a request line are ignored, as HTTP/1.1 allows, so they
/// cannot end a "head" that never started.
/// Also notes whether the head announces a body (`Content-Length` other than 0, or
/// `Transfer-Encoding`), from the start of each header line.
#[derive(Default)]
struct HeadScan {
    seen_text: bool,
    newlines: u8,
    /// The current line's first bytes, lowercased.
    line: [u8; LINE_START],
    line_len: usize,
    /// The current line is longer than `line`.
    line_cut: bool,
    body: bool,
}

/// Bytes of a header line [`HeadScan`] looks at (`content-length: ` and a number).
const LINE_START: usize = 32;

impl HeadScan {
    /// Feeds bytes; true once the head is complete.
    fn feed(&mut self, bytes: &[u8]) -> bool {
        for &b in bytes {
            match b {
                b'\n' => {
                    self.end_line();
                    if self.seen_text {
                        self.newlines += 1;
                        if self.newlines == 2 {
                            return true;
                        }
                    }
                }
                b'\r' => {}
                _ => {
                    self.seen_text = true;
                    self.newlines = 0;
                    if self.line_len < LINE_START {
                        self.line[self.line_len] = b.to_ascii_lowercase();
                        self.line_len += 1;
                    } else {
                        self.line_cut = true;
                    }
                }
            }
        }
        false
    }

    fn end_line(&mut self) {
        let line = &self.line[..self.line_len];
        if let Some(value) = line.strip_prefix(b"content-length:") {
            let value = value.trim_ascii();
            self.body |= self.line_cut || value.is_empty() || value.iter().any(|&d| d != b'0');
        } else if line.starts_with(b"transfer-encoding:") {
            self.body = true;
        }
        self.line_len = 0;
        self.line_cut = false;
    }

    /// The head (complete or not) announces a body.
    fn announces_body(&self) -> bool {
        self.body
    }
}

type OpenConnections = Arc<Mutex<VecDeque<Arc<ConnState>>>>;

/// A TCP listener that enforces [`Limits`] (used by every HTTP surface: probes and console).
pub(crate) struct BoundedListener {
    inner: TcpListener,
    limits: Limits,
    open: OpenConnections,
}

impl BoundedListener {
    /// Wraps a bound listener.
    pub(crate) fn new(inner: TcpListener, limits: Limits) -> Self {
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
            return (
                BoundedIo {
                    stream,
                    conn,
                    head,
                    early,
                    timeout,
                    deadline: Box::pin(tokio::time::sleep(timeout)),
                },
                addr,
            );
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// A connection under [`Limits`]: while it waits for a request head, its reads fail once the
/// head deadline has passed; once the head is complete, nothing times out until the response
/// is written (the server polls reads while a handler runs, and a long request must not be
/// cut). Evicted by the listener, its reads fail, which makes the server close it.
pub(crate) struct BoundedIo {
    stream: TcpStream,
    conn: Arc<ConnState>,
    head: HeadScan,
    /// Bytes read when it was accepted, not yet handed to the server.
    early: Vec<u8>,
    timeout: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl BoundedIo {
    /// `written` went out. A response (not an interim `100 Continue`) ends the request: the
    /// connection waits for its next head, under a fresh deadline.
    fn wrote(&mut self, written: &[u8]) {
        if self.conn.serving.load(Ordering::Acquire) && written.starts_with(b"HTTP/1.1 1") {
            return;
        }
        self.conn.answered.store(true, Ordering::Release);
        self.conn.serving.store(false, Ordering::Release);
        self.conn.started_head.store(false, Ordering::Release);
        self.conn.handling.store(false, Ordering::Release);
        self.head = HeadScan::default();
        self.deadline.as_mut().reset(Instant::now() + self.timeout);
        // A read that went pending while the request was served did not arm the deadline:
        // wake it, so that it is polled again and does.
        let reader = self
            .conn
            .reader
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(waker) = reader {
            waker.wake();
        }
    }
}

fn evicted() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "closed to make room for another connection",
    )
}

impl AsyncRead for BoundedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.conn.evicted.load(Ordering::Acquire) {
            return Poll::Ready(Err(evicted()));
        }
        this.conn.polled.store(true, Ordering::Release);
        if !this.early.is_empty() {
            // Already fed to the head scan when accepted.
            let n = this.early.len().min(buf.remaining());
            buf.put_slice(&this.early[..n]);
            this.early.drain(..n);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let read = &buf.filled()[before..];
                if !this.conn.serving.load(Ordering::Acquire) && !read.is_empty() {
                    this.conn.started_head.store(true, Ordering::Release);
                    if this.head.feed(read) {
                        this.conn.head_complete(this.head.announces_body());
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                *this
                    .conn
                    .reader
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = Some(cx.waker().clone());
                // Evicted between the check above and storing the waker: nobody will wake us.
                if this.conn.evicted.load(Ordering::Acquire) {
                    return Poll::Ready(Err(evicted()));
                }
                if !this.conn.serving.load(Ordering::Acquire)
                    && this.deadline.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no complete request in time",
                    )));
                }
                Poll::Pending
            }
        }
    }
}

impl AsyncWrite for BoundedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = written {
            if n > 0 {
                this.wrote(&buf[..n]);
            }
        }
        written
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = written {
            if n > 0 {
                let first = bufs
                    .iter()
                    .find(|b| !b.is_empty())
                    .map_or(&[][..], |b| &b[..]);
                this.wrote(first);
            }
        }
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl Drop for BoundedIo {
    fn drop(&mut self) {
        self.conn.closed.store(true, Ordering::Release);
    }
}

async fn upkeep(handle: PrometheusHandle, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(UPKEEP_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => handle.run_upkeep(),
        }
    }
}

async fn metrics(State(state): State<HttpState>) -> Response {
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        state.metrics.render(),
    )
        .into_response()
}

async fn healthz(State(state): State<HttpState>) -> Response {
    probe(state.health.liveness())
}

async fn readyz(State(state): State<HttpState>) -> Response {
    probe(state.health.readiness())
}

/// The JSON body of `/healthz` and `/readyz`.
#[derive(serde::Serialize)]
struct ProbeBody {
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
}

fn probe(outcome: Result<(), Unavailable>) -> Response {
    let (status, body) = match outcome {
        Ok(()) => (
            StatusCode::OK,
            ProbeBody {
                status: "ok",
                reason: None,
            },
        ),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            ProbeBody {
                status: "unavailable",
                reason: Some(reason.to_string()),
            },
        ),
    };
    // Serializing two strings cannot fail.
    let body = serde_json::to_string(&body).unwrap_or_default();
    (
        status,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: SocketAddr, path: &str) -> (u16, String, String) {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.expect("read");
        let text = String::from_utf8(raw).expect("utf-8");
        let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("status code");
        (status, head.to_owned(), body.to_owned())
    }

    async fn start(health: Health) -> (SocketAddr, CancellationToken, tokio::task::JoinHandle<()>) {
        let handle = super::super::recorder::install().expect("recorder");
        let (listener, addr) = bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("bind");
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(serve_on(
            listener,
            HttpState::new(handle, health),
            shutdown.clone(),
        ));
        let task = tokio::spawn(async move { task.await.expect("join").expect("serve") });
        (addr, shutdown, task)
    }

    #[tokio::test]
    async fn readiness_follows_the_flags() {
        let health = Health::new();
        let (addr, shutdown, task) = start(health.clone()).await;

        let (status, _, body) = get(addr, "/readyz").await;
        assert_eq!(status, 503);
        assert_eq!(
            body,
            r#"{"status":"unavailable","reason":"database unreachable"}"#
        );

        health.set_database_ok(true);
        let (status, _, body) = get(addr, "/readyz").await;
        assert_eq!(status, 503);
        assert!(body.contains("migrations not current"), "{body}");

        health.set_migrations_current(true);
        let (status, head, body) = get(addr, "/readyz").await;
        assert_eq!(status, 200);
        assert_eq!(body, r#"{"status":"ok"}"#);
        assert!(head
            .to_ascii_lowercase()
            .contains("content-type: application/json"));

        health.set_database_ok(false);
        assert_eq!(get(addr, "/readyz").await.0, 503);
        health.set_database_ok(true);
        assert_eq!(get(addr, "/readyz").await.0, 200);

        health.set_shutting_down();
        let (status, _, body) = get(addr, "/readyz").await;
        assert_eq!(status, 503);
        assert!(body.contains("shutting down"), "{body}");

        // Liveness is independent of readiness.
        assert_eq!(get(addr, "/healthz").await.0, 200);
        assert_eq!(get(addr, "/nope").await.0, 404);

        shutdown.cancel();
        task.await.expect("server stops");
    }

    #[tokio::test]
    async fn liveness_fails_for_a_dead_loop_and_recovers_on_reregistration() {
        let health = Health::new();
        let (addr, shutdown, task) = start(health.clone()).await;

        let beat = health.register_loop("sampler", Duration::from_secs(60));
        beat.beat();
        let (status, _, body) = get(addr, "/healthz").await;
        assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));

        // A loop that ends on purpose does not count.
        let finished = health.register_loop("heartbeat", Duration::from_secs(60));
        finished.finish();
        assert_eq!(get(addr, "/healthz").await.0, 200);

        // A loop whose task ends without finish() (returned early, panicked) is dead.
        let dying = health.register_loop("consumer-0", Duration::from_secs(60));
        tokio::spawn(async move {
            let _beat = dying;
            panic!("simulated loop failure");
        })
        .await
        .expect_err("the task panicked");
        let (status, _, body) = get(addr, "/healthz").await;
        assert_eq!(status, 503);
        assert!(body.contains("loop consumer-0 died"), "{body}");

        // Restarting the loop under the same name replaces the dead registration.
        let restarted = health.register_loop("consumer-0", Duration::from_secs(60));
        assert_eq!(get(addr, "/healthz").await.0, 200);

        restarted.finish();
        beat.finish();
        shutdown.cancel();
        task.await.expect("server stops");
    }

    #[tokio::test]
    async fn metrics_are_prometheus_text() {
        let (addr, shutdown, task) = start(Health::new()).await;
        let (status, head, body) = get(addr, "/metrics").await;
        assert_eq!(status, 200);
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: text/plain; version=0.0.4"),
            "{head}"
        );
        assert!(body.contains(super::super::metrics::BUILD_INFO), "{body}");
        shutdown.cancel();
        task.await.expect("server stops");
    }

    /// Opens `n` connections that each send part of a request head and then nothing; each
    /// waits for the server to close it and counts that in the returned counter.
    async fn half_sent(addr: SocketAddr, n: usize) -> Arc<std::sync::atomic::AtomicUsize> {
        let closed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for _ in 0..n {
            let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
            stream
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                .await
                .expect("write");
            let closed = Arc::clone(&closed);
            tokio::spawn(async move {
                let mut buf = [0u8; 256];
                loop {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    }
                }
                closed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            });
        }
        closed
    }

    async fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
        let started = std::time::Instant::now();
        while !done() {
            assert!(started.elapsed() < limit, "{what} within {limit:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_thousand_half_sent_requests_cannot_starve_the_probes() {
        let (addr, shutdown, task) = start(Health::new()).await;
        let closed = half_sent(addr, 1000).await;
        // The probe answers at once, although 1000 requests hang half-sent.
        let (status, _, body) = tokio::time::timeout(Duration::from_secs(2), get(addr, "/healthz"))
            .await
            .expect("/healthz answers promptly");
        assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));
        // The server keeps at most its cap of them open: the others are closed (and with them
        // their file descriptors).
        wait_until(
            Duration::from_secs(10),
            "the connections over the cap are closed",
            || closed.load(std::sync::atomic::Ordering::SeqCst) >= 1000 - MAX_CONNECTIONS,
        )
        .await;
        shutdown.cancel();
        task.await.expect("server stops");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_head_not_sent_in_time_is_closed_and_answered_connections_are_kept() {
        let handle = super::super::recorder::install().expect("recorder");
        let (listener, addr) = bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("bind");
        let shutdown = CancellationToken::new();
        let limits = Limits {
            max_connections: 8,
            request_head_timeout: Duration::from_millis(300),
        };
        let task = tokio::spawn(serve_with(
            listener,
            HttpState::new(handle, Health::new()),
            shutdown.clone(),
            limits,
        ));

        // Half-sent, and trickled a byte at a time (slowloris): both closed after the timeout.
        let closed = half_sent(addr, 1).await;
        let mut trickle = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let trickled = tokio::spawn(async move {
            for b in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "
                .iter()
                .cycle()
                .take(200)
            {
                if trickle.write_all(&[*b]).await.is_err() {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            false
        });
        wait_until(
            Duration::from_secs(5),
            "the half-sent request is closed",
            || closed.load(std::sync::atomic::Ordering::SeqCst) == 1,
        )
        .await;
        assert!(
            tokio::time::timeout(Duration::from_secs(5), trickled)
                .await
                .expect("the trickled request is closed")
                .expect("join"),
            "the trickled request was kept open"
        );

        // A keep-alive connection that sends its requests promptly is served, request after
        // request, beyond the cap's worth of half-sent ones that come and go.
        let mut alive = tokio::net::TcpStream::connect(addr).await.expect("connect");
        for round in 0..3 {
            // Once answered, it is not the one that makes room for newcomers.
            let _more = if round > 0 {
                Some(half_sent(addr, 10).await)
            } else {
                None
            };
            alive
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .expect("write");
            let mut buf = vec![0u8; 1024];
            let n = tokio::time::timeout(Duration::from_secs(2), alive.read(&mut buf))
                .await
                .expect("answered promptly")
                .expect("read");
            let text = String::from_utf8_lossy(&buf[..n]);
            assert!(text.starts_with("HTTP/1.1 200"), "{text}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        shutdown.cancel();
        task.await.expect("join").expect("server stops");
    }
}

#[cfg(test)]
mod hardening_tests {
    //! Issue 19, defects 2 and 3: the request-head timeout bounds reading a request head and
    //! nothing else, and connections that were answered cannot crowd the probes out.
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn start_with(
        router: Router,
        limits: Limits,
    ) -> (SocketAddr, CancellationToken, tokio::task::JoinHandle<()>) {
        let (listener, addr) = bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .expect("bind");
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(serve_router(listener, router, shutdown.clone(), limits));
        let task = tokio::spawn(async move { task.await.expect("join").expect("serve") });
        (addr, shutdown, task)
    }

    #[test]
    fn a_head_says_whether_a_body_follows() {
        let scan = |head: &[u8]| {
            let mut h = HeadScan::default();
            let done = h.feed(head);
            (done, h.announces_body())
        };
        assert_eq!(
            scan(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"),
            (true, false)
        );
        assert_eq!(
            scan(b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n"),
            (true, false)
        );
        assert_eq!(
            scan(b"POST / HTTP/1.1\r\ncontent-length:  12\r\n\r\n"),
            (true, true)
        );
        assert_eq!(
            scan(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            (true, true)
        );
        assert_eq!(scan(b"POST / HTTP/1.1\nContent-Length: 3\n"), (false, true));
        assert_eq!(
            scan(b"GET / HTTP/1.1\r\nX-Content-Length: 5\r\n\r\n"),
            (true, false)
        );
    }

    fn probes() -> Router {
        let handle = super::super::recorder::install().expect("recorder");
        router(HttpState::new(handle, Health::new()))
    }

    /// Reads one response (head and `Content-Length` body) from `stream`.
    async fn read_response(stream: &mut TcpStream) -> String {
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let n = match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            raw.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&raw);
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let len = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                if body.len() >= len {
                    break;
                }
            }
        }
        String::from_utf8_lossy(&raw).into_owned()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn answered_connections_that_start_a_next_request_cannot_starve_the_probes() {
        // A long head timeout, so eviction is what has to make room.
        let limits = Limits {
            max_connections: 8,
            request_head_timeout: Duration::from_secs(60),
        };
        let (addr, shutdown, task) = start_with(probes(), limits).await;
        // Fill every slot with connections that got one answer and then sent one byte of a
        // next request.
        let mut attackers = Vec::new();
        for _ in 0..8 {
            let mut s = TcpStream::connect(addr).await.expect("connect");
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .expect("write");
            let answer = read_response(&mut s).await;
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            s.write_all(b"G").await.expect("write");
            attackers.push(s);
        }
        let mut answered = 0;
        for _ in 0..27 {
            let probe = async {
                let mut s = TcpStream::connect(addr).await.ok()?;
                s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    .await
                    .ok()?;
                let mut raw = Vec::new();
                s.read_to_end(&mut raw).await.ok()?;
                Some(String::from_utf8_lossy(&raw).starts_with("HTTP/1.1 200"))
            };
            if let Ok(Some(true)) = tokio::time::timeout(Duration::from_secs(2), probe).await {
                answered += 1;
            }
            // The attack goes on: the evicted attacker comes back in the same shape.
            let mut s = TcpStream::connect(addr).await.expect("connect");
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .expect("write");
            let _ = tokio::time::timeout(Duration::from_secs(2), read_response(&mut s)).await;
            let _ = s.write_all(b"G").await;
            attackers.push(s);
        }
        assert_eq!(answered, 27, "probes answered during the attack");
        shutdown.cancel();
        drop(attackers);
        task.await.expect("server stops");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_longer_than_the_head_timeout_is_answered() {
        let limits = Limits {
            max_connections: 8,
            request_head_timeout: Duration::from_millis(300),
        };
        let slow = Router::new().route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                "done"
            })
            .post(|body: String| async move {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                format!("got {}", body.len())
            }),
        );
        let (addr, shutdown, task) = start_with(slow, limits).await;
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        let answer = tokio::time::timeout(Duration::from_secs(10), read_response(&mut s))
            .await
            .expect("answered");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("done"), "{answer}");
        // The same keep-alive connection, a POST with a body: also answered in full.
        s.write_all(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            .await
            .expect("write");
        let answer = tokio::time::timeout(Duration::from_secs(10), read_response(&mut s))
            .await
            .expect("answered");
        assert!(answer.ends_with("got 3"), "{answer}");
        // And an idle keep-alive connection is still closed after the head timeout.
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("the idle connection is closed");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        shutdown.cancel();
        task.await.expect("server stops");
    }
}
