//! A core of its own for a measured producer (the producers check).
//!
//! On a small machine the daemon, the server's backends and the measured producer share every
//! core, and the slowest 1 % of appends wait for a scheduler slice behind whatever else is busy:
//! a cost of the machine's size, not of any lock of vantage's. To tell the two apart, the
//! producers check also measures with the producer's thread and its server backend alone on
//! the last core, and every other thread of this process and every other process of the server
//! on the others (Linux `sched_setaffinity`). That is the shape of a production database with
//! cores to spare; what is still shared — WAL, buffers, locks — is still measured.
//!
//! Isolation needs at least two cores and a server on this machine whose processes we may
//! re-pin (the throwaway server is ours); otherwise [`isolate`] says why not and the check
//! reports the shared measurement alone.

use std::collections::BTreeSet;

/// The producer's thread and backend on a core of their own until this is dropped; every
/// re-pinned thread and process gets all of this process's cores back then (best effort:
/// a process that has exited meanwhile has nothing to restore).
#[derive(Debug)]
pub struct Isolation {
    all: Vec<usize>,
    postmaster: i32,
}

/// The id of the calling thread, for [`isolate`].
pub fn current_thread_id() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

/// The cores this process may run on.
fn allowed_cores() -> std::io::Result<Vec<usize>> {
    // SAFETY: the set is zeroed and sized for the call; pid 0 is the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect())
    }
}

/// Pins thread or process `id` to `cores`.
fn pin(id: i32, cores: &[usize]) -> std::io::Result<()> {
    // SAFETY: the set is zeroed, filled with indices below CPU_SETSIZE and sized for the call.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cores {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(id, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The parent of process `pid`, from `/proc`.
fn parent(pid: i32) -> Option<i32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: fields start after the last.
    text[text.rfind(')')? + 1..]
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The numeric entries of a `/proc` directory (processes, or a process's threads).
fn ids(dir: &str) -> BTreeSet<i32> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The postmaster and every child of it.
fn server_processes(postmaster: i32) -> BTreeSet<i32> {
    let mut out: BTreeSet<i32> = ids("/proc")
        .into_iter()
        .filter(|&pid| parent(pid) == Some(postmaster))
        .collect();
    out.insert(postmaster);
    out
}

/// Gives thread `producer_thread` (of this process) and server backend `producer_backend` the
/// last core to themselves: every other thread of this process, the postmaster (so backends
/// started later follow) and its other children go to the remaining cores. `Err` says why the
/// machine or the server does not allow it; nothing stays re-pinned then.
pub fn isolate(producer_thread: i32, producer_backend: i32) -> Result<Isolation, String> {
    let all = allowed_cores().map_err(|e| format!("the cores of this process: {e}"))?;
    let Some((&core, rest)) = all.split_last() else {
        return Err("no core".into());
    };
    if rest.is_empty() {
        return Err("one core only".into());
    }
    let postmaster = parent(producer_backend)
        .ok_or("the server is not on this machine (its backend is not in /proc)")?;
    let isolation = Isolation {
        all: all.clone(),
        postmaster,
    };
    // The postmaster first: a server we may not re-pin is refused before anything moved.
    pin(postmaster, rest)
        .map_err(|e| format!("the server's processes cannot be re-pinned: {e}"))?;
    let own = [core];
    for pid in server_processes(postmaster) {
        // A backend that exited meanwhile needs no pinning.
        let _ = pin(pid, if pid == producer_backend { &own } else { rest });
    }
    for tid in ids("/proc/self/task") {
        let _ = pin(tid, if tid == producer_thread { &own } else { rest });
    }
    Ok(isolation)
}

impl Drop for Isolation {
    fn drop(&mut self) {
        for pid in server_processes(self.postmaster) {
            let _ = pin(pid, &self.all);
        }
        for tid in ids("/proc/self/task") {
            let _ = pin(tid, &self.all);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_runs_on_at_least_one_core_and_knows_its_threads() {
        assert!(!allowed_cores().unwrap().is_empty());
        assert!(ids("/proc/self/task").contains(&current_thread_id()));
        assert_eq!(parent(std::process::id() as i32), {
            // SAFETY: getppid cannot fail.
            Some(unsafe { libc::getppid() })
        });
    }

    #[test]
    fn a_backend_not_on_this_machine_is_refused_without_pinning_anything() {
        let before = allowed_cores().unwrap();
        // No process has pid -1.
        let err = isolate(current_thread_id(), -1).unwrap_err();
        assert!(
            err.contains("not on this machine") || err.contains("one core"),
            "{err}"
        );
        assert_eq!(allowed_cores().unwrap(), before);
    }
}
