//! Background tasks (heartbeat, lease renewal, sampler, quarantine), after omicron's: each is woken by its timer or by an [`Activator`], takes
//! no input, is idempotent, and reports a small JSON status. One [`Driver`] runs them all, so
//! the interval/select/beat skeleton exists once; every task survives a lost database (it
//! logs, reports unreadiness, and tries again on its next activation).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{QuarantineAfter, Settings};
use crate::pipeline::cooldown::CooldownCache;
use crate::pipeline::inflight::InFlight;
use crate::store::{InstanceId, InstanceInfo, Store, StoreError};
use crate::telemetry::health::Health;
use crate::telemetry::metrics as m;

/// A periodic task. `activate` does one round of its work; calling it again is harmless.
pub trait BackgroundTask: Send + 'static {
    /// One round; returns what it found, for [`Driver::statuses`].
    fn activate(&mut self) -> impl Future<Output = Value> + Send;
}

/// Wakes a task before its timer does (activations while it runs are folded into one).
#[derive(Clone, Debug, Default)]
pub struct Activator(Arc<Notify>);

impl Activator {
    /// Asks for one more activation soon.
    pub fn activate(&self) {
        self.0.notify_one();
    }
}

/// The latest status of one task.
#[derive(Clone, Debug, PartialEq)]
pub struct TaskStatus {
    /// How often it has run.
    pub activations: u64,
    /// What its last round reported.
    pub last: Value,
}

type Statuses = Arc<Mutex<BTreeMap<&'static str, TaskStatus>>>;

/// Runs background tasks until its token is cancelled; registers each as a loop of the
/// daemon's [`Health`] (so `/healthz` fails if one stalls or dies).
#[derive(Clone)]
pub struct Driver {
    health: Health,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    statuses: Statuses,
    activators: Arc<Mutex<BTreeMap<&'static str, Activator>>>,
}

impl Driver {
    /// Tasks spawned on `tracker`, stopped by `shutdown`.
    pub fn new(health: Health, shutdown: CancellationToken, tracker: TaskTracker) -> Driver {
        Driver {
            health,
            shutdown,
            tracker,
            statuses: Statuses::default(),
            activators: Default::default(),
        }
    }

    /// Starts `task`: activated at once, then every `period` and whenever its activator is
    /// used; counted stalled by `/healthz` once silent for `stale_after`. It stops with the
    /// driver.
    pub fn spawn<T: BackgroundTask>(
        &self,
        name: &'static str,
        period: Duration,
        stale_after: Duration,
        task: T,
    ) -> Activator {
        let stop = self.shutdown.clone();
        self.spawn_until(name, period, stale_after, task, stop).0
    }

    /// Like [`spawn`](Self::spawn), stopped by `stop` instead of the driver's token (for a task
    /// the shutdown sequence stops on its own); also returns its handle, to wait for it.
    pub fn spawn_until<T: BackgroundTask>(
        &self,
        name: &'static str,
        period: Duration,
        stale_after: Duration,
        mut task: T,
        stop: CancellationToken,
    ) -> (Activator, JoinHandle<()>) {
        let activator = Activator::default();
        self.lock_activators().insert(name, activator.clone());
        let beat = self.health.register_loop(name, stale_after);
        let wake = Arc::clone(&activator.0);
        let statuses = Arc::clone(&self.statuses);
        let handle = self.tracker.spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => break,
                    _ = tick.tick() => {}
                    _ = wake.notified() => {}
                }
                beat.beat();
                let last = task.activate().await;
                let mut all = statuses.lock().unwrap_or_else(PoisonError::into_inner);
                let entry = all.entry(name).or_insert(TaskStatus {
                    activations: 0,
                    last: Value::Null,
                });
                entry.activations += 1;
                entry.last = last;
            }
            beat.finish();
        });
        (activator, handle)
    }

    /// The activator of the task named `name`.
    pub fn activator(&self, name: &str) -> Option<Activator> {
        self.lock_activators().get(name).cloned()
    }

    /// The latest status of every task that has run.
    pub fn statuses(&self) -> BTreeMap<String, TaskStatus> {
        self.statuses
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect()
    }

    fn lock_activators(&self) -> std::sync::MutexGuard<'_, BTreeMap<&'static str, Activator>> {
        self.activators
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// `fut`, or [`StoreError::Timeout`] once `limit` has passed.
async fn bounded<T>(
    limit: Duration,
    fut: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(limit, fut)
        .await
        .unwrap_or(Err(StoreError::Timeout(limit)))
}

// ---------------------------------------------------------------------------------------------
// The tasks

/// Heartbeat into `wh_service_instances`, then dead-instance cleanup.
pub struct Heartbeat {
    /// The database.
    pub store: Store,
    /// This instance.
    pub instance: InstanceId,
    /// What the instance row says about this process.
    pub info: InstanceInfo,
    /// `orphans.*`.
    pub settings: Arc<Settings>,
    /// Where "database reachable" is reported.
    pub health: Health,
}

impl BackgroundTask for Heartbeat {
    async fn activate(&mut self) -> Value {
        // Bounded by the interval: a database that does not answer must not stall the loop
        // (its liveness is about this process, not about the database).
        let limit = self.settings.orphans.heartbeat_interval;
        let stale_after = self.settings.orphans.stale_after;
        match bounded(limit, self.store.heartbeat(self.instance, &self.info)).await {
            Ok(true) => self.health.set_database_ok(true),
            Ok(false) => {
                self.health.set_database_ok(true);
                tracing::warn!(instance = %self.instance, "this instance had been declared dead (silent past orphans.stale_after) and registered again; leases it held may have been taken over");
            }
            Err(StoreError::Timeout(_)) => {
                self.health.set_database_ok(false);
                tracing::warn!(timeout = ?limit, "heartbeat got no answer from the database");
                return json!({"heartbeat": "no answer"});
            }
            Err(error) => {
                self.health.set_database_ok(false);
                tracing::warn!(%error, "heartbeat failed");
                return json!({"heartbeat": "failed", "error": error.to_string()});
            }
        }
        match bounded(limit, self.store.cleanup_dead_instances(stale_after)).await {
            Ok(dead) => {
                for id in &dead {
                    tracing::warn!(dead_instance = %id, stale_after = ?stale_after,
                        "removed a silent instance; its leases will be taken over");
                }
                json!({"heartbeat": "ok", "removed_instances": dead.len()})
            }
            Err(error) => {
                tracing::warn!(%error, "dead-instance cleanup failed");
                json!({"heartbeat": "ok", "cleanup": "failed", "error": error.to_string()})
            }
        }
    }
}

/// Renews the leases of rows in flight, so a slow apply never loses its lease.
pub struct LeaseRenewal {
    /// The database.
    pub store: Store,
    /// This instance (the lease holder).
    pub instance: InstanceId,
    /// What is in flight.
    pub inflight: Arc<InFlight>,
    /// `worker.lease`.
    pub lease: Duration,
}

impl LeaseRenewal {
    /// How often: a third of the lease, at most five times a second.
    pub fn period(lease: Duration) -> Duration {
        (lease / 3).max(Duration::from_millis(200))
    }
}

impl BackgroundTask for LeaseRenewal {
    async fn activate(&mut self) -> Value {
        match self
            .inflight
            .renew(&self.store, self.instance, self.lease)
            .await
        {
            Ok((0, _)) => json!({"in_flight": 0}),
            Ok((in_flight, n)) => {
                if (n as usize) < in_flight {
                    tracing::debug!(
                        in_flight,
                        renewed = n,
                        "some rows in flight are no longer ours (completed meanwhile, or taken over)"
                    );
                }
                json!({"in_flight": in_flight, "renewed": n})
            }
            Err(error) => {
                tracing::warn!(%error, "lease renewal failed");
                json!({"error": error.to_string()})
            }
        }
    }
}

/// Readiness (database reachable, migrations current) every second; gauges from the database
/// and a cooldown sweep every 15 s (the gauges count the work table: a scan, so not more often
/// than Prometheus typically scrapes).
pub struct Sampler {
    /// The database.
    pub store: Store,
    /// Where readiness is reported.
    pub health: Health,
    /// The cooldown cache to sweep.
    pub cooldown: Option<Arc<CooldownCache>>,
    /// Rounds with the database reachable so far.
    pub round: u64,
}

impl Sampler {
    /// How often.
    pub const PERIOD: Duration = Duration::from_secs(1);
}

impl BackgroundTask for Sampler {
    async fn activate(&mut self) -> Value {
        // A ping waits at most a second: readiness must flip promptly when the database goes.
        let up = bounded(Duration::from_secs(1), self.store.ping())
            .await
            .is_ok();
        self.health.set_database_ok(up);
        if !up {
            return json!({"database": "unreachable"});
        }
        // Rounds with the database count (as before: the checks resume where they left off).
        let n = self.round;
        self.round = self.round.wrapping_add(1);
        if n % 30 == 0 {
            self.health
                .set_migrations_current(self.store.check_migrations().await.is_ok());
        }
        if n % 15 != 0 {
            return json!({"database": "ok"});
        }
        if let Some(cache) = &self.cooldown {
            cache.sweep();
        }
        match bounded(Duration::from_secs(10), self.store.gauges()).await {
            Ok(g) => {
                for p in g.perspectives {
                    let label = p.perspective_name;
                    let blocked = g.blocked.iter().find(|b| b.perspective_name == label);
                    metrics::gauge!(m::BLOCKED_LANES, m::LABEL_PERSPECTIVE => label.clone())
                        .set(blocked.map_or(0, |b| b.lanes) as f64);
                    metrics::gauge!(m::BLOCKED_EVENTS, m::LABEL_PERSPECTIVE => label.clone())
                        .set(blocked.map_or(0, |b| b.events) as f64);
                    metrics::gauge!(m::PERSPECTIVE_PAUSED, m::LABEL_PERSPECTIVE => label.clone())
                        .set(if p.paused_at.is_some() { 1.0 } else { 0.0 });
                    metrics::gauge!(m::BACKLOG_EVENTS, m::LABEL_PERSPECTIVE => label.clone())
                        .set((p.pending + p.leased + p.parked) as f64);
                    metrics::gauge!(m::DEAD_LETTERS, m::LABEL_PERSPECTIVE => label.clone())
                        .set(p.dead_lettered as f64);
                    metrics::gauge!(m::OLDEST_PENDING_AGE_SECONDS, m::LABEL_PERSPECTIVE => label)
                        .set(p.oldest_pending_age_seconds.unwrap_or(0.0));
                }
                metrics::gauge!(m::INSTANCES_LIVE).set(g.instances_live as f64);
                json!({"database": "ok", "gauges": "sampled"})
            }
            Err(error) => {
                tracing::debug!(%error, "gauge sampling failed");
                json!({"database": "ok", "gauges": "failed", "error": error.to_string()})
            }
        }
    }
}

/// Automatic quarantine: pauses each watched perspective whose dead letters reached its
/// `quarantine_after` (counting those within its window and since it was last resumed). Of
/// several daemons only the one whose update paused it logs the WARN line and counts it.
pub struct Quarantine {
    /// The database.
    pub store: Store,
    /// The perspectives with `quarantine_after`, and theirs.
    pub watched: Vec<(String, QuarantineAfter)>,
}

impl Quarantine {
    /// How often: a dead letter takes at least one failed claim, and a pause a few seconds
    /// late changes little; each round is one bounded statement per watched perspective.
    pub const PERIOD: Duration = Duration::from_secs(5);

    /// The perspectives of `settings` with `quarantine_after` (none: no task is needed).
    pub fn watched(settings: &Settings) -> Vec<(String, QuarantineAfter)> {
        settings
            .perspectives
            .iter()
            .filter_map(|p| p.quarantine_after.map(|q| (p.name.clone(), q)))
            .collect()
    }
}

impl BackgroundTask for Quarantine {
    async fn activate(&mut self) -> Value {
        let mut quarantined = Vec::new();
        let mut failed = Vec::new();
        for (name, rule) in &self.watched {
            let reason = rule.reason();
            let attempt =
                self.store
                    .quarantine_perspective(name, rule.dead_letters, rule.window, &reason);
            match bounded(Duration::from_secs(10), attempt).await {
                Ok(Some(_since)) => {
                    let rule_text = rule.to_string();
                    tracing::warn!(perspective = name.as_str(),
                        quarantine_after = rule_text.as_str(), reason = reason.as_str(),
                        "perspective quarantined: paused, its claims stop; see `vantage dlq groups --perspective {name}`, then `vantage perspectives resume {name}`");
                    metrics::counter!(m::PERSPECTIVE_QUARANTINES_TOTAL,
                        m::LABEL_PERSPECTIVE => name.clone())
                    .increment(1);
                    metrics::gauge!(m::PERSPECTIVE_PAUSED, m::LABEL_PERSPECTIVE => name.clone())
                        .set(1.0);
                    quarantined.push(name.clone());
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::debug!(perspective = %name, %error, "quarantine check failed");
                    failed.push(json!({"perspective": name, "error": error.to_string()}));
                }
            }
        }
        json!({"watched": self.watched.len(), "quarantined": quarantined, "failed": failed})
    }
}

/// Pings the systemd watchdog (when `WatchdogSec=` is set) at half its interval, as long as
/// every loop of the process is alive. Deliberately not tied to the database: a lost database
/// is not fatal (SPEC §5), so systemd must not restart us for it. Not a [`BackgroundTask`]:
/// it is not itself a loop `/healthz` watches (it watches them).
pub async fn systemd_watchdog(health: Health, shutdown: CancellationToken) {
    let mut usec = 0;
    if !sd_notify::watchdog_enabled(false, &mut usec) || usec == 0 {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_micros(usec) / 2);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        if health.liveness().is_ok() {
            let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Counter(u64);

    impl BackgroundTask for Counter {
        async fn activate(&mut self) -> Value {
            self.0 += 1;
            json!({"count": self.0})
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_runs_on_its_timer_and_on_activation_and_reports_its_status() {
        let health = Health::new();
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let driver = Driver::new(health.clone(), shutdown.clone(), tracker.clone());
        let activator = driver.spawn(
            "counter",
            Duration::from_secs(60),
            Duration::from_secs(600),
            Counter(0),
        );
        // The first activation is immediate.
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(driver.statuses()["counter"].activations, 1);
        // An activation does not wait for the timer.
        activator.activate();
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(driver.statuses()["counter"].last, json!({"count": 2}));
        // The timer.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(driver.statuses()["counter"].activations, 3);
        assert!(driver.activator("counter").is_some());
        assert_eq!(health.liveness(), Ok(()));

        // A task with a stop of its own ends when that is cancelled, the others go on.
        let own = CancellationToken::new();
        let (_, handle) = driver.spawn_until(
            "own",
            Duration::from_secs(60),
            Duration::from_secs(600),
            Counter(0),
            own.clone(),
        );
        own.cancel();
        handle.await.expect("the task ends");
        assert!(!shutdown.is_cancelled());

        shutdown.cancel();
        tracker.close();
        tracker.wait().await;
        // Finished on purpose: it no longer counts for liveness.
        assert_eq!(health.liveness(), Ok(()));
    }
}
