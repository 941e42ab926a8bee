//! The sampler task: readiness, the database gauges, the cooldown sweep, and the console's
//! chart history (`wh_metric_samples`, docs/operations.md "The metric history").

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::{bounded, BackgroundTask};
use crate::pipeline::cooldown::CooldownCache;
use crate::pipeline::inflight::InFlight;
use crate::store::{MinuteSample, Store, StoreGauges};
use crate::telemetry::health::Health;
use crate::telemetry::metrics as m;

/// A trim of the allocator's free memory and readiness (database reachable, migrations
/// current) every second; gauges from the database and a cooldown sweep every 15 s (the gauges count the
/// work table: a scan, so not more often than Prometheus typically scrapes). In the same round it writes the chart history: one
/// upsert of the current minute per perspective (the events this process applied since the
/// last write, the backlog and lag just read), then a trim of the minutes older than 24 hours;
/// each statement bounded by [`Sampler::HISTORY_TIMEOUT`].
pub struct Sampler {
    /// The database.
    pub store: Store,
    /// Where readiness is reported.
    pub health: Health,
    /// The cooldown cache to sweep.
    pub cooldown: Option<Arc<CooldownCache>>,
    /// Rounds with the database reachable so far.
    pub round: u64,
    /// Where the pipeline counts applied events (taken each history write).
    pub inflight: Arc<InFlight>,
}

impl Sampler {
    /// How often.
    pub const PERIOD: Duration = Duration::from_secs(1);

    /// The longest a history write or trim may take (then it is given up until the next round;
    /// the applied counts it carried are kept for that one).
    pub const HISTORY_TIMEOUT: Duration = Duration::from_secs(2);

    /// Writes this round's minute sample (gauges when they were read) and trims the history;
    /// what it did, for the task's status.
    async fn record_history(&self, gauges: Option<&StoreGauges>) -> Value {
        let taken = self.inflight.take_applied();
        let mut samples: Vec<MinuteSample> = gauges
            .map(|g| {
                g.perspectives
                    .iter()
                    .map(|p| MinuteSample {
                        perspective_name: p.perspective_name.clone(),
                        applied: 0,
                        backlog: Some(p.pending + p.leased + p.parked),
                        lag_seconds: Some(p.oldest_pending_age_seconds.unwrap_or(0.0)),
                    })
                    .collect()
            })
            .unwrap_or_default();
        for (name, n) in &taken {
            let n = i64::try_from(*n).unwrap_or(i64::MAX);
            match samples.iter_mut().find(|s| &s.perspective_name == name) {
                Some(s) => s.applied = n,
                None => samples.push(MinuteSample {
                    perspective_name: name.clone(),
                    applied: n,
                    backlog: None,
                    lag_seconds: None,
                }),
            }
        }
        let written = bounded(Self::HISTORY_TIMEOUT, self.store.record_samples(&samples)).await;
        if let Err(error) = &written {
            // Not written (or not known to be): the counts wait for the next round. A write that
            // committed just as its timeout fired counts twice; the sampler's timeout is far
            // above such a statement's time, so this is rare and bounded to one round.
            self.inflight
                .add_applied(taken.iter().map(|(p, n)| (p.as_str(), *n)));
            tracing::debug!(%error, "writing the metric history failed");
            return json!({"written": false, "error": error.to_string()});
        }
        match bounded(Self::HISTORY_TIMEOUT, self.store.trim_samples()).await {
            Ok(trimmed) => json!({"written": samples.len(), "trimmed": trimmed}),
            Err(error) => {
                tracing::debug!(%error, "trimming the metric history failed");
                json!({"written": samples.len(), "trimmed": false, "error": error.to_string()})
            }
        }
    }
}

impl BackgroundTask for Sampler {
    async fn activate(&mut self) -> Value {
        // Every second, whatever the database does: freed memory goes back to the system while
        // a burst churns, not only after it (see `memory`).
        super::memory::trim();
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
                let history = self.record_history(Some(&g)).await;
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
                json!({"database": "ok", "gauges": "sampled", "history": history})
            }
            Err(error) => {
                tracing::debug!(%error, "gauge sampling failed");
                let history = self.record_history(None).await;
                json!({"database": "ok", "gauges": "failed", "error": error.to_string(), "history": history})
            }
        }
    }
}
