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

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
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
    let upkeep = tokio::spawn(upkeep(state.metrics.clone(), shutdown.clone()));
    let result = axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown.clone().cancelled_owned())
        .await
        .map_err(TelemetryError::Serve);
    upkeep.abort();
    result
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
}
