//! Claims and the lease holder's state changes. Every change is fenced on the instance id in SQL.

use std::time::Duration;

use sqlx::postgres::{PgConnection, PgRow};
use sqlx::{Column, Row};
use uuid::Uuid;

use super::{map_db_error, InstanceId, Store, StoreError};

/// A lane head acquired by `claim_orphaned_perspective_events`.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct ClaimedHead {
    /// The work row.
    pub event_work_id: Uuid,
    /// Its stream.
    pub stream_id: Uuid,
    /// Its perspective.
    pub perspective_name: String,
}

/// A work row leased to us, with its raw event, as `get_stream_events` returns it
/// (before the DLQ filter and deserialization).
#[derive(Clone, Debug, PartialEq)]
pub struct WorkRow {
    /// The work row's id (one per event and perspective).
    pub event_work_id: Uuid,
    /// The event's stream.
    pub stream_id: Uuid,
    /// The event's id.
    pub event_id: Uuid,
    /// The perspective this row is for.
    pub perspective_name: String,
    /// The event's global position.
    pub global_position: i64,
    /// The event's version within its stream.
    pub stream_version: i32,
    /// `None` when the event has vanished from the event store.
    pub event_type: Option<String>,
    /// The event's payload.
    pub event_data: Option<serde_json::Value>,
    /// The event's metadata.
    pub metadata: Option<serde_json::Value>,
    /// How many times this row has been claimed (taken over), one-based.
    pub attempts: i32,
    /// How many apply failures were recorded for it.
    pub failures: i32,
}

/// The columns of a [`WorkRow`], in the order the claims select them (`work_row_columns!`).
const WORK_ROW_NAMES: [&str; 11] = [
    "event_work_id",
    "stream_id",
    "event_id",
    "perspective_name",
    "global_position",
    "stream_version",
    "event_type",
    "event_data",
    "metadata",
    "attempts",
    "failures",
];

/// The select list of the claims that return [`WorkRow`]s (a macro, for `concat!`).
macro_rules! work_row_columns {
    () => {
        "event_work_id, stream_id, event_id, perspective_name, global_position, \
         stream_version, event_type, event_data, metadata, attempts, failures"
    };
}

/// Reads the columns by position when the row has them in `WORK_ROW_NAMES` order (the claims
/// here), by name otherwise: a lookup by name hashes the name (SipHash), eleven times a row,
/// which was a visible part of the daemon's CPU for a claim of 500 rows.
impl<'r> sqlx::FromRow<'r, PgRow> for WorkRow {
    fn from_row(row: &'r PgRow) -> Result<Self, sqlx::Error> {
        let columns = row.columns();
        let positional = columns.len() >= WORK_ROW_NAMES.len()
            && WORK_ROW_NAMES
                .iter()
                .zip(columns)
                .all(|(name, column)| column.name() == *name);
        fn get<'r, T>(row: &'r PgRow, positional: bool, i: usize) -> Result<T, sqlx::Error>
        where
            T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
        {
            if positional {
                row.try_get(i)
            } else {
                row.try_get(WORK_ROW_NAMES[i])
            }
        }
        Ok(WorkRow {
            event_work_id: get(row, positional, 0)?,
            stream_id: get(row, positional, 1)?,
            event_id: get(row, positional, 2)?,
            perspective_name: get(row, positional, 3)?,
            global_position: get(row, positional, 4)?,
            stream_version: get(row, positional, 5)?,
            event_type: get(row, positional, 6)?,
            event_data: get(row, positional, 7)?,
            metadata: get(row, positional, 8)?,
            attempts: get(row, positional, 9)?,
            failures: get(row, positional, 10)?,
        })
    }
}

fn lease_seconds(lease: Duration) -> i32 {
    lease.as_secs().clamp(1, i32::MAX as u64) as i32
}

impl Store {
    /// The daemon's claim, one call per batch: `get_stream_events` with no stream list takes up
    /// to `max_lanes` due lanes from the lane index (orphaned ones included: expired leases,
    /// dead holders) and leases the claimable prefix of each (`max_rows` rows in all), returning
    /// the rows raw, ordered by stream, perspective, stream_version.
    pub async fn claim_work(
        &self,
        instance: InstanceId,
        lease: Duration,
        max_lanes: u32,
        max_rows: u32,
        perspectives: Option<&[String]>,
    ) -> Result<Vec<WorkRow>, StoreError> {
        sqlx::query_as::<_, WorkRow>(concat!(
            "SELECT ",
            work_row_columns!(),
            " FROM get_stream_events($1, NULL, $2, $3, $4, $5)"
        ))
        .bind(instance.0)
        .bind(lease_seconds(lease))
        .bind(perspectives)
        .bind(max_rows.min(i32::MAX as u32) as i32)
        .bind(max_lanes.min(i32::MAX as u32) as i32)
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Acquires lanes whose head is unowned and due, expired, or held by a dead instance.
    pub async fn claim_orphaned(
        &self,
        instance: InstanceId,
        lease: Duration,
        max_streams: u32,
        max_rows: u32,
        perspectives: Option<&[String]>,
    ) -> Result<Vec<ClaimedHead>, StoreError> {
        sqlx::query_as::<_, ClaimedHead>(
            "SELECT event_work_id, stream_id, perspective_name \
             FROM claim_orphaned_perspective_events($1, $2, $3, $4, $5)",
        )
        .bind(instance.0)
        .bind(lease_seconds(lease))
        .bind(max_streams.min(i32::MAX as u32) as i32)
        .bind(max_rows.min(i32::MAX as u32) as i32)
        .bind(perspectives)
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Claims the claimable rows of `streams` and returns every row of them validly leased to us
    /// (within the `max_rows` window), ordered by stream, perspective, stream_version.
    pub async fn get_stream_events(
        &self,
        instance: InstanceId,
        streams: &[Uuid],
        lease: Duration,
        perspectives: Option<&[String]>,
        max_rows: Option<u32>,
    ) -> Result<Vec<WorkRow>, StoreError> {
        sqlx::query_as::<_, WorkRow>(concat!(
            "SELECT ",
            work_row_columns!(),
            " FROM get_stream_events($1, $2, $3, $4, $5)"
        ))
        .bind(instance.0)
        .bind(streams)
        .bind(lease_seconds(lease))
        .bind(perspectives)
        .bind(max_rows.map(|m| m.min(i32::MAX as u32) as i32))
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// The same claim for one lane: returns (work id, event id, stream_version, attempts).
    pub async fn claim_and_fetch_pending(
        &self,
        stream: Uuid,
        perspective: &str,
        instance: InstanceId,
        lease: Duration,
    ) -> Result<Vec<(Uuid, Uuid, i32, i32)>, StoreError> {
        sqlx::query_as(
            "SELECT event_work_id, event_id, stream_version, attempts \
             FROM claim_and_fetch_pending_perspective_events($1, $2, $3, $4)",
        )
        .bind(stream)
        .bind(perspective)
        .bind(instance.0)
        .bind(lease_seconds(lease))
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Deletes our rows (applied); returns how many were still ours.
    pub async fn complete(&self, instance: InstanceId, ids: &[Uuid]) -> Result<u64, StoreError> {
        let mut conn = self.pool.acquire().await?;
        complete_in(&mut conn, instance, ids).await
    }

    /// Records an apply failure and parks the row for `retry_after`; false if no longer ours.
    pub async fn record_failure(
        &self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
        retry_after: Duration,
    ) -> Result<bool, StoreError> {
        record_failure_in(&self.pool, instance, id, error, retry_after).await
    }

    /// Gives back rows claimed but never handed to a handler, refunding exactly the bump their
    /// claim made (none for a row this instance re-leased without a takeover).
    pub async fn release_unstarted(
        &self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        release_unstarted_in(&self.pool, instance, ids).await
    }

    /// Gives back rows a handler saw, without a refund (the attempt was used).
    pub async fn release_started(
        &self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        release_started_in(&self.pool, instance, ids).await
    }

    /// Keeps `error` as the row's `last_error` without charging it (the row is given back
    /// uncharged: a lock conflict, a lost database). False if the row is no longer ours.
    pub async fn note_error(
        &self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
    ) -> Result<bool, StoreError> {
        sqlx::query_scalar("SELECT note_perspective_event_error($1, $2, $3)")
            .bind(instance.0)
            .bind(id)
            .bind(error)
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)
    }

    /// Begins a batch transaction whose statements may each run at most `statement_timeout`,
    /// and returns it with its server process id (to cancel its work from elsewhere).
    pub async fn begin_batch(
        &self,
        statement_timeout: Duration,
    ) -> Result<(sqlx::Transaction<'static, sqlx::Postgres>, i32), StoreError> {
        let mut tx = self.pool.begin().await?;
        let millis = statement_timeout
            .as_millis()
            .clamp(1, i32::MAX as u128)
            .to_string();
        // (the perspective's statements may wait for locks of the read model as long as they may
        // run; the pool's LOCK_TIMEOUT is for vantage's own statements)
        let pid: i32 = sqlx::query_scalar(
            "SELECT pg_backend_pid() FROM set_config('statement_timeout', $1, true) s, \
             set_config('lock_timeout', $1, true) l",
        )
        .bind(millis)
        .fetch_one(&mut *tx)
        .await
        .map_err(map_db_error)?;
        Ok((tx, pid))
    }

    /// Cancels whatever the server process `pid` is running (the statement of a batch we gave
    /// up on), so its transaction rolls back and releases its locks.
    pub async fn cancel_backend(&self, pid: i32) -> Result<bool, StoreError> {
        sqlx::query_scalar("SELECT pg_cancel_backend($1)")
            .bind(pid)
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)
    }

    /// Extends the leases of rows we still hold; returns how many.
    pub async fn renew_leases(
        &self,
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
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)?;
        Ok(n as u64)
    }
}

/// Completes rows inside the caller's transaction, so a perspective's writes and the completion
/// of its work rows commit together (exactly-once effects). Returns how many were still ours:
/// fewer than `ids.len()` means a lease was lost and the transaction must be rolled back.
pub async fn complete_in(
    conn: &mut PgConnection,
    instance: InstanceId,
    ids: &[Uuid],
) -> Result<u64, StoreError> {
    if ids.is_empty() {
        return Ok(0);
    }
    let n: i32 = sqlx::query_scalar("SELECT complete_perspective_events($1, $2)")
        .bind(instance.0)
        .bind(ids)
        .fetch_one(conn)
        .await
        .map_err(map_db_error)?;
    Ok(n as u64)
}

/// Records an apply failure (failures + 1, last_error, lease cleared, parked for `retry_after`)
/// on any executor, e.g. the batch's transaction. False if the row is no longer ours.
pub async fn record_failure_in<'c, E: sqlx::PgExecutor<'c>>(
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

/// Gives back rows a handler saw, without a refund, on any executor. Returns how many were ours.
pub async fn release_started_in<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    instance: InstanceId,
    ids: &[Uuid],
) -> Result<u64, StoreError> {
    release_in(
        executor,
        "SELECT release_started_leases($1, $2)",
        instance,
        ids,
    )
    .await
}

/// Gives back unstarted rows with a refund of their claim's bump, on any executor. Returns how
/// many were ours.
pub async fn release_unstarted_in<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    instance: InstanceId,
    ids: &[Uuid],
) -> Result<u64, StoreError> {
    release_in(
        executor,
        "SELECT release_unstarted_leases($1, $2)",
        instance,
        ids,
    )
    .await
}

/// One of the two give-back functions (`statement` is one of the constants above, never built).
async fn release_in<'c, E: sqlx::PgExecutor<'c>>(
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
