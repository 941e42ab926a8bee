//! The quarantine task: pauses a perspective whose dead letters reached its `quarantine_after`.

use std::time::Duration;

use serde_json::{json, Value};

use super::{bounded, BackgroundTask};
use crate::config::{QuarantineAfter, Settings};
use crate::store::Store;
use crate::telemetry::metrics as m;

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
