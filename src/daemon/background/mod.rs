//! Background tasks, after omicron's: each is woken by its timer or by an [`Activator`], takes
//! no input, is idempotent, and reports a small JSON status. One [`Driver`] runs them all, so
//! the interval/select/beat skeleton exists once; every task survives a lost database (it
//! logs, reports unreadiness, and tries again on its next activation).
//!
//! The tasks, one file each: [`heartbeat`], lease [`renewal`], the [`sampler`] (which also hands
//! freed [`memory`] back), [`quarantine`], lane [`reconcile`]iation, the [`backfill`] of new
//! versions; and the systemd [`watchdog`], which is not a task of the driver.

mod backfill;
mod heartbeat;
mod memory;
mod quarantine;
mod reconcile;
mod renewal;
mod sampler;
mod watchdog;

pub use backfill::Backfill;
pub use heartbeat::Heartbeat;
pub use quarantine::Quarantine;
pub use reconcile::LaneReconciliation;
pub use renewal::LeaseRenewal;
pub use sampler::Sampler;
pub use watchdog::systemd_watchdog;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::store::StoreError;
use crate::telemetry::health::Health;

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
    #[cfg(test)]
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
    #[cfg(test)]
    pub fn activator(&self, name: &str) -> Option<Activator> {
        self.lock_activators().get(name).cloned()
    }

    /// The latest status of every task that has run.
    #[cfg(test)]
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
pub(super) async fn bounded<T>(
    limit: Duration,
    fut: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(limit, fut)
        .await
        .unwrap_or(Err(StoreError::Timeout(limit)))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

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
