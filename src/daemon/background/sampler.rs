//! The sampler task: readiness, the database gauges, and the cooldown sweep.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::{bounded, BackgroundTask};
use crate::pipeline::cooldown::CooldownCache;
use crate::store::Store;
use crate::telemetry::health::Health;
use crate::telemetry::metrics as m;

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
