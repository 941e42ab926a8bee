//! The routes: `GET /metrics` (Prometheus text) and the two probes, `GET /healthz` (liveness)
//! and `GET /readyz` (readiness).
//!
//! Both probes read flags the daemon keeps current in a [`Health`] (its sampler loop pings the
//! database and calls [`Health::set_database_ok`]), so a probe never waits on a slow database.
//! Their body is a small JSON object: `{"status":"ok"}` or
//! `{"status":"unavailable","reason":"database unreachable"}`.

use std::fmt;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;

use super::{Health, Unavailable};

/// `Content-Type` of `GET /metrics`: the Prometheus text exposition format.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What the HTTP handlers read: the metrics handle and the daemon's [`Health`]. Cheap to clone.
#[derive(Clone)]
pub struct HttpState {
    pub(super) metrics: PrometheusHandle,
    pub(super) health: Health,
}

impl HttpState {
    /// Bundles the recorder's handle (from [`crate::telemetry::recorder::install`]) and the
    /// health state.
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
    use std::time::Duration;

    use super::super::test_support::{get, start};
    use super::*;

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
        assert!(
            body.contains(crate::telemetry::metrics::BUILD_INFO),
            "{body}"
        );
        shutdown.cancel();
        task.await.expect("server stops");
    }
}
