//! The graceful shutdown sequence.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::DaemonError;
use crate::pipeline::inflight::InFlight;
use crate::store::{InstanceId, Store};
use crate::telemetry::health::Health;

/// What the shutdown stops, in its order.
pub(super) struct DrainAndStop {
    pub(super) store: Store,
    pub(super) instance: InstanceId,
    pub(super) inflight: Arc<InFlight>,
    pub(super) health: Health,
    pub(super) grace: Duration,
    pub(super) stop_claiming: CancellationToken,
    pub(super) stop_background: CancellationToken,
    pub(super) stop_renewal: CancellationToken,
    pub(super) renewal: Vec<JoinHandle<()>>,
    pub(super) consumers: TaskTracker,
    pub(super) consumer_tasks: Vec<JoinHandle<()>>,
    pub(super) background: TaskTracker,
    pub(super) _wake: Arc<super::wake::Wake>,
}

/// How long shutdown may take once the grace is over, whatever handlers or the database do.
/// The shipped stop timeouts (systemd, Kubernetes) keep a margin over grace + this.
pub const SHUTDOWN_TAIL: Duration = Duration::from_secs(6);

/// Graceful shutdown: not ready, stop claiming (a pending claim is abandoned: it is no work in
/// flight), let batches in flight finish within the grace (leases still renewed meanwhile),
/// then, bounded by [`SHUTDOWN_TAIL`]: abandon what still runs (its statements cancelled on the
/// server, so its transactions roll back), give back the rows its handlers had seen without a
/// refund, deregister (the rest go back with a refund of their claim's bump).
pub(super) async fn drain_and_stop(s: DrainAndStop) -> Result<(), DaemonError> {
    s.health.set_shutting_down();
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    tracing::info!(grace = ?s.grace, "shutting down: finishing batches in flight");
    s.stop_claiming.cancel();
    s.consumers.close();
    let finished = tokio::time::timeout(s.grace, s.consumers.wait())
        .await
        .is_ok();
    let deadline = tokio::time::Instant::now() + SHUTDOWN_TAIL;
    let bounded = |what: &'static str| {
        move |_| {
            tracing::warn!("shutdown: {what} got no answer in time; going on");
        }
    };
    if !finished {
        tracing::warn!(grace = ?s.grace, "batches still in flight after the shutdown grace; abandoning them (their statements are cancelled and their transactions roll back)");
        // The record of what they held owns their leases from here on.
        let abandoned = s.inflight.abandon();
        for task in &s.consumer_tasks {
            task.abort();
        }
        let _ = tokio::time::timeout_at(deadline, abandoned.cancel_statements(&s.store))
            .await
            .map_err(bounded("cancelling batch statements"));
        let _ = tokio::time::timeout_at(deadline, s.consumers.wait())
            .await
            .map_err(bounded("waiting for abandoned batches"));
        // Their handlers saw these rows: the attempt was used, no refund.
        match tokio::time::timeout_at(deadline, abandoned.give_back(&s.store, s.instance)).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => {
                tracing::warn!(%error, "could not give back the rows of abandoned batches")
            }
            Err(_) => tracing::warn!(
                "shutdown: giving back abandoned rows got no answer in time; going on"
            ),
        }
    }
    // Nothing is in flight any more: stop renewing, and let a renewal under way finish so its
    // row locks do not make deregistration skip those rows.
    s.stop_renewal.cancel();
    let _ = tokio::time::timeout_at(deadline, futures::future::join_all(s.renewal))
        .await
        .map_err(bounded("stopping lease renewal and the heartbeat"));
    // Whatever is still leased (rows never started) goes back with a refund of its bump.
    match tokio::time::timeout_at(deadline, s.store.deregister(s.instance)).await {
        Ok(Ok(released)) => {
            if released > 0 {
                metrics::counter!(crate::telemetry::metrics::LEASES_RELEASED_TOTAL)
                    .increment(released);
            }
            tracing::info!(released, instance = %s.instance, "deregistered; leases given back")
        }
        Ok(Err(error)) => {
            tracing::warn!(%error, "could not deregister; other instances will take over once this one is stale")
        }
        Err(_) => tracing::warn!(
            "deregistration got no answer in time; other instances will take over once this one is stale"
        ),
    }
    s.stop_background.cancel();
    s.background.close();
    let until = deadline.max(tokio::time::Instant::now() + Duration::from_millis(500));
    let _ = tokio::time::timeout_at(until, s.background.wait()).await;
    tracing::info!("vantage stopped");
    Ok(())
}
