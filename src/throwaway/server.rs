//! The cluster itself: `initdb`, launching the postmaster on a port and waiting until it is
//! ready (and is ours), fast and immediate shutdown, the server log.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU16, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{getppid, Pid};

use super::error::{io_error, ThrowawayError};
use super::keeper::spawn_from_keeper_thread;

/// How long a start may take before we give up and show the server log.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Fast shutdown waits for nothing but in-flight commits; a minute means something is wrong.
const FAST_STOP_TIMEOUT: Duration = Duration::from_secs(60);
/// Immediate shutdown should take milliseconds; after this we escalate to SIGKILL.
pub(super) const QUIT_TIMEOUT: Duration = Duration::from_secs(10);
/// Lines of server log quoted in startup errors.
const LOG_TAIL_LINES: usize = 40;

/// The state shared with the process-exit hook.
pub(super) struct Inner {
    pub(super) root: PathBuf,
    pub(super) data_dir: PathBuf,
    pub(super) socket_dir: PathBuf,
    pub(super) log_path: PathBuf,
    pub(super) postgres: PathBuf,
    pub(super) pg_isready: Option<PathBuf>,
    /// Database superuser created by initdb.
    pub(super) user: String,
    /// uid/gid to run the server as when we are root.
    pub(super) run_as: Option<(u32, u32)>,
    pub(super) port: AtomicU16,
    /// `max_connections` of the server (300 unless the owner asked for more).
    pub(super) max_connections: u32,
    /// Postmaster pid, 0 while stopped. Atomic so the exit hook can read it without a lock.
    pub(super) pid: AtomicI32,
    /// Serialises stop/start so a restart is never interleaved with another.
    pub(super) lifecycle: Mutex<()>,
    pub(super) destroyed: AtomicBool,
}

/// Outcome of one attempt to launch the postmaster.
pub(super) enum Launch {
    /// Another process bound the port first; the log tail is kept for the final error.
    PortTaken(String),
    Failed(ThrowawayError),
}

impl Inner {
    pub(super) fn lock(&self) -> MutexGuard<'_, ()> {
        // The guarded state is the pid atomic, which stays consistent across a panic.
        self.lifecycle.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn initdb(&self, initdb: &Path) -> Result<(), ThrowawayError> {
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

    pub(super) fn start_locked(&self, guard: &MutexGuard<'_, ()>) -> Result<(), ThrowawayError> {
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
    pub(super) fn launch(&self, _guard: &MutexGuard<'_, ()>) -> Result<(), Launch> {
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
                &format!("max_connections={}", self.max_connections),
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

    pub(super) fn stop_fast(&self, _guard: &MutexGuard<'_, ()>) -> Result<(), ThrowawayError> {
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
    pub(super) fn destroy(&self) {
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
/// [`ThrowawayPostgres::start`](super::ThrowawayPostgres::start) handles by retrying.
pub(super) fn free_port() -> Result<u16, ThrowawayError> {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(io_error("finding a free port on 127.0.0.1"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines() {
        let text: String = (0..100).map(|i| format!("line {i}\n")).collect();
        let t = tail(&text);
        assert!(t.starts_with(&format!("line {}", 100 - LOG_TAIL_LINES)));
        assert!(t.ends_with("line 99"));
        assert_eq!(tail(""), "(empty)");
    }
}
