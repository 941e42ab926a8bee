//! Binding `http.listen` and serving the routes until shutdown, with the recorder's upkeep.

use std::net::SocketAddr;
use std::time::Duration;

use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::bounded::{serve_router, Limits};
use super::probes::{router, HttpState};
use crate::telemetry::recorder::TelemetryError;

/// How often histogram samples are folded into their buckets when nobody scrapes (the
/// recorder is installed without the exporter's own upkeep task).
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

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
