//! Liveness and readiness state of one daemon: what `/healthz` and `/readyz` read.
//!
//! The daemon keeps it current (its sampler pings the database, every loop beats a
//! [`LoopHeartbeat`]); the probes only read flags, so a probe never waits on a slow database.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// Liveness and readiness state of one daemon, shared (cheap clone) between the daemon, which
/// updates it, and the HTTP handlers, which read it.
///
/// Readiness starts *not ready* (database and migrations unknown) until the daemon reports.
#[derive(Clone, Default)]
pub struct Health {
    inner: Arc<HealthInner>,
}

#[derive(Default)]
struct HealthInner {
    database_ok: AtomicBool,
    migrations_current: AtomicBool,
    shutting_down: AtomicBool,
    loops: Mutex<Vec<Arc<LoopState>>>,
}

/// Why a probe fails. `Display` is the `reason` of the JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unavailable {
    /// `/readyz`: shutdown has begun.
    ShuttingDown,
    /// `/readyz`: the last database ping failed (or none succeeded yet).
    DatabaseUnreachable,
    /// `/readyz`: the schema is behind (or ahead of) this binary, or not checked yet.
    MigrationsNotCurrent,
    /// `/healthz`: a loop ended without [`LoopHeartbeat::finish`] (it returned early, failed
    /// or panicked).
    LoopDead {
        /// The loop's name.
        name: String,
    },
    /// `/healthz`: a loop has not beaten for longer than its staleness limit.
    LoopStalled {
        /// The loop's name.
        name: String,
        /// Time since its last beat.
        silent_for: Duration,
        /// The limit given at registration.
        limit: Duration,
    },
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unavailable::ShuttingDown => f.write_str("shutting down"),
            Unavailable::DatabaseUnreachable => f.write_str("database unreachable"),
            Unavailable::MigrationsNotCurrent => f.write_str("migrations not current"),
            Unavailable::LoopDead { name } => write!(f, "loop {name} died"),
            Unavailable::LoopStalled {
                name,
                silent_for,
                limit,
            } => write!(
                f,
                "loop {name} has not run for {:.1}s (limit {:.1}s)",
                silent_for.as_secs_f64(),
                limit.as_secs_f64()
            ),
        }
    }
}

impl Health {
    /// A fresh state: no loops, database and migrations not yet confirmed, not shutting down.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records the outcome of the latest database ping.
    pub fn set_database_ok(&self, ok: bool) {
        self.inner.database_ok.store(ok, Ordering::Relaxed);
    }

    /// Records whether every migration of this binary is applied (and none unknown to it).
    pub fn set_migrations_current(&self, current: bool) {
        self.inner
            .migrations_current
            .store(current, Ordering::Relaxed);
    }

    /// Marks the start of a graceful shutdown: `/readyz` answers 503 from now on, so load
    /// balancers and orchestrators stop counting on this instance while it drains.
    pub fn set_shutting_down(&self) {
        self.inner.shutting_down.store(true, Ordering::Relaxed);
    }

    /// Whether [`set_shutting_down`](Self::set_shutting_down) was called.
    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutting_down.load(Ordering::Relaxed)
    }

    /// Registers a background loop for `/healthz` and returns its heartbeat. The loop calls
    /// [`LoopHeartbeat::beat`] every iteration; it counts as stalled once it has not beaten for
    /// longer than `stale_after` (choose a bound on one iteration, e.g. 3× the loop's interval,
    /// or the lease for consumer loops whose batches may take long), and as dead if the
    /// heartbeat is dropped without [`LoopHeartbeat::finish`]. Registering a name again (a
    /// restarted loop) replaces the earlier registration. Registration counts as a first beat.
    pub fn register_loop(&self, name: impl Into<String>, stale_after: Duration) -> LoopHeartbeat {
        let state = Arc::new(LoopState {
            name: name.into(),
            stale_after,
            started: Instant::now(),
            last_beat_nanos: AtomicU64::new(0),
            phase: AtomicU8::new(RUNNING),
        });
        let mut loops = self.loops();
        // Forget an earlier registration of this name, and loops that finished on purpose.
        loops.retain(|l| l.name != state.name && l.phase.load(Ordering::Acquire) != FINISHED);
        loops.push(Arc::clone(&state));
        LoopHeartbeat {
            state,
            finished: false,
        }
    }

    /// Liveness: `Ok` when every registered loop is alive (finished loops do not count).
    ///
    /// # Errors
    /// The first dead or stalled loop.
    pub fn liveness(&self) -> Result<(), Unavailable> {
        let now = Instant::now();
        for l in self.loops().iter() {
            match l.phase.load(Ordering::Acquire) {
                FINISHED => {}
                DEAD => {
                    return Err(Unavailable::LoopDead {
                        name: l.name.clone(),
                    })
                }
                _ => {
                    let silent_for = l.silent_for(now);
                    if silent_for > l.stale_after {
                        return Err(Unavailable::LoopStalled {
                            name: l.name.clone(),
                            silent_for,
                            limit: l.stale_after,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Readiness: `Ok` when not shutting down, the database is reachable and the migrations
    /// are current.
    ///
    /// # Errors
    /// The first unmet condition, in that order.
    pub fn readiness(&self) -> Result<(), Unavailable> {
        if self.inner.shutting_down.load(Ordering::Relaxed) {
            Err(Unavailable::ShuttingDown)
        } else if !self.inner.database_ok.load(Ordering::Relaxed) {
            Err(Unavailable::DatabaseUnreachable)
        } else if !self.inner.migrations_current.load(Ordering::Relaxed) {
            Err(Unavailable::MigrationsNotCurrent)
        } else {
            Ok(())
        }
    }

    fn loops(&self) -> std::sync::MutexGuard<'_, Vec<Arc<LoopState>>> {
        self.inner
            .loops
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Health")
            .field("liveness", &self.liveness())
            .field("readiness", &self.readiness())
            .finish()
    }
}

const RUNNING: u8 = 0;
const FINISHED: u8 = 1;
const DEAD: u8 = 2;

struct LoopState {
    name: String,
    stale_after: Duration,
    started: Instant,
    /// Time of the last beat, as nanoseconds since `started`.
    last_beat_nanos: AtomicU64,
    phase: AtomicU8,
}

impl LoopState {
    fn silent_for(&self, now: Instant) -> Duration {
        let last =
            self.started + Duration::from_nanos(self.last_beat_nanos.load(Ordering::Relaxed));
        now.saturating_duration_since(last)
    }
}

/// The heartbeat of one background loop, from [`Health::register_loop`]. Call
/// [`beat`](Self::beat) every iteration and [`finish`](Self::finish) when the loop ends on
/// purpose (shutdown). Dropping it without `finish` — the loop returned early, failed, or
/// panicked — marks the loop dead, and `/healthz` fails until the process restarts or the
/// loop is registered again.
#[must_use = "a heartbeat dropped at once marks its loop dead"]
pub struct LoopHeartbeat {
    state: Arc<LoopState>,
    finished: bool,
}

impl LoopHeartbeat {
    /// Records that the loop is making progress.
    pub fn beat(&self) {
        let nanos = u64::try_from(self.state.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.state.last_beat_nanos.store(nanos, Ordering::Relaxed);
    }

    /// Ends the loop on purpose: it no longer counts for `/healthz`.
    pub fn finish(mut self) {
        self.finished = true;
        self.state.phase.store(FINISHED, Ordering::Release);
    }

    /// The name the loop was registered with.
    pub fn name(&self) -> &str {
        &self.state.name
    }
}

impl Drop for LoopHeartbeat {
    fn drop(&mut self) {
        if !self.finished {
            self.state.phase.store(DEAD, Ordering::Release);
        }
    }
}

impl fmt::Debug for LoopHeartbeat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoopHeartbeat")
            .field("name", &self.state.name)
            .field("stale_after", &self.state.stale_after)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_loop_that_stops_beating_goes_stale() {
        let health = Health::new();
        let beat = health.register_loop("cleanup", Duration::from_secs(30));
        assert_eq!(health.liveness(), Ok(()));
        tokio::time::advance(Duration::from_secs(20)).await;
        beat.beat();
        tokio::time::advance(Duration::from_secs(29)).await;
        assert_eq!(health.liveness(), Ok(()));
        tokio::time::advance(Duration::from_secs(2)).await;
        let err = health.liveness().unwrap_err();
        assert!(
            matches!(&err, Unavailable::LoopStalled { name, .. } if name == "cleanup"),
            "{err:?}"
        );
        assert!(err
            .to_string()
            .starts_with("loop cleanup has not run for 31.0s (limit 30.0s)"));
        beat.beat();
        assert_eq!(health.liveness(), Ok(()));
        beat.finish();
    }
}
