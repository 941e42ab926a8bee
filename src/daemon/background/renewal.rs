//! The lease renewal task: keeps the leases of the rows in flight from running out.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::BackgroundTask;
use crate::pipeline::inflight::InFlight;
use crate::store::{InstanceId, Store};

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
