//! The daemons under soak: `vantage run` children of this executable, each with its own
//! configuration file and log, killed and replaced on demand, and watched through `/proc`
//! (resident memory, open file descriptors).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

/// One sample of a process, from `/proc/PID`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProcSample {
    /// Seconds since the soak started.
    pub at: f64,
    /// `VmRSS`, KiB.
    pub rss_kib: u64,
    /// `RssAnon`, KiB: the part of `VmRSS` only this process holds (its heap and stacks), what a
    /// leak grows; the rest is mostly the executable's pages, resident once first run. 0 where
    /// the kernel does not report it.
    pub anon_kib: u64,
    /// Entries of `/proc/PID/fd`.
    pub fds: u64,
}

/// Reads `VmRSS`, `RssAnon` and the number of open file descriptors of `pid`; `None` once it is
/// gone.
pub fn sample(pid: u32, at: f64) -> Option<ProcSample> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = |field: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
    };
    let rss_kib = kib("VmRSS:")?;
    let anon_kib = kib("RssAnon:").unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some(ProcSample {
        at,
        rss_kib,
        anon_kib,
        fds,
    })
}

/// One process of a slot: its pid and its samples.
#[derive(Debug)]
pub struct Incarnation {
    /// The process id.
    pub pid: u32,
    /// Seconds since the soak started, when it was spawned.
    pub spawned_at: f64,
    /// How it ended: `None` while running (or killed by us), `Some(code)` if it exited itself.
    pub exit: Option<Option<i32>>,
    /// Whether the soak killed it on purpose.
    pub killed: bool,
    /// Samples, one per sampling interval.
    pub samples: Vec<ProcSample>,
}

/// A daemon slot: one process at a time, replaced when killed.
pub struct Slot {
    /// Its number (its configuration is `daemon-<n>.toml`).
    pub index: usize,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    /// Every process it has had, the current one last.
    pub incarnations: Vec<Incarnation>,
}

/// Every daemon of the soak.
pub struct Fleet {
    /// The slots.
    pub slots: Vec<Slot>,
    exe: PathBuf,
    started: Instant,
}

impl Fleet {
    /// A fleet of `configs.len()` slots (nothing spawned yet); logs go beside the configs.
    pub fn new(exe: PathBuf, configs: Vec<PathBuf>, started: Instant) -> Fleet {
        let slots = configs
            .into_iter()
            .enumerate()
            .map(|(index, config)| Slot {
                index,
                log: config.with_extension("log"),
                config,
                child: None,
                incarnations: Vec::new(),
            })
            .collect();
        Fleet {
            slots,
            exe,
            started,
        }
    }

    fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Spawns slot `i`'s daemon (the slot must be empty).
    pub fn spawn(&mut self, i: usize) -> std::io::Result<u32> {
        let at = self.now();
        let exe = self.exe.clone();
        let slot = &mut self.slots[i];
        let child = spawn_daemon(&exe, &slot.config, &slot.log)?;
        let pid = child.id().unwrap_or(0);
        slot.child = Some(child);
        slot.incarnations.push(Incarnation {
            pid,
            spawned_at: at,
            exit: None,
            killed: false,
            samples: Vec::new(),
        });
        Ok(pid)
    }

    /// SIGKILLs slot `i`'s daemon, reaps it and spawns its replacement at once.
    pub async fn kill_and_replace(&mut self, i: usize) -> std::io::Result<u32> {
        let slot = &mut self.slots[i];
        if let Some(mut child) = slot.child.take() {
            let _ = child.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
            if let Some(last) = slot.incarnations.last_mut() {
                last.killed = true;
            }
        }
        self.spawn(i)
    }

    /// Finds daemons that exited by themselves, records how, and replaces them; returns how
    /// many it replaced.
    pub fn replace_exited(&mut self) -> usize {
        let mut gone = Vec::new();
        for slot in &mut self.slots {
            let Some(child) = slot.child.as_mut() else {
                continue;
            };
            if let Ok(Some(status)) = child.try_wait() {
                if let Some(last) = slot.incarnations.last_mut() {
                    last.exit = Some(status.code());
                }
                slot.child = None;
                gone.push(slot.index);
            }
        }
        for i in &gone {
            let _ = self.spawn(*i);
        }
        gone.len()
    }

    /// Samples every running daemon.
    pub fn sample_all(&mut self) {
        let at = self.now();
        for slot in &mut self.slots {
            if slot.child.is_none() {
                continue;
            }
            if let Some(last) = slot.incarnations.last_mut() {
                if let Some(s) = sample(last.pid, at) {
                    last.samples.push(s);
                }
            }
        }
    }

    /// The pids of the running daemons, by slot.
    pub fn pids(&self) -> Vec<(usize, u32)> {
        self.slots
            .iter()
            .filter(|s| s.child.is_some())
            .filter_map(|s| s.incarnations.last().map(|i| (s.index, i.pid)))
            .collect()
    }

    /// Running daemons.
    pub fn running(&self) -> usize {
        self.slots.iter().filter(|s| s.child.is_some()).count()
    }

    /// SIGTERMs every daemon and waits up to `grace` for each; returns each slot's exit code
    /// (`None`: killed by a signal or did not stop in time, then SIGKILLed).
    pub async fn stop(&mut self, grace: Duration) -> Vec<Option<i32>> {
        let mut codes = Vec::new();
        for slot in &mut self.slots {
            let Some(mut child) = slot.child.take() else {
                codes.push(None);
                continue;
            };
            if let Some(pid) = child.id() {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
            }
            let code = match tokio::time::timeout(grace, child.wait()).await {
                Ok(Ok(status)) => status.code(),
                _ => {
                    let _ = child.start_kill();
                    let _ = child.wait().await;
                    None
                }
            };
            if let Some(last) = slot.incarnations.last_mut() {
                last.exit = Some(code);
            }
            codes.push(code);
        }
        codes
    }
}

fn spawn_daemon(exe: &Path, config: &Path, log: &Path) -> std::io::Result<Child> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let file2 = file.try_clone()?;
    let mut cmd = Command::new(exe);
    cmd.arg("--config").arg(config).arg("run");
    scrub_env(&mut cmd);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(file))
        .stderr(Stdio::from(file2))
        // A soak that stops takes its daemons with it: dropped (kill_on_drop), or killed
        // itself (the parent-death signal; tokio spawns from its worker threads, which live as
        // long as the runtime).
        .kill_on_drop(true);
    let parent = std::process::id() as i32;
    // SAFETY: the closure only makes async-signal-safe system calls (prctl, getppid) and does
    // not allocate.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            // The soak may have died between fork and prctl; then no signal will come.
            if nix::unistd::getppid().as_raw() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// Removes what would override the configuration file (DATABASE_URL, libpq's PG*,
/// VANTAGE__*, RUST_LOG, OTEL_*), so every child runs exactly its file.
pub fn scrub_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        let Some(k) = key.to_str() else { continue };
        if k == "DATABASE_URL"
            || k == "RUST_LOG"
            || k.starts_with("PG")
            || k.starts_with("VANTAGE__")
            || k.starts_with("OTEL_")
        {
            cmd.env_remove(&key);
        }
    }
    cmd.env("NO_COLOR", "1");
}

/// Least-squares slope of `(x, y)`, per unit of x; `None` with fewer than two distinct x.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    if points.len() < 2 {
        return None;
    }
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    if sxx <= f64::EPSILON {
        return None;
    }
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    Some(sxy / sxx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_line_and_of_too_little() {
        let line: Vec<(f64, f64)> = (0..10).map(|x| (x as f64, 3.0 * x as f64 + 1.0)).collect();
        assert!((slope(&line).unwrap() - 3.0).abs() < 1e-9);
        assert_eq!(slope(&[(1.0, 2.0)]), None);
        assert_eq!(slope(&[(1.0, 2.0), (1.0, 3.0)]), None);
    }

    #[test]
    fn samples_this_process() {
        let s = sample(std::process::id(), 0.0).expect("our own /proc entry");
        assert!(s.rss_kib > 0 && s.fds > 0);
        assert!(
            s.anon_kib > 0 && s.anon_kib <= s.rss_kib,
            "RssAnon {} KiB of VmRSS {} KiB",
            s.anon_kib,
            s.rss_kib
        );
    }
}
