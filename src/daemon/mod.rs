//! The daemon: start-up checks, consumer loops, background tasks, graceful shutdown.
//!
//! [`DaemonBuilder::start`] installs no signal handler: it stops when the token given to
//! [`DaemonBuilder::shutdown_on`] (or [`RunningDaemon::shutdown_token`]) is cancelled, as
//! mini-redis's `server::run(listener, shutdown)` does. Only the binary's front end
//! (`crate::cli`) knows about signals and exit codes.

mod background;
mod consumer;
mod listener;
mod reconcile;

pub use background::{Activator, TaskStatus};

/// How often a daemon checks its perspectives with `quarantine_after`.
pub const QUARANTINE_PERIOD: Duration = background::Quarantine::PERIOD;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use self::background::{Driver, Heartbeat, LeaseRenewal, Quarantine, Sampler};
use crate::config::{Settings, WorkerSettings};
use crate::perspective::{Perspective, PerspectiveRegistry, RegistryError};
use crate::pipeline::cooldown::CooldownCache;
use crate::pipeline::inflight::InFlight;
use crate::pipeline::Pipeline;
use crate::store::{InstanceId, InstanceInfo, Store, StoreError, StoreOptions};
use crate::telemetry::health::Health;
use crate::telemetry::http::HttpState;

/// Why the daemon could not start or stopped abnormally (`crate::cli::exit` maps each to an
/// exit code).
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Configuration problem (bad perspective statement, none configured, an HTTP address that
    /// cannot be bound).
    #[error("{0}")]
    Config(String),
    /// The database: unreachable past `database.connect_timeout`, refused the credentials,
    /// has no such database, or a schema this binary cannot run on.
    #[error(transparent)]
    Store(StoreError),
    /// The shutdown token was cancelled during start-up: nothing was claimed, nothing is left
    /// registered.
    #[error("stopped during start-up")]
    Stopped,
    /// Anything else.
    #[error("{0}")]
    Internal(String),
}

impl From<RegistryError> for DaemonError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::Store(e) => DaemonError::Store(e),
            other => DaemonError::Config(other.to_string()),
        }
    }
}

impl From<StoreError> for DaemonError {
    fn from(e: StoreError) -> Self {
        DaemonError::Store(e)
    }
}

/// Builds a daemon: SQL perspectives from the settings plus any Rust perspectives added here.
pub struct DaemonBuilder {
    settings: Settings,
    extra: Vec<Arc<dyn Perspective>>,
    store: Option<Store>,
    cooldown: Option<Arc<CooldownCache>>,
    http: HttpMode,
    instance: InstanceId,
    shutdown: CancellationToken,
}

enum HttpMode {
    FromSettings,
    Listener(TcpListener),
    Off,
}

impl DaemonBuilder {
    /// A daemon for these settings.
    pub fn new(settings: Settings) -> Self {
        DaemonBuilder {
            settings,
            extra: Vec::new(),
            store: None,
            cooldown: None,
            http: HttpMode::FromSettings,
            instance: InstanceId::new(),
            shutdown: CancellationToken::new(),
        }
    }

    /// Adds a Rust perspective.
    pub fn perspective(mut self, perspective: impl Perspective) -> Self {
        self.extra.push(Arc::new(perspective));
        self
    }

    /// Adds a shared Rust perspective.
    pub fn perspective_arc(mut self, perspective: Arc<dyn Perspective>) -> Self {
        self.extra.push(perspective);
        self
    }

    /// Uses this store instead of connecting from the settings.
    pub fn store(mut self, store: Store) -> Self {
        self.store = Some(store);
        self
    }

    /// Uses this cooldown cache (e.g. to observe or pre-mark it in tests).
    pub fn cooldown_cache(mut self, cache: Arc<CooldownCache>) -> Self {
        self.cooldown = Some(cache);
        self
    }

    /// Serves HTTP on this already-bound listener instead of `http.listen`.
    pub fn http_listener(mut self, listener: TcpListener) -> Self {
        self.http = HttpMode::Listener(listener);
        self
    }

    /// No HTTP server.
    pub fn without_http(mut self) -> Self {
        self.http = HttpMode::Off;
        self
    }

    /// Uses this instance id (default: a random one).
    pub fn instance_id(mut self, instance: InstanceId) -> Self {
        self.instance = instance;
        self
    }

    /// Stops the daemon when `token` is cancelled: during [`start`](Self::start), which then
    /// returns [`DaemonError::Stopped`] (a connection retried or a migration waited on is
    /// abandoned), and afterwards, with the graceful shutdown.
    pub fn shutdown_on(mut self, token: CancellationToken) -> Self {
        self.shutdown = token;
        self
    }

    /// Checks what needs no database (perspectives, the HTTP address), connects, migrates
    /// (unless `database.auto_migrate = false`), prepares and registers the perspectives,
    /// registers the instance, and starts every loop.
    pub async fn start(self) -> Result<RunningDaemon, DaemonError> {
        let DaemonBuilder {
            settings,
            extra,
            store,
            cooldown,
            http,
            instance,
            shutdown,
        } = self;
        let settings = Arc::new(settings);

        // First what fails without a database, so such a start writes nothing.
        let registry = registry(&settings, extra)?;
        let listener = match http {
            HttpMode::Off => None,
            HttpMode::Listener(l) => Some(l),
            HttpMode::FromSettings => Some(
                crate::telemetry::http::bind(settings.http.listen)
                    .await
                    .map(|(l, _)| l)
                    .map_err(|e| DaemonError::Config(e.to_string()))?,
            ),
        };
        let metrics = crate::telemetry::recorder::install()
            .map_err(|e| DaemonError::Internal(e.to_string()))?;

        // Until the instance is registered, a stop abandons the start: nothing to give back.
        let store = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Err(DaemonError::Stopped),
            store = prepare_database(store, &settings, instance, &registry) => store?,
        };
        crate::telemetry::metrics::register_zeroes(&registry.names());
        let info = InstanceInfo::current("vantage");
        store.heartbeat(instance, &info).await?;
        // From here on a stop is the graceful shutdown (the supervisor below).

        let health = Health::new();
        health.set_database_ok(true);
        health.set_migrations_current(true);
        let cooldown = cooldown.or_else(|| {
            let c = &settings.cooldown;
            c.enabled
                .then(|| Arc::new(CooldownCache::new(c.ttl, c.max_entries)))
        });
        let mut tasks = Tasks::default();
        let http_addr =
            listener.and_then(|l| tasks.serve_http(l, HttpState::new(metrics, health.clone())));
        let names = registry.names();
        let worker = &settings.worker;
        let pipeline = Pipeline::new(store.clone(), instance, registry, cooldown.clone(), worker);
        let inflight = Arc::clone(&pipeline.inflight);
        let wake = tasks.spawn_consumers(&pipeline, &health, worker);
        let (driver, renewal) = tasks.spawn_background(Background {
            store: store.clone(),
            instance,
            info,
            settings: Arc::clone(&settings),
            health: health.clone(),
            inflight: Arc::clone(&inflight),
            cooldown: cooldown.clone(),
        });

        tracing::info!(%instance, perspectives = ?names, consumers = worker.consumers,
            http = ?http_addr, schema = %store.schema(), database = %store.target(), "vantage is running");
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);

        let stop = DrainAndStop {
            store,
            instance,
            inflight: Arc::clone(&inflight),
            health: health.clone(),
            grace: worker.shutdown_grace,
            stop_claiming: tasks.stop_claiming,
            stop_background: tasks.stop_background,
            stop_renewal: tasks.stop_renewal,
            renewal,
            consumers: tasks.consumers,
            consumer_tasks: tasks.consumer_tasks,
            background: tasks.background,
            _wake: wake,
        };
        let supervisor = {
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                shutdown.cancelled().await;
                drain_and_stop(stop).await
            })
        };

        Ok(RunningDaemon {
            instance,
            shutdown,
            health,
            http_addr,
            cooldown,
            inflight,
            driver,
            supervisor,
        })
    }
}

/// The SQL perspectives of the settings and the Rust ones added to the builder; at least one.
fn registry(
    settings: &Settings,
    extra: Vec<Arc<dyn Perspective>>,
) -> Result<PerspectiveRegistry, DaemonError> {
    let mut registry = PerspectiveRegistry::from_settings(&settings.perspectives)?;
    for p in extra {
        registry.add(p)?;
    }
    if registry.is_empty() {
        return Err(DaemonError::Config(
            "no perspectives configured: add a [[perspectives]] section to the configuration"
                .into(),
        ));
    }
    Ok(registry)
}

/// The loops of a running daemon and how they are stopped: consumers (and the work listener)
/// first, background tasks and HTTP last (see [`drain_and_stop`]).
#[derive(Default)]
struct Tasks {
    stop_claiming: CancellationToken,
    stop_background: CancellationToken,
    /// Lease renewal is stopped on its own, before deregistration: a renewal in flight locks
    /// the rows it renews, and deregistration skips locked rows.
    stop_renewal: CancellationToken,
    consumers: TaskTracker,
    consumer_tasks: Vec<JoinHandle<()>>,
    background: TaskTracker,
}

/// What the background tasks work with.
struct Background {
    store: Store,
    instance: InstanceId,
    info: InstanceInfo,
    settings: Arc<Settings>,
    health: Health,
    inflight: Arc<InFlight>,
    cooldown: Option<Arc<CooldownCache>>,
}

impl Tasks {
    /// Serves `/metrics` and the probes until the background tasks stop; returns the address.
    fn serve_http(&self, listener: TcpListener, state: HttpState) -> Option<SocketAddr> {
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
    fn spawn_consumers(
        &mut self,
        pipeline: &Pipeline,
        health: &Health,
        worker: &WorkerSettings,
    ) -> Arc<watch::Sender<u64>> {
        let (wake_tx, wake_rx) = watch::channel(0u64);
        let wake_tx = Arc::new(wake_tx);
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
            let pipeline = pipeline.clone();
            let wake = wake_rx.clone();
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
    fn spawn_background(&self, b: Background) -> (Driver, Vec<JoinHandle<()>>) {
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
                inflight: b.inflight,
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
        driver.spawn(
            "lane-reconciliation",
            reconcile::LaneReconciliation::PERIOD,
            // The start-up pass walks every lane once; give it time on a large backlog.
            Duration::from_secs(600),
            reconcile::LaneReconciliation::new(b.store.clone()),
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
            },
        );
        self.background.spawn(background::systemd_watchdog(
            b.health,
            self.stop_background.clone(),
        ));
        (driver, vec![heartbeat, renewal])
    }
}

/// Connects (unless given a store), brings the schema up to date or checks it, prepares the
/// SQL perspectives and registers every perspective. Abandoned as a whole by a stop.
async fn prepare_database(
    store: Option<Store>,
    settings: &Settings,
    instance: InstanceId,
    registry: &PerspectiveRegistry,
) -> Result<Store, DaemonError> {
    let store = match store {
        Some(s) => s,
        None => Store::connect(&daemon_store_options(settings, instance)).await?,
    };
    if settings.database.auto_migrate {
        for m in store.migrate().await? {
            tracing::info!(version = m.version, description = %m.description, "applied migration");
        }
    } else {
        store.check_migrations().await?;
    }
    crate::perspective::prepare_sql_perspectives(&store, &settings.perspectives).await?;
    registry.register_all(&store).await?;
    Ok(store)
}

struct DrainAndStop {
    store: Store,
    instance: InstanceId,
    inflight: Arc<InFlight>,
    health: Health,
    grace: Duration,
    stop_claiming: CancellationToken,
    stop_background: CancellationToken,
    stop_renewal: CancellationToken,
    renewal: Vec<JoinHandle<()>>,
    consumers: TaskTracker,
    consumer_tasks: Vec<JoinHandle<()>>,
    background: TaskTracker,
    _wake: Arc<watch::Sender<u64>>,
}

/// How long shutdown may take once the grace is over, whatever handlers or the database do.
/// The shipped stop timeouts (systemd, Kubernetes) keep a margin over grace + this.
pub const SHUTDOWN_TAIL: Duration = Duration::from_secs(6);

/// Graceful shutdown: not ready, stop claiming (a pending claim is abandoned: it is no work in
/// flight), let batches in flight finish within the grace (leases still renewed meanwhile),
/// then, bounded by [`SHUTDOWN_TAIL`]: abandon what still runs (its statements cancelled on the
/// server, so its transactions roll back), give back the rows its handlers had seen without a
/// refund, deregister (the rest go back with a refund of their claim's bump).
async fn drain_and_stop(s: DrainAndStop) -> Result<(), DaemonError> {
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

/// The daemon's connections: named after the instance (visible in `pg_stat_activity`), and a
/// transaction left idle by a stuck client is ended by the server after a lease (our batches
/// are never idle that long: every apply ends within `worker.apply_timeout`).
fn daemon_store_options(settings: &Settings, instance: InstanceId) -> StoreOptions {
    let mut options = StoreOptions::from_settings(&settings.database);
    options.application_name = format!("vantage {instance}");
    options.idle_in_transaction_timeout = Some(settings.worker.lease);
    options
}

/// A started daemon.
pub struct RunningDaemon {
    instance: InstanceId,
    shutdown: CancellationToken,
    health: Health,
    http_addr: Option<SocketAddr>,
    cooldown: Option<Arc<CooldownCache>>,
    inflight: Arc<InFlight>,
    driver: Driver,
    supervisor: JoinHandle<Result<(), DaemonError>>,
}

impl RunningDaemon {
    /// Its lease holder id.
    pub fn instance_id(&self) -> InstanceId {
        self.instance
    }

    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    /// Liveness and readiness state.
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// The cooldown cache, when enabled.
    pub fn cooldown(&self) -> Option<&Arc<CooldownCache>> {
        self.cooldown.as_ref()
    }

    /// Rows and streams in flight right now.
    pub fn inflight(&self) -> &Arc<InFlight> {
        &self.inflight
    }

    /// The latest status of each background task (`heartbeat`, `lease-renewal`, `sampler`,
    /// and `quarantine` when a perspective has `quarantine_after`).
    pub fn background_status(&self) -> BTreeMap<String, TaskStatus> {
        self.driver.statuses()
    }

    /// Wakes the background task named `name` before its timer would; false if there is none.
    pub fn activate(&self, name: &str) -> bool {
        self.driver.activator(name).map(|a| a.activate()).is_some()
    }

    /// A token that starts the graceful shutdown when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Starts the graceful shutdown and waits for it.
    pub async fn shutdown(self) -> Result<(), DaemonError> {
        self.shutdown.cancel();
        self.wait().await
    }

    /// Waits until the daemon has stopped.
    pub async fn wait(self) -> Result<(), DaemonError> {
        match self.supervisor.await {
            Ok(r) => r,
            Err(e) => Err(DaemonError::Internal(format!(
                "supervisor task failed: {e}"
            ))),
        }
    }
}
