//! The backfill task: brings each building version of a versioned perspective up to date with
//! the event store's history, one bounded batch (its own short transaction) at a time
//! (docs/versions.md, "Backfill"). Any daemon may run it: a batch locks its version row
//! without waiting, so of several daemons one advances a version at a time, and a killed
//! daemon's progress is the last committed batch.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{bounded, BackgroundTask};
use crate::sqlstate::is_conflict;
use crate::store::{Store, StoreError};
use crate::telemetry::metrics as m;

/// Backfills the building versions of `perspectives`.
pub struct Backfill {
    /// The database.
    pub store: Store,
    /// The versioned perspectives this daemon configures.
    pub perspectives: Vec<String>,
    /// Events looked at per batch.
    pub batch: i32,
    /// When progress was last logged, per (perspective, version).
    logged: std::collections::HashMap<(String, i32), Instant>,
    /// When the version gauges were last set.
    sampled: Option<Instant>,
}

impl Backfill {
    /// How often it looks for work when there is none (a round with work keeps going).
    pub const PERIOD: Duration = Duration::from_secs(1);
    /// One round's budget: the driver's beat comes between rounds.
    const ROUND: Duration = Duration::from_secs(5);
    /// How often progress is logged.
    const LOG_EVERY: Duration = Duration::from_secs(10);
    /// How often the version gauges are set (counting what a version is behind reads its
    /// pending rows, and while it builds the history after its position).
    const SAMPLE_EVERY: Duration = Duration::from_secs(5);
    /// The longest one batch may take before it is diverted to the drain.
    const BATCH_LIMIT: Duration = Duration::from_secs(60);
    /// How long one batch may run before it stops taking events (checked every 100 events):
    /// a batch is one transaction, so this bounds how long the backfill holds a snapshot, however
    /// slow the version's statements or the server.
    pub const BATCH_TIME: Duration = Duration::from_millis(50);

    /// Backfills the building versions of these perspectives, `batch` events per transaction.
    pub fn new(store: Store, perspectives: Vec<String>, batch: i32) -> Backfill {
        Backfill {
            store,
            perspectives,
            batch,
            logged: Default::default(),
            sampled: None,
        }
    }
}

impl BackgroundTask for Backfill {
    async fn activate(&mut self) -> Value {
        let started = Instant::now();
        let building = match bounded(
            Duration::from_secs(10),
            self.store.building_versions(&self.perspectives),
        )
        .await
        {
            Ok(b) => b,
            Err(error) => {
                tracing::debug!(%error, "backfill: listing building versions failed");
                return json!({"error": error.to_string()});
            }
        };
        let mut report = Vec::new();
        for (name, version) in building {
            let mut applied = 0i64;
            let mut last = None;
            while started.elapsed() < Self::ROUND {
                let step = match bounded(
                    Self::BATCH_LIMIT,
                    self.store.backfill_version(
                        &name,
                        version,
                        self.batch,
                        Self::BATCH_TIME,
                        false,
                    ),
                )
                .await
                {
                    Err(error) if diverts(&error) => {
                        // One event's statement fails (or the batch is too slow): retrying the
                        // same batch would fail for ever, so its events go to the drain, which
                        // retries and dead-letters them one by one as for any perspective.
                        let step = bounded(
                            Self::BATCH_LIMIT,
                            self.store.backfill_version(
                                &name,
                                version,
                                self.batch,
                                Self::BATCH_TIME,
                                true,
                            ),
                        )
                        .await;
                        if let Ok(step) = &step {
                            tracing::warn!(perspective = %name, version, %error,
                                position = step.backfill_position, diverted = step.diverted,
                                "backfill of {name} version {version}: a batch could not be applied ({error}); its {} event(s) go through the drain instead, where failures are retried and dead-lettered as usual",
                                step.diverted);
                        }
                        step
                    }
                    other => other,
                };
                match step {
                    Ok(step) => {
                        applied += i64::from(step.applied);
                        let outcome = step.outcome.clone();
                        last = Some(step);
                        match outcome.as_str() {
                            "applied" => {}
                            // Old transactions usually end within milliseconds: look again
                            // soon rather than a period later.
                            "waiting" => tokio::time::sleep(Duration::from_millis(50)).await,
                            _ => break,
                        }
                    }
                    Err(error) => {
                        tracing::warn!(perspective = %name, version, %error, "backfill batch failed; it is retried");
                        break;
                    }
                }
            }
            let Some(step) = last else { continue };
            let position = step.backfill_position.unwrap_or(0);
            let target = step.backfill_target.unwrap_or(0);
            match step.outcome.as_str() {
                "live" => tracing::warn!(perspective = %name, version, position,
                    "perspective {name} version {version} is live: its backfill is done and no version was live"),
                "ready" => tracing::info!(perspective = %name, version, position,
                    "perspective {name} version {version} is ready: its backfill is done; make it live with `vantage perspectives cutover {name}`"),
                "waiting" => {
                    if self.due(&name, version) {
                        tracing::info!(perspective = %name, version,
                            "backfill of {name} version {version} waits for transactions older than its registration to end");
                    }
                }
                _ => {
                    if self.due(&name, version) {
                        tracing::info!(perspective = %name, version, position, target,
                            "backfill of {name} version {version}: at position {position} of {target}");
                    }
                }
            }
            report.push(json!({"perspective": name, "version": version,
                "outcome": step.outcome, "applied": applied, "position": position}));
        }
        self.sample().await;
        json!({"versions": report})
    }
}

/// Whether a failed batch is diverted to the drain: not when the database is away or the
/// transaction lost a conflict (the same batch is retried later), for anything else yes.
fn diverts(error: &StoreError) -> bool {
    match error {
        StoreError::Conflict(_) => false,
        StoreError::Database(e) => !crate::sqlstate::is_connection_error(e) && !is_conflict(e),
        other => !other.is_connection_error(),
    }
}

impl Backfill {
    /// Sets `vantage_perspective_version_behind` and `vantage_perspective_live_version` for the
    /// configured versioned perspectives, every [`Self::SAMPLE_EVERY`].
    async fn sample(&mut self) {
        if self
            .sampled
            .is_some_and(|at| at.elapsed() < Self::SAMPLE_EVERY)
        {
            return;
        }
        self.sampled = Some(Instant::now());
        let Ok(all) = bounded(Duration::from_secs(10), self.store.all_version_status()).await
        else {
            return;
        };
        for name in &self.perspectives {
            let mut live = 0.0;
            for v in all.iter().filter(|v| &v.perspective_name == name) {
                if v.state == "live" {
                    live = f64::from(v.version);
                }
                metrics::gauge!(m::PERSPECTIVE_VERSION_BEHIND,
                    m::LABEL_PERSPECTIVE => name.clone(), m::LABEL_VERSION => v.version.to_string())
                .set(v.behind as f64);
            }
            metrics::gauge!(m::PERSPECTIVE_LIVE_VERSION, m::LABEL_PERSPECTIVE => name.clone())
                .set(live);
        }
    }

    /// Whether progress of this version is due to be logged (and notes that it was).
    fn due(&mut self, name: &str, version: i32) -> bool {
        let now = Instant::now();
        let key = (name.to_string(), version);
        match self.logged.get(&key) {
            Some(at) if now.duration_since(*at) < Self::LOG_EVERY => false,
            _ => {
                self.logged.insert(key, now);
                true
            }
        }
    }
}
