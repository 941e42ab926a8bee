//! Throwaway PostgreSQL: a disposable local server for `vantage demo` and the integration tests.
//!
//! [`ThrowawayPostgres::start`] runs `initdb` into a fresh temporary directory and starts a
//! `postgres` on a free port of 127.0.0.1, tuned for speed over durability (no fsync). The
//! server is meant to be invisible once its owner is gone, so several layers make sure it
//! never outlives the process that started it:
//!
//! - dropping the handle shuts the server down immediately and removes the directory;
//! - a process-exit hook does the same for handles that are never dropped (statics in a test
//!   binary, `std::process::exit`);
//! - the postmaster gets `PR_SET_PDEATHSIG = SIGQUIT`, so even a `SIGKILL`ed owner takes its
//!   server with it;
//! - every start sweeps directories left behind by owners that no longer exist.
//!
//! One file per concept: [`ThrowawayPostgres`] here; `server` (the cluster: initdb, launch,
//! readiness, stop), `binaries` (finding `initdb`/`postgres` and the user to run them as),
//! `keeper` (the thread every server is spawned from), `exit_hook` (cleanup at process exit),
//! `reaper` (directories left by owners that are gone) and `error`.

mod binaries;
mod error;
mod exit_hook;
mod keeper;
mod reaper;
mod server;

use std::fs;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};

pub use error::ThrowawayError;

use binaries::{find_binaries, server_identity};
use error::io_error;
use exit_hook::{register, unregister};
use reaper::sweep_stale_dirs;
use server::{free_port, Inner, Launch};

/// Name prefix of every throwaway directory; the owner's pid follows, which is what lets a later
/// start recognise directories whose owner is gone.
const DIR_PREFIX: &str = "vantage-pg-";
/// How often startup picks a new port after losing a race for the previous one.
const PORT_ATTEMPTS: usize = 5;
/// `max_connections` of a server started with [`ThrowawayPostgres::start`].
pub const DEFAULT_MAX_CONNECTIONS: u32 = 300;

/// A PostgreSQL cluster in a temporary directory, listening on 127.0.0.1 with `trust`
/// authentication. Dropping it stops the server (immediate shutdown) and deletes everything.
///
/// All methods block (they run processes and sleep); call them through
/// `tokio::task::spawn_blocking` from async code.
pub struct ThrowawayPostgres {
    inner: Arc<Inner>,
}

impl ThrowawayPostgres {
    /// Create a cluster in a temporary directory, start it on a free port on 127.0.0.1, and
    /// wait until it accepts connections.
    ///
    /// Blocking: from async code call it through `tokio::task::spawn_blocking`. The server is
    /// spawned from an internal thread that lives as long as the process, so the calling
    /// thread may exit without taking the server with it.
    pub fn start() -> Result<ThrowawayPostgres, ThrowawayError> {
        Self::start_with_max_connections(DEFAULT_MAX_CONNECTIONS)
    }

    /// [`start`](Self::start) with room for `max_connections` sessions (`vantage soak` holds
    /// 300 idle ones beside its daemons).
    pub fn start_with_max_connections(
        max_connections: u32,
    ) -> Result<ThrowawayPostgres, ThrowawayError> {
        let bins = find_binaries().ok_or(ThrowawayError::BinariesNotFound)?;
        let (user, run_as) = server_identity()?;
        sweep_stale_dirs();

        let tempdir = tempfile::Builder::new()
            .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
            .tempdir_in(std::env::temp_dir())
            .map_err(io_error(format!(
                "creating a temporary directory in {}",
                std::env::temp_dir().display()
            )))?;
        let root = tempdir.path().to_path_buf();
        let inner = Inner {
            data_dir: root.join("data"),
            socket_dir: root.join("socket"),
            log_path: root.join("server.log"),
            root,
            postgres: bins.postgres,
            pg_isready: bins.pg_isready,
            user,
            run_as,
            port: AtomicU16::new(0),
            max_connections,
            pid: AtomicI32::new(0),
            lifecycle: Mutex::new(()),
            destroyed: AtomicBool::new(false),
        };
        fs::create_dir(&inner.socket_dir)
            .map_err(io_error(format!("creating {}", inner.socket_dir.display())))?;
        if let Some((uid, gid)) = run_as {
            // The server user must own everything it writes; the log file is opened by us.
            for dir in [&inner.root, &inner.socket_dir] {
                std::os::unix::fs::chown(dir, Some(uid), Some(gid))
                    .map_err(io_error(format!("handing {} to `postgres`", dir.display())))?;
            }
        }
        inner.initdb(&bins.initdb)?;

        // From here on the exit hook owns cleanup too, so a start that is interrupted by the
        // process exiting does not leak a server.
        let inner = Arc::new(inner);
        register(&inner);
        // Cleanup is now ours (and the exit hook's), not TempDir's.
        let _ = tempdir.keep();
        let server = ThrowawayPostgres { inner };

        let mut last_log_tail = String::new();
        for _ in 0..PORT_ATTEMPTS {
            let port = free_port()?;
            server.inner.port.store(port, Ordering::SeqCst);
            let launched = server.inner.launch(&server.inner.lock());
            match launched {
                Ok(()) => return Ok(server),
                Err(Launch::PortTaken(tail)) => last_log_tail = tail,
                Err(Launch::Failed(e)) => return Err(e),
            }
        }
        Err(ThrowawayError::NoFreePort {
            attempts: PORT_ATTEMPTS,
            log: server.inner.log_path.clone(),
            log_tail: last_log_tail,
        })
    }

    /// Connection URL of the `postgres` database: `postgres://USER@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        self.url_for("postgres")
    }

    /// Connection URL of another database on this server (which must exist to be used).
    pub fn url_for(&self, database: &str) -> String {
        let mut url = url::Url::parse(&format!("postgres://127.0.0.1:{}", self.port()))
            .expect("a host and port always make a valid URL");
        url.set_username(&self.inner.user)
            .expect("a URL with a host accepts a user name");
        url.path_segments_mut()
            .expect("a URL with a host has path segments")
            .clear()
            .push(database);
        url.to_string()
    }

    /// TCP port on 127.0.0.1; it stays the same across [`restart`](Self::restart).
    pub fn port(&self) -> u16 {
        self.inner.port.load(Ordering::SeqCst)
    }

    /// The cluster's data directory (PGDATA).
    pub fn data_dir(&self) -> &Path {
        &self.inner.data_dir
    }

    /// The database superuser name: `postgres` when running as root, else the current user.
    pub fn user(&self) -> &str {
        &self.inner.user
    }

    /// The server log, which also collects the output of every restart.
    pub fn log_path(&self) -> &Path {
        &self.inner.log_path
    }

    /// Stop the server in fast mode (open sessions are terminated) and start it again on the
    /// same port and data directory, waiting until it accepts connections.
    pub fn restart(&self) -> Result<(), ThrowawayError> {
        let guard = self.inner.lock();
        self.inner.stop_fast(&guard)?;
        self.inner.start_locked(&guard)
    }

    /// First half of [`restart`](Self::restart): fast shutdown, waiting until the server has
    /// exited. Does nothing if it is already stopped.
    pub fn stop(&self) -> Result<(), ThrowawayError> {
        let guard = self.inner.lock();
        self.inner.stop_fast(&guard)
    }

    /// Second half of [`restart`](Self::restart): start the stopped server again on the same
    /// port and wait until it accepts connections. Does nothing if it is already running.
    pub fn start_again(&self) -> Result<(), ThrowawayError> {
        let guard = self.inner.lock();
        self.inner.start_locked(&guard)
    }
}

impl std::fmt::Debug for ThrowawayPostgres {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThrowawayPostgres")
            .field("url", &self.url())
            .field("data_dir", &self.inner.data_dir)
            .field("pid", &self.inner.pid.load(Ordering::SeqCst))
            .finish()
    }
}

impl Drop for ThrowawayPostgres {
    fn drop(&mut self) {
        unregister(&self.inner);
        self.inner.destroy();
    }
}
