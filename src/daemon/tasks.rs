//! The loops of a running daemon, started in the order the shutdown sequence stops them in
//! reverse: the work listener and the consumers, then the background tasks and HTTP.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::background::{
    self, Backfill, Driver, Heartbeat, LaneReconciliation, LeaseRenewal, Quarantine, Sampler,
};
use super::wake::Wake;
use super::{consumer, listener};
use crate::config::{Settings, WorkerSettings};
use crate::pipeline::cooldown::CooldownCache;
use crate::pipeline::inflight::InFlight;
use crate::pipeline::Pipeline;
use crate::store::{InstanceId, InstanceInfo, Store};
use crate::telemetry::health::Health;
use crate::telemetry::http::HttpState;

/// The loops of a running daemon and how they are stopped: consumers (and the work listener)
/// first, background tasks and HTTP last (see `drain_and_stop`).
#[derive(Default)]
pub(super) struct Tasks {
    pub(super) stop_claiming: CancellationToken,
    pub(super) stop_background: CancellationToken,
    /// Lease renewal is stopped on its own, before deregistration: a renewal in flight locks
    /// the rows it renews, and deregistration skips locked rows.
    pub(super) stop_renewal: CancellationToken,
    pub(super) consumers: TaskTracker,
    pub(super) consumer_tasks: Vec<JoinHandle<()>>,
    pub(super) background: TaskTracker,
}

/// What the background tasks work with.
pub(super) struct Background {
    pub(super) store: Store,
    pub(super) instance: InstanceId,
    pub(super) info: InstanceInfo,
    pub(super) settings: Arc<Settings>,
    pub(super) health: Health,
    pub(super) inflight: Arc<InFlight>,
    pub(super) cooldown: Option<Arc<CooldownCache>>,
}

impl Tasks {
    /// Serves `/metrics` and the probes until the background tasks stop; returns the address.
    pub(super) fn serve_http(&self, listener: TcpListener, state: HttpState) -> Option<SocketAddr> {
        let addr = listener.local_addr().ok();
        let token = self.stop_background.clone();
        self.background.spawn(async move {
            if let Err(error) = crate::telemetry::http::serve_on(listener, state, token).await {
                tracing::error!(%error, "HTTP server failed");
            }
        });
        addr
    }

    /// The work listener and `worker.consumers` consumer loops; returns the wake-up sender
    /// (kept alive until the consumers have stopped).
    pub(super) fn spawn_consumers(
        &mut self,
        pipeline: &Pipeline,
        health: &Health,
        worker: &WorkerSettings,
    ) -> Arc<Wake> {
        let wake_tx = Wake::new();
        {
            let store = pipeline.ctx.store.clone();
            let token = self.stop_claiming.clone();
            let beat = health.register_loop("listener", Duration::from_secs(30));
            let wake = Arc::clone(&wake_tx);
            self.consumer_tasks.push(self.consumers.spawn(async move {
                listener::run(store, wake, token, || beat.beat()).await;
                beat.finish();
            }));
        }
        for id in 0..worker.consumers {
            let pipeline = pipeline
                .for_consumer(id, worker.consumers)
                .relaying_to(wake_tx.relay());
            let wake = wake_tx.waiter();
            let token = self.stop_claiming.clone();
            let poll = worker.poll_interval;
            // A batch may legitimately take long; liveness only flags a loop silent for long.
            let stale = (worker.lease * 3).max(poll * 3);
            let beat = health.register_loop(format!("consumer-{id}"), stale);
            self.consumer_tasks.push(self.consumers.spawn(async move {
                consumer::run(id, pipeline, wake, poll, token, || beat.beat()).await;
                beat.finish();
            }));
        }
        wake_tx
    }

    /// Heartbeat and cleanup, lease renewal, quarantine (for perspectives with
    /// `quarantine_after`), the sampler (one [`Driver`]), and the systemd watchdog; returns the driver and the handles of heartbeat and lease renewal.
    pub(super) fn spawn_background(&self, b: Background) -> (Driver, Vec<JoinHandle<()>>) {
        let driver = Driver::new(
            b.health.clone(),
            self.stop_background.clone(),
            self.background.clone(),
        );
        let orphans = &b.settings.orphans;
        let lease = b.settings.worker.lease;
        // Stopped with lease renewal, before deregistration: a heartbeat after it would register
        // the departed instance again.
        let (_, heartbeat) = driver.spawn_until(
            "heartbeat",
            orphans.heartbeat_interval,
            orphans.heartbeat_interval * 3,
            Heartbeat {
                store: b.store.clone(),
                instance: b.instance,
                info: b.info,
                settings: Arc::clone(&b.settings),
                health: b.health.clone(),
            },
            self.stop_renewal.clone(),
        );
        let (_, renewal) = driver.spawn_until(
            "lease-renewal",
            LeaseRenewal::period(lease),
            lease,
            LeaseRenewal {
                store: b.store.clone(),
                instance: b.instance,
                inflight: Arc::clone(&b.inflight),
                lease,
            },
            self.stop_renewal.clone(),
        );
        let watched = Quarantine::watched(&b.settings);
        if !watched.is_empty() {
            driver.spawn(
                "quarantine",
                Quarantine::PERIOD,
                Duration::from_secs(60),
                Quarantine {
                    store: b.store.clone(),
                    watched,
                },
            );
        }
        let versioned: Vec<String> = b
            .settings
            .perspectives
            .iter()
            .filter(|p| p.is_versioned())
            .map(|p| p.name.clone())
            .collect();
        if !versioned.is_empty() {
            driver.spawn(
                "backfill",
                Backfill::PERIOD,
                Duration::from_secs(120),
                Backfill::new(
                    b.store.clone(),
                    versioned,
                    i32::try_from(b.settings.worker.backfill_batch_size).unwrap_or(i32::MAX),
                ),
            );
        }
        driver.spawn(
            "lane-reconciliation",
            LaneReconciliation::PERIOD,
            // The start-up pass walks every lane once; give it time on a large backlog.
            Duration::from_secs(600),
            LaneReconciliation::new(b.store.clone()),
        );
        driver.spawn(
            "sampler",
            Sampler::PERIOD,
            Duration::from_secs(30),
            Sampler {
                store: b.store,
                health: b.health.clone(),
                cooldown: b.cooldown,
                round: 0,
                inflight: b.inflight,
            },
        );
        self.background.spawn(background::systemd_watchdog(
            b.health,
            self.stop_background.clone(),
        ));
        (driver, vec![heartbeat, renewal])
    }
}
