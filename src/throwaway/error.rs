//! Why a throwaway server could not be created, started or stopped.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::Signal;

/// Why a throwaway server could not be created, started or stopped.
#[derive(thiserror::Error, Debug)]
pub enum ThrowawayError {
    /// Neither PATH nor `/usr/lib/postgresql/*/bin` has `initdb` and `postgres`.
    #[error(
        "PostgreSQL server binaries (initdb, postgres) not found on PATH or in \
         /usr/lib/postgresql/*/bin. Install Debian's `postgresql` package \
         (apt-get install postgresql) or set DATABASE_URL to an existing server."
    )]
    BinariesNotFound,

    /// Running as root, which PostgreSQL refuses, and there is no `postgres` user to switch to.
    #[error(
        "running as root, which the PostgreSQL server refuses, and there is no `postgres` \
         system user to run it as. Create one (`useradd --system --create-home postgres`; \
         Debian's `postgresql` package does this), run as an ordinary user, or set \
         DATABASE_URL to an existing server."
    )]
    NoPostgresUser,

    /// Running as root, the `postgres` user cannot reach the temporary directory.
    #[error(
        "the `postgres` user, which runs the server because we are root, cannot reach {dir}: \
         one of its parent directories is closed to it. Point TMPDIR at a directory it can \
         reach, such as /tmp."
    )]
    Unreachable {
        /// The throwaway directory.
        dir: PathBuf,
    },

    /// A filesystem or process operation failed; `action` says which.
    #[error("{action}: {source}")]
    Io {
        /// What was being attempted, e.g. "creating the temporary directory".
        action: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    /// `initdb` exited unsuccessfully.
    #[error("`{command}` failed ({status}){hint}. Its output:\n{output}")]
    InitdbFailed {
        /// The command line that was run.
        command: String,
        /// How it exited.
        status: String,
        /// An extra hint (the root case), or empty.
        hint: String,
        /// Its combined stdout and stderr.
        output: String,
    },

    /// Every port we tried was taken by someone else before the server could bind it.
    #[error(
        "PostgreSQL could not listen on 127.0.0.1: {attempts} free ports in a row were taken \
         by other processes before it could bind them. Server log ({log}):\n{log_tail}"
    )]
    NoFreePort {
        /// How many ports were tried.
        attempts: usize,
        /// The server log file.
        log: PathBuf,
        /// Its last lines.
        log_tail: String,
    },

    /// The postmaster exited before it was ready.
    #[error("PostgreSQL exited during startup ({status}). Server log ({log}):\n{log_tail}")]
    ExitedDuringStartup {
        /// How it exited.
        status: String,
        /// The server log file.
        log: PathBuf,
        /// Its last lines.
        log_tail: String,
    },

    /// The postmaster is running but did not become ready in time.
    #[error(
        "PostgreSQL did not accept connections on 127.0.0.1:{port} within {timeout:?}. \
         Server log ({log}):\n{log_tail}"
    )]
    NotReady {
        /// The port it should listen on.
        port: u16,
        /// How long we waited.
        timeout: Duration,
        /// The server log file.
        log: PathBuf,
        /// Its last lines.
        log_tail: String,
    },

    /// Signalling the postmaster failed.
    #[error("could not send {signal} to the PostgreSQL postmaster (pid {pid}): {source}")]
    Signal {
        /// The postmaster's pid.
        pid: i32,
        /// The signal.
        signal: Signal,
        /// The underlying error.
        #[source]
        source: Errno,
    },
}

pub(super) fn io_error(action: impl Into<String>) -> impl FnOnce(io::Error) -> ThrowawayError {
    let action = action.into();
    move |source| ThrowawayError::Io { action, source }
}
