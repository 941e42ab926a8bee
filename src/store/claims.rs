//! The claims: the contract's claim functions, and the rows they return. What happens to a
//! claimed row afterwards is in [`leases`](super::leases).

use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::{Column, Row};
use uuid::Uuid;

use super::error::{map_db_error, StoreError};
use super::handle::Store;
use super::instances::InstanceId;
use super::leases::lease_seconds;

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
    /// How long its work row had been queued when the claim returned it, on the database's
    /// clock (the start of the append's transaction, or of the requeue or rebuild that queued it
    /// again): where `vantage_append_to_applied_seconds` starts. `None` when the store does not
    /// know (the memory store, whose clock is the test's).
    pub queued_for: Option<std::time::Duration>,
    /// Whether this row re-delivers history the perspective already had (a rebuild's re-queue, a
    /// version backfill's diverted rows; migration 0016): see
    /// [`EventEnvelope::replay`](crate::perspective::EventEnvelope::replay).
    pub replay: bool,
}

#[cfg(test)]
impl WorkRow {
    /// A first-time row of `perspective` on `stream_id` with fresh ids and no payload, for the
    /// pipeline's unit tests.
    pub(crate) fn sample(perspective: &str, stream_id: Uuid) -> WorkRow {
        WorkRow {
            event_work_id: Uuid::new_v4(),
            stream_id,
            event_id: Uuid::new_v4(),
            perspective_name: perspective.to_string(),
            global_position: 1,
            stream_version: 1,
            event_type: Some("T".into()),
            event_data: None,
            metadata: None,
            attempts: 1,
            failures: 0,
            queued_for: None,
            replay: false,
        }
    }
}

/// The columns of a [`WorkRow`], in the order the claims select them (`work_row_columns!`).
const WORK_ROW_NAMES: [&str; 13] = [
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
    "queued_for",
    "replay",
];

/// The select list of the claims that return [`WorkRow`]s, over the claim function's rows `g`
/// (a macro, for `concat!`).
///
/// `queued_for` is measured from the work row's `created_at`, which the claim function returns
/// as its last column, `queued_at` (migration 0015; before it, a correlated subquery read it
/// back, one index probe per claimed row); `replay` is the claim's last column since 0016.
/// `$data` is the expression of the `event_data` column: `g.event_data`, or one that sends it
/// only when asked (the daemon's claim when no perspective reads payloads).
macro_rules! work_row_columns {
    () => {
        work_row_columns!("g.event_data")
    };
    ($data:literal) => {
        concat!(
            "g.event_work_id, g.stream_id, g.event_id, g.perspective_name, g.global_position, \
             g.stream_version, g.event_type, ",
            $data,
            " AS event_data, g.metadata, g.attempts, g.failures, \
             coalesce(extract(epoch FROM clock_timestamp() - g.queued_at), 0)::float8 AS queued_for, \
             g.replay"
        )
    };
}

/// Reads the columns by position when the row has them in `WORK_ROW_NAMES` order (the claims
/// here), by name otherwise: a lookup by name hashes the name (SipHash), once per column and row,
/// which was a visible part of the daemon's CPU for a claim of 500 rows. By position the
/// columns' types are not checked again for every row (`try_get_unchecked`: the types are those
/// of our own select list over our own claim function, fixed by the schema; a wrong one would
/// fail to decode, never decode wrongly), which was a third of what decoding a row cost.
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
                row.try_get_unchecked(i)
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
            // Negative only if the database's clock stepped back.
            queued_for: get::<Option<f64>>(row, positional, 11)?
                .map(|s| std::time::Duration::from_secs_f64(s.clamp(0.0, 1e9))),
            replay: get(row, positional, 12)?,
        })
    }
}

impl Store {
    /// The daemon's claim, one call per batch: `get_stream_events` with no stream list takes up
    /// to `max_lanes` due lanes from the lane index (orphaned ones included: expired leases,
    /// dead holders) and leases the claimable prefix of each (`max_rows` rows in all), returning
    /// the rows raw, ordered by stream, perspective, stream_version. Without `data`, the rows'
    /// `event_data` is not sent (`None`: no perspective of the caller reads payloads).
    pub(crate) async fn claim_work(
        &self,
        instance: InstanceId,
        lease: Duration,
        max_lanes: u32,
        max_rows: u32,
        perspectives: Option<&[String]>,
        data: bool,
    ) -> Result<Vec<WorkRow>, StoreError> {
        sqlx::query_as::<_, WorkRow>(concat!(
            "SELECT ",
            work_row_columns!("CASE WHEN $6 THEN g.event_data END"),
            " FROM get_stream_events($1, NULL, $2, $3, $4, $5) g"
        ))
        .bind(instance.0)
        .bind(lease_seconds(lease))
        .bind(perspectives)
        .bind(max_rows.min(i32::MAX as u32) as i32)
        .bind(max_lanes.min(i32::MAX as u32) as i32)
        .bind(data)
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Acquires lanes whose head is unowned and due, expired, or held by a dead instance.
    pub(crate) async fn claim_orphaned(
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
    pub(crate) async fn get_stream_events(
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
            " FROM get_stream_events($1, $2, $3, $4, $5) g"
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
    pub(crate) async fn claim_and_fetch_pending(
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
}
