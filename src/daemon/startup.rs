//! Start-up: what fails without a database first (so such a start writes nothing), then the
//! database (connect, migrate, prepare and register the perspectives), then the instance row,
//! then every loop, and the supervisor that runs the shutdown when the token is cancelled.

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::shutdown::{drain_and_stop, DrainAndStop};
use super::tasks::{Background, Tasks};
use super::{DaemonError, RunningDaemon};
use crate::config::Settings;
use crate::perspective::{Perspective, PerspectiveRegistry};
use crate::pipeline::cooldown::CooldownCache;
use crate::pipeline::Pipeline;
use crate::store::{InstanceId, InstanceInfo, Store, StoreError, StoreOptions};
use crate::telemetry::health::Health;
use crate::telemetry::http::HttpState;

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
    pub(crate) fn cooldown_cache(mut self, cache: Arc<CooldownCache>) -> Self {
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
        let mut registry = registry(&settings, extra)?;
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
            store = prepare_database(store, &settings, instance, &mut registry) => store?,
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
        let (_driver, renewal) = tasks.spawn_background(Background {
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
            http_addr,
            cooldown,
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
    if registry.is_empty() && !settings.perspectives.iter().any(|p| p.is_versioned()) {
        return Err(DaemonError::Config(
            "no perspectives configured: add a [[perspectives]] section to the configuration"
                .into(),
        ));
    }
    Ok(registry)
}

/// Connects (unless given a store), brings the schema up to date or checks it, prepares the
/// SQL perspectives and registers every perspective. Abandoned as a whole by a stop.
async fn prepare_database(
    store: Option<Store>,
    settings: &Settings,
    instance: InstanceId,
    registry: &mut PerspectiveRegistry,
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
    let versions = crate::perspective::register_versions(&store, &settings.perspectives).await?;
    if !versions.is_empty() {
        let mut conn = store.pool().acquire().await.map_err(StoreError::from)?;
        for v in versions {
            // (the apply statement names the version's function: checked like any statement)
            v.prepare(&mut conn)
                .await
                .map_err(|e| DaemonError::Config(e.to_string()))?;
            registry.add(Arc::new(v))?;
        }
    }
    registry.register_all(&store).await?;
    Ok(store)
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
