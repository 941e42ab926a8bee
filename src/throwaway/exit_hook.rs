//! Process-exit cleanup for servers that are never dropped (statics in a test binary,
//! `std::process::exit`).

use std::sync::{Arc, Mutex, Once};

use super::server::Inner;

static LIVE: Mutex<Vec<Arc<Inner>>> = Mutex::new(Vec::new());

pub(super) fn register(inner: &Arc<Inner>) {
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

pub(super) fn unregister(inner: &Arc<Inner>) {
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
