//! The heartbeat task: this instance's row in `wh_service_instances`, then the removal of
//! instances silent past `orphans.stale_after` (docs/pipeline.md, "Instances and orphans").

use std::sync::Arc;

use serde_json::{json, Value};

use super::{bounded, BackgroundTask};
use crate::config::Settings;
use crate::store::{InstanceId, InstanceInfo, Store, StoreError};
use crate::telemetry::health::Health;

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
