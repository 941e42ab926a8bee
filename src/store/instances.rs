//! Service instances: registration, heartbeat, graceful exit, dead-instance cleanup.

use std::time::Duration;

use chrono::{DateTime, Utc};
use std::fmt;

use uuid::Uuid;

use super::error::{map_db_error, StoreError};
use super::handle::Store;

/// Identifies one daemon process: the lease holder of the rows it claims.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceId(pub Uuid);

impl InstanceId {
    /// A fresh random instance id.
    pub fn new() -> Self {
        InstanceId(Uuid::new_v4())
    }
}

impl Default for InstanceId {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// What an instance says about itself when it registers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceInfo {
    /// Service name (`vantage` unless embedded under another name).
    pub service_name: String,
    /// Host name.
    pub host_name: String,
    /// OS process id.
    pub process_id: i32,
    /// Build version.
    pub version: String,
}

impl InstanceInfo {
    /// Describes the current process.
    pub fn current(service_name: &str) -> Self {
        InstanceInfo {
            service_name: service_name.to_string(),
            host_name: nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_default(),
            process_id: std::process::id() as i32,
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

/// A registered instance.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct LiveInstance {
    /// Its id.
    pub instance_id: Uuid,
    /// Service name.
    pub service_name: String,
    /// Host.
    pub host_name: String,
    /// Process id.
    pub process_id: i32,
    /// Version.
    pub version: String,
    /// Registration time.
    pub started_at: DateTime<Utc>,
    /// Last heartbeat.
    pub last_heartbeat_at: DateTime<Utc>,
}

impl Store {
    /// Registers or heartbeats. Returns false when the instance was not registered (first call,
    /// or it had been declared dead and its leases may have been taken over).
    pub(crate) async fn heartbeat(
        &self,
        instance: InstanceId,
        info: &InstanceInfo,
    ) -> Result<bool, StoreError> {
        sqlx::query_scalar("SELECT heartbeat($1, $2, $3, $4, $5)")
            .bind(instance.0)
            .bind(&info.service_name)
            .bind(&info.host_name)
            .bind(info.process_id)
            .bind(&info.version)
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)
    }

    /// Graceful exit: releases every lease of the instance with a refund and removes it.
    /// Returns how many leases were released.
    pub(crate) async fn deregister(&self, instance: InstanceId) -> Result<u64, StoreError> {
        let n: i32 = sqlx::query_scalar("SELECT deregister_instance($1)")
            .bind(instance.0)
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)?;
        Ok(n as u64)
    }

    /// Removes instances silent for longer than `stale_after`; returns their ids.
    pub(crate) async fn cleanup_dead_instances(
        &self,
        stale_after: Duration,
    ) -> Result<Vec<Uuid>, StoreError> {
        sqlx::query_scalar("SELECT cleanup_dead_instances($1)")
            .bind(stale_after.as_secs_f64())
            .fetch_all(&self.pool)
            .await
            .map_err(map_db_error)
    }

    /// Registered instances, oldest first.
    pub(crate) async fn live_instances(&self) -> Result<Vec<LiveInstance>, StoreError> {
        sqlx::query_as(
            "SELECT instance_id, service_name, host_name, process_id, version, started_at, \
                    last_heartbeat_at \
             FROM wh_service_instances ORDER BY started_at, instance_id",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }
}
