//! `vantage perspectives rebuild`: a rebuild runs the perspective's `reset` statement and
//! re-queues every historical event of its (registered) types, and is safe on a running daemon:
//!
//! 1. It takes the perspective's rebuild lock: a session-level advisory lock on
//!    `wh_perspective_lock_key(name)`, held on one dedicated connection for the whole run.
//!    From then on the daemons' claims skip the perspective (its new events wait, queued,
//!    nothing charged), and dead-letter moves, requeues and replays of it refuse with SQLSTATE
//!    55P03 (the daemon retries a move later; `vantage dlq` says the perspective is being
//!    rebuilt, exit 2). Claims, moves and replays already running hold the lock shared, so the
//!    rebuild waits for them (quietly for a moment, then saying so, at most `worker.lease`).
//!    Nothing is persisted: if the command dies, the server ends its session and the lock goes
//!    with it, so a crashed rebuild pauses nothing. A second rebuild of the same perspective is
//!    refused while one runs.
//! 2. It waits, at most `worker.lease`, until no row of the perspective is validly leased to a
//!    live instance: the applies in flight finish.
//! 3. In one short transaction (interrupted here, the rebuild changes nothing): it takes back
//!    every lease of the perspective that is left (lapsed, held by a dead instance, or a
//!    straggler's after the wait: their completion then matches nothing and rolls back, so no
//!    apply commits behind the reset's back), runs `reset`, and marks the perspective as being
//!    rebuilt up to the end of the store (`wh_perspectives.rebuild_up_to`); claims skip a
//!    marked perspective even after this command is gone. Lock waits are bounded by
//!    `worker.lease` (`lock_timeout`).
//! 4. It re-queues every stored event of its types up to that position in chunks of
//!    `REBUILD_BATCH`, each its own transaction, skipping events already queued (`ON CONFLICT
//!    DO NOTHING`) and events with an open dead letter (the operator decides those). No
//!    transaction is longer than a chunk, so a rebuild of a large store pins neither the vacuum
//!    horizon nor any lock for its length, and producers never wait for it (they do not write
//!    the lane index, migrations/0003_lanes.sql). Killed here, the perspective stays marked and
//!    unclaimed (no lane is applied with a gap) until `perspectives rebuild` runs again and redoes
//!    it; events already queued are skipped.
//! 5. It clears the mark, releases the lock, and only then do claims see the perspective again:
//!    every lane is whole (re-queued history plus the events that arrived meanwhile), so events
//!    are applied in stream order, each exactly once after the reset, with a `DELETE`-based reset
//!    as with `TRUNCATE`.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sqlx::{Connection, PgConnection};

use super::RebuildArgs;
use crate::cli::output::{self, confirm, Confirmed, Failure, Ui};
use crate::config::Settings;
use crate::perspective::{ApplyTx, Perspective, SqlPerspective};
use crate::store::{requeue_history_batch_in, Store, StoreError};

/// Events re-queued per round trip of a rebuild.
const REBUILD_BATCH: i64 = 10_000;
/// How often a rebuild looks whether the applies in flight have finished (each look counts the
/// perspective's leased rows: no index covers lease columns, by design).
const IN_FLIGHT_POLL: Duration = Duration::from_millis(250);
/// How long a rebuild waits for its lock before it says that it is waiting.
const QUIET_LOCK_WAIT: Duration = Duration::from_millis(500);

pub(super) async fn rebuild(
    ui: &Ui,
    settings: &Settings,
    store: &Store,
    args: RebuildArgs,
) -> Result<Value, Failure> {
    let name = args.name.as_str();
    let record = store
        .perspective(name)
        .await
        .map_err(|e| output::store_failure(&e))?;
    let Some(record) = record else {
        return Err(Failure::usage(format!(
            "No perspective named '{name}' is registered."
        )));
    };
    let Some(config) = settings.perspectives.iter().find(|p| p.name == name) else {
        return Err(Failure::usage(format!(
            "Perspective '{name}' has no handler in this configuration; cannot rebuild it."
        )));
    };
    if config.reset.is_none() {
        return Err(Failure::usage(format!(
            "Perspective '{name}' has no reset statement in this configuration; cannot rebuild it (add `reset` to its [[perspectives]] entry)."
        )));
    }
    if record.event_types != config.events {
        // Re-queueing follows the registry (the same subscription the fan-out uses).
        ui.note(format!(
            "Note: '{name}' is registered for [{}] but configured for [{}]; events are re-queued by the registered types.",
            record.event_types.join(", "),
            config.events.join(", ")
        ));
    }

    let confirmed = confirm(
        &format!(
            "Rebuild perspective '{name}'? Its read model is reset now and every historical event of its types is queued again. [y/N]"
        ),
        args.yes,
    )
    .await?;

    let handler = SqlPerspective::from_settings(config);
    let (queued, expected) =
        rebuild_locked(ui, store, &handler, settings.worker.lease, &confirmed).await?;
    ui.say(format!(
        "Rebuilt '{name}': read model reset; {queued} event(s) queued again for the daemon to apply."
    ));
    Ok(json!({"expected": expected, "perspective": name, "queued": queued}))
}

/// Why a rebuild stopped; every case changed nothing.
enum RebuildError {
    /// Another `perspectives rebuild` of it holds the lock.
    AlreadyRunning,
    /// Claims, moves, requeues or replays of it kept the lock busy for longer than the bound.
    Busy(Duration),
    /// A statement failed.
    Failed(String),
    /// A statement failed after the reset committed, while the history was being re-queued:
    /// the perspective stays marked (and unclaimed) until a rebuild runs again.
    Unfinished(String),
}

impl RebuildError {
    fn into_failure(self, name: &str) -> Failure {
        Failure::usage(match self {
            RebuildError::AlreadyRunning => format!(
                "Perspective '{name}' is already being rebuilt by another command. Nothing was changed."
            ),
            RebuildError::Busy(waited) => format!(
                "Rebuild of '{name}' failed: the perspective was still busy after {} (a claim, dead-letter move, replay or another rebuild of it in progress). Nothing was changed.",
                humantime::format_duration(waited)
            ),
            RebuildError::Failed(e) => {
                format!("Rebuild of '{name}' failed: {e}. Nothing was changed.")
            }
            RebuildError::Unfinished(e) => format!(
                "Rebuild of '{name}' failed while re-queueing its history: {e}. Its read model was reset and the daemons do not apply it until it is rebuilt: run `vantage perspectives rebuild {name}` again."
            ),
        })
    }
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

/// The whole rebuild under the perspective's lock, on one dedicated connection: (a) take the
/// lock (claims of the perspective stop; moves, requeues and replays of it refuse), (b) wait,
/// bounded by `lease`, for applies in flight to finish, (c) in one short transaction take back
/// every lease, reset and mark the perspective, (d) re-queue the history in chunks, then clear
/// the mark, (e) unlock and wake the daemons.
async fn rebuild_locked(
    ui: &Ui,
    store: &Store,
    handler: &SqlPerspective,
    lease: Duration,
    confirmed: &Confirmed,
) -> Result<(u64, i64), Failure> {
    let name = handler.name().to_string();
    let failure = |e: RebuildError| e.into_failure(&name);
    let mut conn = store
        .pool()
        .acquire()
        .await
        .map_err(|e| failure(e.into()))?;

    // (a) The lock. A held session lock dies with the session: nothing to clean up after a crash.
    if let Err(e) = lock(ui, store, &mut conn, &name, lease).await {
        // Whatever happened, this session must not go back to the pool holding the lock.
        let _ = conn.close().await;
        return Err(failure(e));
    }

    let result = rebuild_under_lock(ui, store, &mut conn, handler, lease, confirmed).await;

    // (d) Unlock only now: the re-queued history is committed, so the first claim after this
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
    result.map_err(failure)
}

/// (a) of [`rebuild_locked`]. Claims hold the lock shared for the length of one statement, so
/// a running daemon makes it busy now and then: wait quietly for a moment, then say so and wait
/// up to `lease` (a queued exclusive request already turns new claims, moves, requeues and
/// replays of the perspective away; only those in progress are waited for).
async fn lock(
    ui: &Ui,
    store: &Store,
    conn: &mut PgConnection,
    name: &str,
    lease: Duration,
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
    ui.note(format!(
        "Waiting for claims, dead-letter moves and replays of '{name}' in progress to finish..."
    ));
    if Store::lock_for_rebuild(conn, name, lease).await? {
        Ok(())
    } else {
        Err(RebuildError::Busy(lease))
    }
}

/// (b) and (c) of [`rebuild_locked`]. Returns (queued, the approximate total).
async fn rebuild_under_lock(
    ui: &Ui,
    store: &Store,
    conn: &mut PgConnection,
    handler: &SqlPerspective,
    lease: Duration,
    _confirmed: &Confirmed,
) -> Result<(u64, i64), RebuildError> {
    let name = handler.name().to_string();

    // (b) No claim of the perspective starts any more; let the applies in flight finish. Leases
    // that are not renewed lapse within `lease`; past that, (c) fences what is left.
    let started = Instant::now();
    let mut announced = false;
    let mut timed_out = false;
    loop {
        let in_flight = Store::live_leases_in(conn, &name).await?;
        if in_flight == 0 {
            break;
        }
        if started.elapsed() >= lease {
            ui.note(format!(
                "{in_flight} event(s) of '{name}' are still leased after {}: taking them back; their applies in flight will be rolled back.",
                humantime::format_duration(lease)
            ));
            timed_out = true;
            break;
        }
        if !announced {
            ui.note(format!(
                "Claims of '{name}' are paused; waiting for {in_flight} event(s) in flight in the daemon to finish (at most {})...",
                humantime::format_duration(lease)
            ));
            announced = true;
        }
        tokio::time::sleep(IN_FLIGHT_POLL).await;
    }

    // (c) One short transaction: take back the leases, reset, and mark the perspective as being
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
        ui.note(format!("Took back {taken} lapsed lease(s) of '{name}'."));
    }
    handler
        .reset(&mut ApplyTx::postgres(&mut tx))
        .await
        .map_err(|e| {
            RebuildError::Failed(format!("the reset statement failed: {}", e.message()))
        })?;
    // Read after the reset, under the lock: an event stored later has its work row from the
    // fan-out, and no claim takes the perspective until the mark is cleared.
    let up_to = Store::max_global_position_in(&mut tx).await?;
    if let Some(earlier) = Store::mark_rebuild_in(&mut tx, &name, up_to).await? {
        ui.note(format!(
            "An earlier rebuild of '{name}' was interrupted (it had marked history up to position {earlier}); redoing it."
        ));
    }
    tx.commit().await?;
    ui.note(format!("Reset the read model of '{name}'."));

    // (d) The history, re-queued in chunks that commit one by one: no transaction longer than a
    // chunk, so neither the vacuum horizon nor anyone's locks are held for the whole rebuild.
    // Interrupted here, the perspective stays marked (claims skip it, so no lane is applied with
    // a gap) until a rebuild runs again and redoes it; already queued events are skipped.
    let expected = store
        .history_event_count(&name, up_to)
        .await
        .map_err(|e| RebuildError::Unfinished(e.to_string()))?;
    let mut queued = 0u64;
    let mut after = 0i64;
    let unfinished = |e: StoreError| RebuildError::Unfinished(e.to_string());
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
        ui.note(format!("queued {queued} of ~{expected}"));
    }
    // (e) Done: claims may take the perspective again (after the lock goes, in the caller).
    Store::clear_rebuild_in(conn, &name)
        .await
        .map_err(unfinished)?;
    Ok((queued, expected))
}
