//! Sweeping leftovers: throwaway directories whose owner is gone, and any postmaster still
//! running in them.

use std::ffi::OsStr;
use std::fs;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::server::QUIT_TIMEOUT;
use super::DIR_PREFIX;

/// Remove throwaway directories whose owning process is gone, stopping any postmaster still
/// running in them. Best effort: errors are ignored.
pub(super) fn sweep_stale_dirs() {
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
}
