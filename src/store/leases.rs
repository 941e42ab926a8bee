//! Every statement that changes a row leased to us, in one shape: a function over any executor
//! (the pool, or a batch's transaction), fenced on the lease holder in SQL. A row no longer
//! leased to `instance` is left alone, and each function says how many rows it changed.
//!
//! These are the store's side of the lease handle (`pipeline::lease`): the pipeline reaches
//! them only through [`WorkStore`](super::WorkStore) and [`WorkTx`](super::WorkTx), whose
//! PostgreSQL implementations call them; nothing here moves a row unfenced.

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool, Postgres};
use uuid::Uuid;

use super::apply::StatementBatch;
use super::dead_letters::{MoveOutcome, SOURCE_TABLE};
use super::error::{map_db_error, StoreError};
use super::instances::InstanceId;

/// Lease lengths in whole seconds, as the SQL functions take them (at least one).
pub(crate) fn lease_seconds(lease: Duration) -> i32 {
    lease.as_secs().clamp(1, i32::MAX as u64) as i32
}

/// Completes (deletes) rows, e.g. inside the batch's transaction, so a perspective's writes and
/// the completion of its work rows commit together (exactly-once effects). Returns how many
/// were still ours: fewer than `ids.len()` means a lease was lost and the transaction must be
/// rolled back.
pub async fn complete<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    instance: InstanceId,
    ids: &[Uuid],
) -> Result<u64, StoreError> {
    if ids.is_empty() {
        return Ok(0);
    }
    let n: i32 = sqlx::query_scalar("SELECT complete_perspective_events($1, $2)")
        .bind(instance.0)
        .bind(ids)
        .fetch_one(executor)
        .await
        .map_err(map_db_error)?;
    Ok(n as u64)
}

/// Runs every statement of `batch`, in order, and then completes `complete` (may be empty), in
/// the caller's transaction, in one round trip (`apply_and_complete_perspective_events`).
/// Returns how many of `complete` were still ours: fewer means a lease was lost and the
/// transaction must be rolled back. An error of any statement fails the call.
pub async fn apply_statements_and_complete(
    conn: &mut PgConnection,
    batch: &StatementBatch<'_>,
    instance: InstanceId,
    complete: &[Uuid],
) -> Result<u64, StoreError> {
    let (statements, statement) = batch.canonical();
    let n = batch_call(
        "SELECT apply_and_complete_perspective_events($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        batch,
        (&statements, &statement),
        instance,
        complete,
    )
    .fetch_one(conn)
    .await
    .map_err(map_db_error)?;
    Ok(n as u64)
}

/// `sql`, a call taking the daemon's batch (instance, rows to complete, the statement list and
/// each event's index into it, then the seven parameter arrays), with its arguments bound.
fn batch_call<'q>(
    sql: &'q str,
    batch: &'q StatementBatch<'_>,
    (statements, statement): (&'q Vec<&'q str>, &'q Vec<i32>),
    instance: InstanceId,
    complete: &'q [Uuid],
) -> sqlx::query::QueryScalar<'q, Postgres, i32, sqlx::postgres::PgArguments> {
    sqlx::query_scalar(sql)
        .bind(instance.0)
        .bind(complete)
        .bind(statements)
        .bind(statement)
        .bind(batch.sent(1, &batch.data))
        .bind(batch.sent(2, &batch.stream_id))
        .bind(batch.sent(3, &batch.event_id))
        .bind(batch.sent(4, &batch.event_type))
        .bind(batch.sent(5, &batch.global_position))
        .bind(batch.sent(6, &batch.stream_version))
        .bind(batch.sent(7, &batch.metadata))
}

/// SQLSTATE of `wh_apply_and_complete_perspective_events_all_or_nothing` when a row of the
/// batch is no longer ours (migration 0019).
const LEASE_LOST: &str = "VL001";

/// [`apply_statements_and_complete`] as a statement of its own, outside any transaction, all or
/// nothing (`wh_apply_and_complete_perspective_events_all_or_nothing`): true when every row of
/// `complete` was ours and the statements' writes and the completion committed together; false
/// when some row was no longer ours, and nothing was kept. An error of any statement fails the
/// call (nothing kept either).
pub async fn apply_statements_and_complete_alone(
    conn: &mut PgConnection,
    batch: &StatementBatch<'_>,
    instance: InstanceId,
    complete: &[Uuid],
) -> Result<bool, StoreError> {
    let (statements, statement) = batch.canonical();
    let result = batch_call(
        "SELECT wh_apply_and_complete_perspective_events_all_or_nothing\
         ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        batch,
        (&statements, &statement),
        instance,
        complete,
    )
    .fetch_one(conn)
    .await;
    match result {
        Ok(_) => Ok(true),
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some(LEASE_LOST) => Ok(false),
        Err(e) => Err(map_db_error(e)),
    }
}

/// Records an apply failure (failures + 1, last_error, lease cleared, parked for
/// `retry_after`). False if the row is no longer ours.
pub async fn record_failure<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    instance: InstanceId,
    id: Uuid,
    error: &str,
    retry_after: Duration,
) -> Result<bool, StoreError> {
    let interval = sqlx::postgres::types::PgInterval::try_from(retry_after)
        .map_err(|e| StoreError::Database(sqlx::Error::Encode(e)))?;
    sqlx::query_scalar("SELECT record_perspective_event_failure($1, $2, $3, $4, $5)")
        .bind(instance.0)
        .bind(id)
        .bind(error)
        .bind(retry_after.as_secs().min(i32::MAX as u64) as i32)
        .bind(interval)
        .fetch_one(executor)
        .await
        .map_err(map_db_error)
}

/// Keeps `error` as the row's `last_error` without charging it (the row is given back
/// uncharged: a lock conflict, a lost database). False if the row is no longer ours.
pub async fn note_error<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    instance: InstanceId,
    id: Uuid,
    error: &str,
) -> Result<bool, StoreError> {
    sqlx::query_scalar("SELECT note_perspective_event_error($1, $2, $3)")
        .bind(instance.0)
        .bind(id)
        .bind(error)
        .fetch_one(executor)
        .await
        .map_err(map_db_error)
}

/// Gives back rows a handler saw, without a refund (the attempt was used). Returns how many
/// were ours.
pub async fn release_started<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    instance: InstanceId,
    ids: &[Uuid],
) -> Result<u64, StoreError> {
    release(
        executor,
        "SELECT release_started_leases($1, $2)",
        instance,
        ids,
    )
    .await
}

/// Gives back rows claimed but never handed to a handler, refunding exactly the bump their
/// claim made (none for a row this instance re-leased without a takeover). Returns how many
/// were ours.
pub async fn release_unstarted<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    instance: InstanceId,
    ids: &[Uuid],
) -> Result<u64, StoreError> {
    release(
        executor,
        "SELECT release_unstarted_leases($1, $2)",
        instance,
        ids,
    )
    .await
}

/// Every row leased to `instance` now (valid or lapsed). For the owner's sweep after a claim
/// whose answer was lost: rare, so no index on the holder (a scan of the work table).
pub async fn leased_to<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    instance: InstanceId,
) -> Result<Vec<Uuid>, StoreError> {
    sqlx::query_scalar("SELECT event_work_id FROM wh_perspective_events WHERE instance_id = $1")
        .bind(instance.0)
        .fetch_all(executor)
        .await
        .map_err(map_db_error)
}

/// One of the two give-back functions (`statement` is one of the constants above, never built).
async fn release<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    statement: &'static str,
    instance: InstanceId,
    ids: &[Uuid],
) -> Result<u64, StoreError> {
    if ids.is_empty() {
        return Ok(0);
    }
    let n: i32 = sqlx::query_scalar(statement)
        .bind(instance.0)
        .bind(ids)
        .fetch_one(executor)
        .await
        .map_err(map_db_error)?;
    Ok(n as u64)
}

/// Moves a row leased to `instance` to the dead letters (atomic, idempotent). While the row's
/// perspective is being rebuilt it refuses with SQLSTATE 55P03
/// ([`StoreError::is_rebuild_in_progress`]): transient, nothing changed, nobody charged;
/// otherwise it holds the rebuild lock shared until the executor's transaction ends.
pub async fn move_to_dead_letters<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    instance: InstanceId,
    work_id: Uuid,
    reason: &str,
    error_text: &str,
) -> Result<MoveOutcome, StoreError> {
    let id: Option<Uuid> =
        sqlx::query_scalar("SELECT move_to_dead_letters($1, $2, $3, $4, $5, $6)")
            .bind(Uuid::new_v4())
            .bind(SOURCE_TABLE)
            .bind(work_id)
            .bind(reason)
            .bind(error_text)
            .bind(instance.0)
            .fetch_one(executor)
            .await
            .map_err(map_db_error)?;
    Ok(id.map_or(MoveOutcome::AlreadyGone, MoveOutcome::Moved))
}

/// Moves many rows leased to `instance` to the dead letters in one statement
/// (`move_many_to_dead_letters`): the same rules as [`move_to_dead_letters`] for each.
/// Returns (work id, dead letter id) for every row moved; a row not listed was already gone.
pub async fn move_many_to_dead_letters<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    instance: InstanceId,
    moves: &[(Uuid, String)],
    reason: &str,
) -> Result<Vec<(Uuid, Uuid)>, StoreError> {
    if moves.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<Uuid> = moves.iter().map(|(id, _)| *id).collect();
    let errors: Vec<&str> = moves.iter().map(|(_, e)| e.as_str()).collect();
    sqlx::query_as(
        "SELECT source_id, dead_letter_id FROM move_many_to_dead_letters($1, $2, $3, $4)",
    )
    .bind(instance.0)
    .bind(&ids)
    .bind(reason)
    .bind(&errors)
    .fetch_all(executor)
    .await
    .map_err(map_db_error)
}

/// Extends the leases of rows we still hold; returns how many.
pub async fn renew_leases<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    instance: InstanceId,
    ids: &[Uuid],
    lease: Duration,
) -> Result<u64, StoreError> {
    if ids.is_empty() {
        return Ok(0);
    }
    let n: i32 = sqlx::query_scalar("SELECT renew_leases($1, $2, $3)")
        .bind(instance.0)
        .bind(ids)
        .bind(lease_seconds(lease))
        .fetch_one(executor)
        .await
        .map_err(map_db_error)?;
    Ok(n as u64)
}

/// Opens a batch session: a connection of the pool kept for batches (closed, not returned to
/// the pool, when it is let go: its settings are a batch's), whose statements may each run at
/// most `statement_timeout` and wait as long for a lock, and its server process id (to cancel
/// its work from elsewhere), set and read once, in one round trip.
pub async fn open_batch_session(
    pool: &PgPool,
    statement_timeout: Duration,
) -> Result<(PoolConnection<Postgres>, i32), StoreError> {
    let mut conn = pool.acquire().await.map_err(map_db_error)?;
    conn.close_on_drop();
    let millis = statement_timeout
        .as_millis()
        .clamp(1, i32::MAX as u128)
        .to_string();
    // (the perspective's statements may wait for locks of the read model as long as they may
    // run; the pool's LOCK_TIMEOUT is for vantage's own statements)
    let pid: i32 = sqlx::query_scalar(
        "SELECT pg_backend_pid() FROM set_config('statement_timeout', $1, false) s, \
         set_config('lock_timeout', $1, false) l",
    )
    .bind(millis)
    .fetch_one(&mut *conn)
    .await
    .map_err(map_db_error)?;
    Ok((conn, pid))
}

/// Cancels whatever the server process `pid` is running (the statement of a batch we gave up
/// on), so its transaction rolls back and releases its locks.
pub async fn cancel_backend(pool: &PgPool, pid: i32) -> Result<bool, StoreError> {
    sqlx::query_scalar("SELECT pg_cancel_backend($1)")
        .bind(pid)
        .fetch_one(pool)
        .await
        .map_err(map_db_error)
}
