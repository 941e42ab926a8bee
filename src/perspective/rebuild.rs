//! Rebuilding a perspective, safe on a running daemon: its `reset`, then its history queued
//! again, each event delivered once more with [`EventEnvelope::replay`](super::EventEnvelope)
//! set. `vantage perspectives rebuild` runs this for a configured (SQL) perspective; a program
//! with Rust perspectives of its own calls [`rebuild`] with them.
//!
//! 1. It takes the perspective's rebuild lock: a session-level advisory lock on
//!    `wh_perspective_lock_key(name)`, held on one dedicated connection for the whole run.
//!    From then on the daemons' claims skip the perspective (its new events wait, queued,
//!    nothing charged), and dead-letter moves, requeues and replays of it refuse with SQLSTATE
//!    55P03 (the daemon retries a move later; `vantage dlq` says the perspective is being
//!    rebuilt, exit 2). Claims, moves and replays already running hold the lock shared, so the
//!    rebuild waits for them (quietly for a moment, then saying so, at most the lease).
//!    Nothing is persisted: if the process dies, the server ends its session and the lock goes
//!    with it, so a crashed rebuild pauses nothing. A second rebuild of the same perspective is
//!    refused while one runs.
//! 2. It waits, at most the lease, until no row of the perspective is validly leased to a
//!    live instance: the applies in flight finish.
//! 3. In one short transaction (interrupted here, the rebuild changes nothing): it takes back
//!    every lease of the perspective that is left (lapsed, held by a dead instance, or a
//!    straggler's after the wait: their completion then matches nothing and rolls back, so no
//!    apply commits behind the reset's back), runs `reset`, and marks the perspective as being
//!    rebuilt up to the end of the store (`wh_perspectives.rebuild_up_to`); claims skip a
//!    marked perspective even after this command is gone. Lock waits are bounded by the lease
//!    (`lock_timeout`).
//! 4. It re-queues every stored event of its types up to that position in chunks of
//!    `REBUILD_BATCH`, each its own transaction, skipping events already queued (`ON CONFLICT
//!    DO NOTHING`) and events with an open dead letter (the operator decides those). No
//!    transaction is longer than a chunk, so a rebuild of a large store pins neither the vacuum
//!    horizon nor any lock for its length, and producers never wait for it (they do not write
//!    the lane index, migrations/0003_lanes.sql). Killed here, the perspective stays marked and
//!    unclaimed (no lane is applied with a gap) until a rebuild runs again and redoes it;
//!    events already queued are skipped.
//! 5. It clears the mark, releases the lock, and only then do claims see the perspective again:
//!    every lane is whole (re-queued history plus the events that arrived meanwhile), so events
//!    are applied in stream order, each exactly once after the reset, with a `DELETE`-based reset
//!    as with `TRUNCATE`.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use super::{ApplyTx, Perspective};
use crate::store::{requeue_history_batch_in, Store, StoreError};

/// Events re-queued per round trip of a rebuild.
const REBUILD_BATCH: i64 = 10_000;
/// How often a rebuild looks whether the applies in flight have finished (each look counts the
/// perspective's leased rows: no index covers lease columns, by design).
const IN_FLIGHT_POLL: Duration = Duration::from_millis(250);
/// How long a rebuild waits for its lock before it says that it is waiting.
const QUIET_LOCK_WAIT: Duration = Duration::from_millis(500);

/// What a rebuild is doing, for its caller to show.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RebuildProgress {
    /// Claims, moves or replays of it in progress hold the lock: waiting for them.
    WaitingForLock,
    /// Claims are paused; this many events are in flight in a daemon (waited for at most
    /// `bound`).
    WaitingForInFlight {
        /// Rows of the perspective validly leased to a live instance.
        in_flight: i64,
        /// How long the rebuild waits for them.
        bound: Duration,
    },
    /// Still leased after `after`: taken back (their applies in flight roll back).
    TakingBackInFlight {
        /// Rows still leased.
        in_flight: i64,
        /// How long the rebuild waited.
        after: Duration,
    },
    /// Lapsed leases taken back before the reset.
    TookBackLapsed(u64),
    /// An earlier rebuild was interrupted after marking history up to this position; redone.
    RedoingInterrupted(i64),
    /// The read model was reset.
    Reset,
    /// Events re-queued so far, of about `expected`.
    Queued {
        /// Re-queued so far.
        queued: u64,
        /// The approximate total.
        expected: i64,
    },
}

/// Why a rebuild stopped.
#[derive(Debug, thiserror::Error)]
pub enum RebuildError {
    /// Another rebuild of it holds the lock. Nothing was changed.
    #[error("it is already being rebuilt by another command")]
    AlreadyRunning,
    /// Claims, moves, requeues or replays of it kept the lock busy for longer than the bound.
    /// Nothing was changed.
    #[error("the perspective was still busy after {} (a claim, dead-letter move, replay or another rebuild of it in progress)", humantime::format_duration(*.0))]
    Busy(Duration),
    /// A statement failed (the reset's included). Nothing was changed.
    #[error("{0}")]
    Failed(String),
    /// A statement failed after the reset committed, while the history was being re-queued:
    /// the perspective stays marked (and unclaimed) until a rebuild runs again.
    #[error("{0}")]
    Unfinished(String),
}

impl From<StoreError> for RebuildError {
    fn from(e: StoreError) -> Self {
        RebuildError::Failed(e.to_string())
    }
}

impl From<sqlx::Error> for RebuildError {
    fn from(e: sqlx::Error) -> Self {
        RebuildError::Failed(StoreError::from(e).to_string())
    }
}

/// What a finished rebuild did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rebuilt {
    /// Events queued again.
    pub queued: u64,
    /// The approximate number there were to queue.
    pub expected: i64,
}

/// Rebuilds `perspective` (registered under its name) on `store`, as the module says:
/// `lease` (`worker.lease`) bounds every wait; `progress` hears what it is doing.
///
/// # Errors
/// [`RebuildError`]: which ones changed nothing, and which leave the perspective to be
/// rebuilt again.
pub async fn rebuild(
    store: &Store,
    perspective: &dyn Perspective,
    lease: Duration,
    mut progress: impl FnMut(RebuildProgress),
) -> Result<Rebuilt, RebuildError> {
    let name = perspective.name().to_string();
    let mut conn = store.pool().acquire().await.map_err(StoreError::from)?;

    // (1) The lock. A held session lock dies with the session: nothing to clean up after a crash.
    if let Err(e) = lock(store, &mut conn, &name, lease, &mut progress).await {
        // Whatever happened, this session must not go back to the pool holding the lock.
        let _ = conn.close().await;
        return Err(e);
    }

    let result = rebuild_under_lock(store, &mut conn, perspective, lease, &mut progress).await;

    // (5) Unlock only now: the re-queued history is committed, so the first claim after this
    // sees every lane whole. If the unlock fails, closing the session releases the lock.
    match Store::unlock_after_rebuild(&mut conn, &name).await {
        Ok(true) => drop(conn),
        _ => {
            let _ = conn.close().await;
        }
    }
    if result.is_ok() {
        // Daemons woken by the commit found the perspective still locked; wake them again.
        let _ = store.notify_work().await;
    }
    result
}

/// (1) of [`rebuild`]. Claims hold the lock shared for the length of one statement, so a
/// running daemon makes it busy now and then: wait quietly for a moment, then say so and wait
/// up to `lease` (a queued exclusive request already turns new claims, moves, requeues and
/// replays of the perspective away; only those in progress are waited for).
async fn lock(
    store: &Store,
    conn: &mut PgConnection,
    name: &str,
    lease: Duration,
    progress: &mut impl FnMut(RebuildProgress),
) -> Result<(), RebuildError> {
    if Store::try_lock_for_rebuild(conn, name).await? {
        return Ok(());
    }
    if store.perspective_is_rebuilding(name).await? {
        return Err(RebuildError::AlreadyRunning);
    }
    if Store::lock_for_rebuild(conn, name, QUIET_LOCK_WAIT).await? {
        return Ok(());
    }
    if store.perspective_is_rebuilding(name).await? {
        return Err(RebuildError::AlreadyRunning);
    }
    progress(RebuildProgress::WaitingForLock);
    if Store::lock_for_rebuild(conn, name, lease).await? {
        Ok(())
    } else {
        Err(RebuildError::Busy(lease))
    }
}

/// (2) to (4) of [`rebuild`].
async fn rebuild_under_lock(
    store: &Store,
    conn: &mut PgConnection,
    perspective: &dyn Perspective,
    lease: Duration,
    progress: &mut impl FnMut(RebuildProgress),
) -> Result<Rebuilt, RebuildError> {
    let name = perspective.name().to_string();

    // (2) No claim of the perspective starts any more; let the applies in flight finish. Leases
    // that are not renewed lapse within `lease`; past that, (3) fences what is left.
    let started = Instant::now();
    let mut announced = false;
    let mut timed_out = false;
    loop {
        let in_flight = Store::live_leases_in(conn, &name).await?;
        if in_flight == 0 {
            break;
        }
        if started.elapsed() >= lease {
            progress(RebuildProgress::TakingBackInFlight {
                in_flight,
                after: lease,
            });
            timed_out = true;
            break;
        }
        if !announced {
            progress(RebuildProgress::WaitingForInFlight {
                in_flight,
                bound: lease,
            });
            announced = true;
        }
        tokio::time::sleep(IN_FLIGHT_POLL).await;
    }

    // (3) One short transaction: take back the leases, reset, and mark the perspective as being
    // rebuilt. Interrupted here, the rebuild changes nothing.
    let mut tx = conn.begin().await?;
    // A reset never waits for other sessions' locks without bound (a TRUNCATE waiting for a
    // reader would also hold up every new reader of the read model).
    Store::set_local_lock_timeout_in(&mut tx, lease).await?;
    // Every remaining lease of the perspective is lapsed, held by a dead instance, or (after
    // the bound) a straggler's: taking them back fences the holders, whose completion then
    // matches nothing and rolls back, so no apply commits after the reset's snapshot.
    let taken = Store::take_back_leases_in(&mut tx, &name).await?;
    if taken > 0 && !timed_out {
        progress(RebuildProgress::TookBackLapsed(taken));
    }
    perspective
        .reset(&mut ApplyTx::postgres(&mut tx))
        .await
        .map_err(|e| {
            RebuildError::Failed(format!("the reset statement failed: {}", e.message()))
        })?;
    // Read after the reset, under the lock: an event stored later has its work row from the
    // fan-out, and no claim takes the perspective until the mark is cleared.
    let up_to = Store::max_global_position_in(&mut tx).await?;
    if let Some(earlier) = Store::mark_rebuild_in(&mut tx, &name, up_to).await? {
        progress(RebuildProgress::RedoingInterrupted(earlier));
    }
    tx.commit().await?;
    progress(RebuildProgress::Reset);

    // (4) The history, re-queued in chunks that commit one by one: no transaction longer than a
    // chunk, so neither the vacuum horizon nor anyone's locks are held for the whole rebuild.
    // Interrupted here, the perspective stays marked (claims skip it, so no lane is applied with
    // a gap) until a rebuild runs again and redoes it; already queued events are skipped.
    let unfinished = |e: StoreError| RebuildError::Unfinished(e.to_string());
    let expected = store
        .history_event_count(&name, up_to)
        .await
        .map_err(unfinished)?;
    let mut queued = 0u64;
    let mut after = 0i64;
    loop {
        let mut chunk = conn.begin().await.map_err(|e| unfinished(e.into()))?;
        Store::set_local_lock_timeout_in(&mut chunk, lease)
            .await
            .map_err(unfinished)?;
        let (n, last) = requeue_history_batch_in(&mut chunk, &name, after, up_to, REBUILD_BATCH)
            .await
            .map_err(unfinished)?;
        chunk.commit().await.map_err(|e| unfinished(e.into()))?;
        queued += n;
        let Some(last) = last else { break };
        after = last;
        progress(RebuildProgress::Queued { queued, expected });
    }
    // Done: claims may take the perspective again (after the lock goes, in the caller).
    Store::clear_rebuild_in(conn, &name)
        .await
        .map_err(unfinished)?;
    Ok(Rebuilt { queued, expected })
}
