//! The daemon: start-up checks, consumer loops, background tasks, graceful shutdown.
//!
//! [`DaemonBuilder::start`] installs no signal handler: it stops when the token given to
//! [`DaemonBuilder::shutdown_on`] (or [`RunningDaemon::shutdown_token`]) is cancelled, as
//! mini-redis's `server::run(listener, shutdown)` does. Only the binary's front end
//! (`crate::cli`) knows about signals and exit codes.
//!
//! Start-up is in `startup`, the loops it starts in `tasks` (consumers) and `background` (the
//! periodic tasks), and the graceful shutdown in `shutdown`.

mod background;
mod consumer;
mod listener;
mod shutdown;
mod startup;
mod tasks;
mod wake;

pub use shutdown::SHUTDOWN_TAIL;
pub use startup::DaemonBuilder;

/// How often a daemon checks its perspectives with `quarantine_after`.
pub(crate) const QUARANTINE_PERIOD: Duration = background::Quarantine::PERIOD;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::perspective::RegistryError;
use crate::pipeline::cooldown::CooldownCache;
use crate::store::{InstanceId, StoreError};

/// Why the daemon could not start or stopped abnormally (`crate::cli::exit` maps each to an
/// exit code).
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Configuration problem (bad perspective statement, none configured, an HTTP address that
    /// cannot be bound).
    #[error("{0}")]
    Config(String),
    /// The database: unreachable past `database.connect_timeout`, refused the credentials,
    /// has no such database, or a schema this binary cannot run on.
    #[error(transparent)]
    Store(StoreError),
    /// The shutdown token was cancelled during start-up: nothing was claimed, nothing is left
    /// registered.
    #[error("stopped during start-up")]
    Stopped,
    /// Anything else.
    #[error("{0}")]
    Internal(String),
}

impl From<RegistryError> for DaemonError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::Store(e) => DaemonError::Store(e),
            other => DaemonError::Config(other.to_string()),
        }
    }
}

impl From<StoreError> for DaemonError {
    fn from(e: StoreError) -> Self {
        DaemonError::Store(e)
    }
}

/// A started daemon. It drains until its shutdown token is cancelled
/// ([`DaemonBuilder::shutdown_on`], [`shutdown_token`](Self::shutdown_token)); [`wait`](Self::wait)
/// for it to stop, or [`shutdown`](Self::shutdown) to stop it.
pub struct RunningDaemon {
    instance: InstanceId,
    shutdown: CancellationToken,
    http_addr: Option<SocketAddr>,
    cooldown: Option<Arc<CooldownCache>>,
    supervisor: JoinHandle<Result<(), DaemonError>>,
}

impl RunningDaemon {
    /// The id it claims leases and heartbeats as (its connections' `application_name` carries
    /// it too, so its sessions can be told apart in `pg_stat_activity`).
    pub fn instance_id(&self) -> InstanceId {
        self.instance
    }

    /// Where `/metrics`, `/healthz` and `/readyz` are served.
    pub fn http_addr(&self) -> Option<SocketAddr> {
        self.http_addr
    }

    /// The cooldown cache, when enabled.
    pub(crate) fn cooldown(&self) -> Option<&Arc<CooldownCache>> {
        self.cooldown.as_ref()
    }

    /// A token that starts the graceful shutdown when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Starts the graceful shutdown and waits for it.
    pub async fn shutdown(self) -> Result<(), DaemonError> {
        self.shutdown.cancel();
        self.wait().await
    }

    /// Waits until the daemon has stopped.
    pub async fn wait(self) -> Result<(), DaemonError> {
        match self.supervisor.await {
            Ok(r) => r,
            Err(e) => Err(DaemonError::Internal(format!(
                "supervisor task failed: {e}"
            ))),
        }
    }
}
