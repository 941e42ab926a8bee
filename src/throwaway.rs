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

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU16, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, Once, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{geteuid, getppid, Pid, User};

/// Name prefix of every throwaway directory; the owner's pid follows, which is what lets a later
/// start recognise directories whose owner is gone.
const DIR_PREFIX: &str = "vantage-pg-";
/// Where Debian (and derivatives) install versioned server binaries.
const DEBIAN_PG_ROOT: &str = "/usr/lib/postgresql";
/// How long a start may take before we give up and show the server log.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How often startup picks a new port after losing a race for the previous one.
const PORT_ATTEMPTS: usize = 5;
/// Fast shutdown waits for nothing but in-flight commits; a minute means something is wrong.
const FAST_STOP_TIMEOUT: Duration = Duration::from_secs(60);
/// Immediate shutdown should take milliseconds; after this we escalate to SIGKILL.
const QUIT_TIMEOUT: Duration = Duration::from_secs(10);
/// Lines of server log quoted in startup errors.
const LOG_TAIL_LINES: usize = 40;

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

fn io_error(action: impl Into<String>) -> impl FnOnce(io::Error) -> ThrowawayError {
    let action = action.into();
    move |source| ThrowawayError::Io { action, source }
}

/// A PostgreSQL cluster in a temporary directory, listening on 127.0.0.1 with `trust`
/// authentication. Dropping it stops the server (immediate shutdown) and deletes everything.
///
/// All methods block (they run processes and sleep); call them through
/// `tokio::task::spawn_blocking` from async code.
pub struct ThrowawayPostgres {
    inner: Arc<Inner>,
}

/// The state shared with the process-exit hook.
struct Inner {
    root: PathBuf,
    data_dir: PathBuf,
    socket_dir: PathBuf,
    log_path: PathBuf,
    postgres: PathBuf,
    pg_isready: Option<PathBuf>,
    /// Database superuser created by initdb.
    user: String,
    /// uid/gid to run the server as when we are root.
    run_as: Option<(u32, u32)>,
    port: AtomicU16,
    /// Postmaster pid, 0 while stopped. Atomic so the exit hook can read it without a lock.
    pid: AtomicI32,
    /// Serialises stop/start so a restart is never interleaved with another.
    lifecycle: Mutex<()>,
    destroyed: AtomicBool,
}

impl ThrowawayPostgres {
    /// Create a cluster in a temporary directory, start it on a free port on 127.0.0.1, and
    /// wait until it accepts connections.
    ///
    /// Blocking: from async code call it through `tokio::task::spawn_blocking`. The server is
    /// spawned from an internal thread that lives as long as the process, so the calling
    /// thread may exit without taking the server with it.
    pub fn start() -> Result<ThrowawayPostgres, ThrowawayError> {
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

/// Outcome of one attempt to launch the postmaster.
enum Launch {
    /// Another process bound the port first; the log tail is kept for the final error.
    PortTaken(String),
    Failed(ThrowawayError),
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, ()> {
        // The guarded state is the pid atomic, which stays consistent across a panic.
        self.lifecycle.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn initdb(&self, initdb: &Path) -> Result<(), ThrowawayError> {
        let mut cmd = Command::new(initdb);
        cmd.arg("-D")
            .arg(&self.data_dir)
            .args(["-A", "trust", "-U", &self.user, "--no-sync", "-E", "UTF8"])
            .arg("--locale=C");
        self.prepare(&mut cmd);
        let output = cmd.stdin(Stdio::null()).output().map_err(|source| {
            // The child fails to chdir into our directory before it can even exec initdb.
            if self.run_as.is_some() && source.kind() == io::ErrorKind::PermissionDenied {
                ThrowawayError::Unreachable {
                    dir: self.root.clone(),
                }
            } else {
                io_error(format!("running {}", initdb.display()))(source)
            }
        })?;
        if output.status.success() {
            return Ok(());
        }
        let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&output.stderr));
        Err(ThrowawayError::InitdbFailed {
            command: format!("{cmd:?}"),
            status: output.status.to_string(),
            hint: if self.run_as.is_some() {
                format!(
                    " (it runs as the `postgres` user, which needs to reach {}; \
                     point TMPDIR elsewhere if it cannot)",
                    self.root.display()
                )
            } else {
                String::new()
            },
            output: text,
        })
    }

    /// Settings shared by every child process.
    fn prepare(&self, cmd: &mut Command) {
        // The server user may not be allowed into our working directory.
        cmd.current_dir(&self.root).env("LC_ALL", "C");
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
    }

    fn start_locked(&self, guard: &MutexGuard<'_, ()>) -> Result<(), ThrowawayError> {
        if self.pid.load(Ordering::SeqCst) != 0 {
            return Ok(());
        }
        match self.launch(guard) {
            Ok(()) => Ok(()),
            Err(Launch::PortTaken(log_tail)) => Err(ThrowawayError::NoFreePort {
                attempts: 1,
                log: self.log_path.clone(),
                log_tail,
            }),
            Err(Launch::Failed(e)) => Err(e),
        }
    }

    /// Spawn the postmaster on the current port and wait until it is ready.
    fn launch(&self, _guard: &MutexGuard<'_, ()>) -> Result<(), Launch> {
        let port = self.port.load(Ordering::SeqCst);
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(|e| {
                Launch::Failed(io_error(format!("opening {}", self.log_path.display()))(e))
            })?;
        // Earlier runs' lines (e.g. "ready to accept connections") must not count for this one.
        let log_offset = log.metadata().map(|m| m.len()).unwrap_or(0);
        let log_err = log
            .try_clone()
            .map_err(|e| Launch::Failed(io_error("duplicating the log file handle")(e)))?;

        let mut cmd = Command::new(&self.postgres);
        cmd.arg("-D")
            .arg(&self.data_dir)
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-k"])
            .arg(&self.socket_dir)
            .args([
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "max_connections=300",
                "-c",
                "shared_buffers=128MB",
            ])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            // Our terminal's Ctrl-C is for us; the server stops when we say so (or we die).
            .process_group(0);
        self.prepare(&mut cmd);
        let parent = std::process::id() as i32;
        // SAFETY: the closure only makes async-signal-safe system calls (prctl, getppid) and
        // does not allocate.
        unsafe {
            cmd.pre_exec(move || {
                // std applies gid/uid before pre_exec closures, and a credential change clears
                // the parent-death signal, so this must (and does) come after the uid switch.
                nix::sys::prctl::set_pdeathsig(Signal::SIGQUIT)?;
                // The owner may have died between fork and prctl; then no signal will come.
                if getppid().as_raw() != parent {
                    return Err(Errno::ESRCH.into());
                }
                Ok(())
            });
        }
        let child = spawn_from_keeper_thread(cmd).map_err(|e| {
            Launch::Failed(io_error(format!("starting {}", self.postgres.display()))(e))
        })?;
        let pid = Pid::from_raw(child.id() as i32);
        // We reap by pid with waitpid; the Child handle is not needed (dropping it does not
        // kill or wait).
        drop(child);
        self.pid.store(pid.as_raw(), Ordering::SeqCst);

        match self.wait_ready(pid, port, log_offset) {
            Ok(()) => Ok(()),
            Err(failure) => {
                // Never leave a half-started server behind.
                self.pid.store(0, Ordering::SeqCst);
                terminate(pid, Signal::SIGQUIT, QUIT_TIMEOUT);
                Err(failure)
            }
        }
    }

    fn wait_ready(&self, pid: Pid, port: u16, log_offset: u64) -> Result<(), Launch> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => {}
                Ok(status) => {
                    return Err(self.exited_during_startup(format!("{status:?}"), log_offset))
                }
                Err(e) => return Err(self.exited_during_startup(e.to_string(), log_offset)),
            }
            if self.looks_ready(pid, log_offset) && self.accepts_connections(port) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Launch::Failed(ThrowawayError::NotReady {
                    port,
                    timeout: READY_TIMEOUT,
                    log: self.log_path.clone(),
                    log_tail: self.log_tail(log_offset),
                }));
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    fn exited_during_startup(&self, status: String, log_offset: u64) -> Launch {
        let log = read_log_from(&self.log_path, log_offset);
        let log_tail = tail(&log);
        if log.contains("Address already in use") {
            Launch::PortTaken(log_tail)
        } else {
            Launch::Failed(ThrowawayError::ExitedDuringStartup {
                status,
                log: self.log_path.clone(),
                log_tail,
            })
        }
    }

    /// Evidence from *our* postmaster that it is ready, so that another server which happens
    /// to hold the port cannot pass for ours.
    fn looks_ready(&self, pid: Pid, log_offset: u64) -> bool {
        // Line 8 of postmaster.pid is the status pg_ctl waits for (PostgreSQL 10+); line 1
        // must be our pid, since a killed predecessor may have left a stale "ready" file.
        let pidfile_ready = fs::read_to_string(self.data_dir.join("postmaster.pid"))
            .map(|s| {
                let lines: Vec<&str> = s.lines().map(str::trim).collect();
                lines.first() == Some(&pid.as_raw().to_string().as_str())
                    && lines.get(7) == Some(&"ready")
            })
            .unwrap_or(false);
        pidfile_ready
            || read_log_from(&self.log_path, log_offset).contains("ready to accept connections")
    }

    /// A libpq-level check when pg_isready is available, else a plain TCP connect.
    fn accepts_connections(&self, port: u16) -> bool {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        if TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err() {
            return false;
        }
        let Some(pg_isready) = &self.pg_isready else {
            return true;
        };
        Command::new(pg_isready)
            .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()])
            .args(["-U", &self.user, "-d", "postgres", "-t", "2"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    fn stop_fast(&self, _guard: &MutexGuard<'_, ()>) -> Result<(), ThrowawayError> {
        let raw = self.pid.load(Ordering::SeqCst);
        if raw == 0 {
            return Ok(());
        }
        let pid = Pid::from_raw(raw);
        match kill(pid, Signal::SIGINT) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(source) => {
                return Err(ThrowawayError::Signal {
                    pid: raw,
                    signal: Signal::SIGINT,
                    source,
                })
            }
        }
        if !wait_exit(pid, FAST_STOP_TIMEOUT) {
            terminate(pid, Signal::SIGQUIT, QUIT_TIMEOUT);
        }
        self.pid.store(0, Ordering::SeqCst);
        Ok(())
    }

    /// Immediate shutdown and removal of the directory; idempotent, and safe to call from the
    /// exit hook (takes no locks).
    fn destroy(&self) {
        if self.destroyed.swap(true, Ordering::SeqCst) {
            return;
        }
        let raw = self.pid.swap(0, Ordering::SeqCst);
        if raw != 0 {
            terminate(Pid::from_raw(raw), Signal::SIGQUIT, QUIT_TIMEOUT);
        }
        let _ = fs::remove_dir_all(&self.root);
    }

    fn log_tail(&self, log_offset: u64) -> String {
        tail(&read_log_from(&self.log_path, log_offset))
    }
}

/// Send `signal`, wait up to `timeout`, then SIGKILL and wait a little more.
fn terminate(pid: Pid, signal: Signal, timeout: Duration) {
    if kill(pid, signal) == Err(Errno::ESRCH) {
        // Already gone, but it may still need reaping.
        let _ = waitpid(pid, Some(WaitPidFlag::WNOHANG));
        return;
    }
    if !wait_exit(pid, timeout) {
        let _ = kill(pid, Signal::SIGKILL);
        wait_exit(pid, Duration::from_secs(5));
    }
}

/// Poll until our child `pid` has exited (and reap it); false on timeout.
fn wait_exit(pid: Pid, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => {}
            // Exited, or not (any longer) our child to wait for.
            Ok(_) | Err(_) => return true,
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn read_log_from(path: &Path, offset: u64) -> String {
    let mut text = String::new();
    if let Ok(mut file) = File::open(path) {
        if file.seek(SeekFrom::Start(offset)).is_ok() {
            let mut bytes = Vec::new();
            let _ = file.read_to_end(&mut bytes);
            text = String::from_utf8_lossy(&bytes).into_owned();
        }
    }
    text
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(LOG_TAIL_LINES);
    if lines.is_empty() {
        "(empty)".to_owned()
    } else {
        lines[start..].join("\n")
    }
}

/// A port that was free a moment ago; the server may still lose it to a race, which
/// [`ThrowawayPostgres::start`] handles by retrying.
fn free_port() -> Result<u16, ThrowawayError> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(io_error("finding a free port on 127.0.0.1"))
}

// ---------------------------------------------------------------------------------------------
// Spawning from a thread that never exits.

type SpawnJob = (Command, mpsc::Sender<io::Result<Child>>);

/// Spawn `cmd` from a dedicated thread that lives until the process exits. PR_SET_PDEATHSIG
/// fires when the *thread* that forked the child exits, so spawning from a short-lived thread
/// (a test thread, a blocking-pool thread) would kill the server as soon as that thread ends.
fn spawn_from_keeper_thread(cmd: Command) -> io::Result<Child> {
    static KEEPER: OnceLock<io::Result<mpsc::Sender<SpawnJob>>> = OnceLock::new();
    let sender = KEEPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        thread::Builder::new()
            .name("vantage-pg-keeper".into())
            .spawn(move || {
                // The sender lives in a static, so this loop only ends with the process.
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .map(|_| tx)
    });
    let sender = sender
        .as_ref()
        .map_err(|e| io::Error::new(e.kind(), format!("starting the spawner thread: {e}")))?;
    let (reply_tx, reply_rx) = mpsc::channel();
    sender
        .send((cmd, reply_tx))
        .map_err(|_| io::Error::other("the spawner thread is gone"))?;
    reply_rx
        .recv()
        .map_err(|_| io::Error::other("the spawner thread is gone"))?
}

// ---------------------------------------------------------------------------------------------
// Process-exit cleanup for servers that are never dropped.

static LIVE: Mutex<Vec<Arc<Inner>>> = Mutex::new(Vec::new());

fn register(inner: &Arc<Inner>) {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        // SAFETY: registering a plain `extern "C"` function has no preconditions. If
        // registration fails, parent-death signals and the stale-directory sweep remain.
        unsafe {
            libc::atexit(destroy_live_servers_at_exit);
        }
    });
    LIVE.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(Arc::clone(inner));
}

fn unregister(inner: &Arc<Inner>) {
    LIVE.lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|other| !Arc::ptr_eq(other, inner));
}

extern "C" fn destroy_live_servers_at_exit() {
    // Unwinding out of an `extern "C"` function would abort; cleanup is best effort anyway.
    let _ = std::panic::catch_unwind(|| {
        // try_lock: a thread that still holds the lock while the process exits must not
        // turn exit into a hang.
        let live = match LIVE.try_lock() {
            Ok(mut live) => std::mem::take(&mut *live),
            Err(std::sync::TryLockError::Poisoned(e)) => std::mem::take(&mut *e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        for inner in live {
            inner.destroy();
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Finding binaries, choosing the server user, sweeping leftovers.

struct Binaries {
    initdb: PathBuf,
    postgres: PathBuf,
    pg_isready: Option<PathBuf>,
}

fn find_binaries() -> Option<Binaries> {
    let (initdb, postgres) = match (on_path("initdb"), on_path("postgres")) {
        (Some(initdb), Some(postgres)) => (initdb, postgres),
        _ => {
            let dir = debian_bin_dirs()
                .into_iter()
                .find(|d| is_executable(&d.join("initdb")) && is_executable(&d.join("postgres")))?;
            (dir.join("initdb"), dir.join("postgres"))
        }
    };
    // Symlinks such as /usr/local/bin/postgres lead to the real bin directory, where
    // pg_isready of the same version lives.
    let real_postgres = fs::canonicalize(&postgres).unwrap_or_else(|_| postgres.clone());
    let pg_isready = [real_postgres.parent(), postgres.parent()]
        .into_iter()
        .flatten()
        .map(|dir| dir.join("pg_isready"))
        .find(|p| is_executable(p))
        .or_else(|| on_path("pg_isready"));
    Some(Binaries {
        initdb: fs::canonicalize(&initdb).unwrap_or(initdb),
        postgres: real_postgres,
        pg_isready,
    })
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

/// `/usr/lib/postgresql/*/bin`, highest version first.
fn debian_bin_dirs() -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(DEBIAN_PG_ROOT) else {
        return Vec::new();
    };
    let mut versions: Vec<(Vec<u32>, PathBuf)> = entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            let version = name
                .to_str()?
                .split('.')
                .map(|part| part.parse().ok())
                .collect::<Option<Vec<u32>>>()?;
            Some((version, entry.path().join("bin")))
        })
        .collect();
    versions.sort_by(|a, b| b.0.cmp(&a.0));
    versions.into_iter().map(|(_, dir)| dir).collect()
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The database superuser name, and the uid/gid to switch to when we are root (the server
/// refuses to run as root).
fn server_identity() -> Result<(String, Option<(u32, u32)>), ThrowawayError> {
    let euid = geteuid();
    if euid.is_root() {
        let user = User::from_name("postgres")
            .ok()
            .flatten()
            .ok_or(ThrowawayError::NoPostgresUser)?;
        return Ok((
            "postgres".to_owned(),
            Some((user.uid.as_raw(), user.gid.as_raw())),
        ));
    }
    let name = User::from_uid(euid)
        .ok()
        .flatten()
        .map(|u| u.name)
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "postgres".to_owned());
    Ok((name, None))
}

/// Remove throwaway directories whose owning process is gone, stopping any postmaster still
/// running in them. Best effort: errors are ignored.
fn sweep_stale_dirs() {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    let own_pid = std::process::id() as i32;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(owner) = owner_pid(&name) else {
            continue;
        };
        if owner == own_pid || process_exists(Pid::from_raw(owner)) {
            continue;
        }
        if !entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            continue;
        }
        let dir = entry.path();
        stop_orphan_postmaster(&dir.join("data"));
        let _ = fs::remove_dir_all(&dir);
    }
}

/// `vantage-pg-<pid>-<random>` → pid.
fn owner_pid(name: &OsStr) -> Option<i32> {
    let rest = name.to_str()?.strip_prefix(DIR_PREFIX)?;
    let (pid, _) = rest.split_once('-')?;
    pid.parse().ok().filter(|&p| p > 0)
}

fn process_exists(pid: Pid) -> bool {
    // EPERM means it exists but belongs to someone else.
    !matches!(kill(pid, None), Err(Errno::ESRCH))
}

/// SIGQUIT, then SIGKILL, a postmaster left running in `data_dir` — but only if the pid in
/// postmaster.pid really is a process working in that directory (pids get reused).
fn stop_orphan_postmaster(data_dir: &Path) {
    let Ok(pidfile) = fs::read_to_string(data_dir.join("postmaster.pid")) else {
        return;
    };
    let Some(pid) = pidfile
        .lines()
        .next()
        .and_then(|l| l.trim().parse::<i32>().ok())
    else {
        return;
    };
    if pid <= 0 {
        return;
    }
    // The postmaster chdirs into its data directory.
    let cwd = fs::read_link(format!("/proc/{pid}/cwd"));
    let data_dir = fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    if cwd.ok().as_deref() != Some(data_dir.as_path()) {
        return;
    }
    let pid = Pid::from_raw(pid);
    let _ = kill(pid, Signal::SIGQUIT);
    let deadline = Instant::now() + QUIT_TIMEOUT;
    while process_exists(pid) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    if process_exists(pid) {
        let _ = kill(pid, Signal::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_pid_parses_only_our_directories() {
        assert_eq!(owner_pid(OsStr::new("vantage-pg-1234-abCD12")), Some(1234));
        assert_eq!(owner_pid(OsStr::new("vantage-pg-x-abCD12")), None);
        assert_eq!(owner_pid(OsStr::new("vantage-pg-0-abCD12")), None);
        assert_eq!(owner_pid(OsStr::new("something-else")), None);
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        let text: String = (0..100).map(|i| format!("line {i}\n")).collect();
        let t = tail(&text);
        assert!(t.starts_with(&format!("line {}", 100 - LOG_TAIL_LINES)));
        assert!(t.ends_with("line 99"));
        assert_eq!(tail(""), "(empty)");
    }
}
