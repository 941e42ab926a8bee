//! The event store and the perspective registry.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::error::{map_db_error, StoreError};
use super::handle::Store;

/// One event to append (`append_events`' element shape).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NewEvent {
    /// The event's type, e.g. `OrderPlaced`.
    pub event_type: String,
    /// The payload, any JSON value; perspectives get it as [`EventEnvelope::data`]
    /// (typed ones deserialized, see [`decode_event`](crate::perspective::decode_event)).
    ///
    /// [`EventEnvelope::data`]: crate::perspective::EventEnvelope::data
    pub data: serde_json::Value,
    /// Optional metadata (perspectives see an empty object when none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_json::Value>,
    /// Optional id; generated when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<Uuid>,
}

impl NewEvent {
    /// An event with a type and a payload.
    pub fn new(event_type: impl Into<String>, data: serde_json::Value) -> Self {
        NewEvent {
            event_type: event_type.into(),
            data,
            metadata: None,
            event_id: None,
        }
    }
}

/// What `append_events` returns per appended event.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct AppendedEvent {
    /// Position in the whole store.
    pub global_position: i64,
    /// The event's id.
    pub event_id: Uuid,
    /// Version within its stream (1-based).
    pub stream_version: i32,
}

/// An event as stored.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct StoredEvent {
    /// Position in the whole store.
    pub global_position: i64,
    /// The event's id.
    pub event_id: Uuid,
    /// Its stream.
    pub stream_id: Uuid,
    /// Version within its stream.
    pub stream_version: i32,
    /// Its type.
    pub event_type: String,
    /// The payload.
    pub event_data: serde_json::Value,
    /// Metadata.
    pub metadata: serde_json::Value,
    /// When it was stored.
    pub created_at: DateTime<Utc>,
}

/// A registered perspective.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct PerspectiveRecord {
    /// Its name.
    pub perspective_name: String,
    /// The event types it subscribes to (`*` = all).
    pub event_types: Vec<String>,
    /// First registration.
    pub created_at: DateTime<Utc>,
    /// Last change of its subscriptions.
    pub updated_at: DateTime<Utc>,
}

impl Store {
    /// Appends events to a stream. `expected_version`: the version the writer last saw
    /// (0 = new stream), `None` = any. A mismatch is [`StoreError::Conflict`].
    pub async fn append_events(
        &self,
        stream_id: Uuid,
        expected_version: Option<i32>,
        events: &[NewEvent],
    ) -> Result<Vec<AppendedEvent>, StoreError> {
        let mut conn = self.pool.acquire().await?;
        append_events_in(&mut conn, stream_id, expected_version, events).await
    }

    /// Registers a perspective (or updates its subscriptions).
    pub async fn register_perspective(
        &self,
        name: &str,
        event_types: &[String],
    ) -> Result<(), StoreError> {
        sqlx::query("SELECT register_perspective($1, $2)")
            .bind(name)
            .bind(event_types)
            .execute(&self.pool)
            .await
            .map_err(map_db_error)?;
        Ok(())
    }

    /// Every registered perspective, by name.
    pub(crate) async fn perspectives(&self) -> Result<Vec<PerspectiveRecord>, StoreError> {
        sqlx::query_as(
            "SELECT perspective_name, event_types, created_at, updated_at \
             FROM wh_perspectives ORDER BY perspective_name",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// One registered perspective.
    pub(crate) async fn perspective(
        &self,
        name: &str,
    ) -> Result<Option<PerspectiveRecord>, StoreError> {
        sqlx::query_as(
            "SELECT perspective_name, event_types, created_at, updated_at \
             FROM wh_perspectives WHERE perspective_name = $1",
        )
        .bind(name)
        .fetch_optional(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Reads the event at a global position, live from the event store.
    pub(crate) async fn event_at(
        &self,
        global_position: i64,
    ) -> Result<Option<StoredEvent>, StoreError> {
        sqlx::query_as(
            "SELECT global_position, event_id, stream_id, stream_version, event_type, \
                    event_data, metadata, created_at \
             FROM wh_event_store WHERE global_position = $1",
        )
        .bind(global_position)
        .fetch_optional(&self.pool)
        .await
        .map_err(map_db_error)
    }
}

/// Appends events inside the caller's transaction (so a batch of appends can be all-or-nothing).
pub async fn append_events_in(
    conn: &mut sqlx::PgConnection,
    stream_id: Uuid,
    expected_version: Option<i32>,
    events: &[NewEvent],
) -> Result<Vec<AppendedEvent>, StoreError> {
    let payload = serde_json::to_value(events)
        .map_err(|e| StoreError::Database(sqlx::Error::Encode(Box::new(e))))?;
    sqlx::query_as(
        "SELECT global_position, event_id, stream_version FROM append_events($1, $2, $3)",
    )
    .bind(stream_id)
    .bind(expected_version)
    .bind(payload)
    .fetch_all(conn)
    .await
    .map_err(map_db_error)
}

/// Re-queues, for one perspective, every stored event of its types with a position in
/// `(after, up_to]`, at most `limit` of them (a batch of a rebuild), inside the caller's
/// transaction. Events already queued for it are left alone, and so are events with an open
/// dead letter for it (an operator decides those: replaying or requeuing them later must not
/// apply them a second time). The rows queued are replays (`wh_perspective_events.replay`,
/// migration 0016): the perspective had these events before its reset, so one with side effects
/// does not repeat them; an event left alone keeps its row and its flag. Returns (rows queued, the last position examined) — `None` when
/// there was nothing more to examine.
pub async fn requeue_history_batch_in(
    conn: &mut sqlx::PgConnection,
    perspective: &str,
    after: i64,
    up_to: i64,
    limit: i64,
) -> Result<(u64, Option<i64>), StoreError> {
    let row: (i64, Option<i64>) = sqlx::query_as(
        "WITH batch AS ( \
             SELECT e.global_position, e.event_id, e.stream_id, e.stream_version \
             FROM wh_event_store e, wh_perspectives p \
             WHERE p.perspective_name = $1 \
               AND e.global_position > $2 AND e.global_position <= $3 \
               AND (e.event_type = ANY (p.event_types) OR '*' = ANY (p.event_types)) \
             ORDER BY e.global_position LIMIT $4), \
         ins AS ( \
             INSERT INTO wh_perspective_events \
                 (stream_id, event_id, global_position, stream_version, perspective_name, replay) \
             SELECT b.stream_id, b.event_id, b.global_position, b.stream_version, $1, true \
             FROM batch b \
             WHERE NOT EXISTS (SELECT 1 FROM wh_dead_letters d \
                               WHERE d.source_table = 'wh_perspective_events' \
                                 AND d.perspective_name = $1 AND d.event_id = b.event_id \
                                 AND d.status = 'exhausted') \
             ORDER BY b.global_position \
             ON CONFLICT (perspective_name, event_id) DO NOTHING \
             RETURNING 1), \
         notify AS (SELECT pg_notify('vantage_work', '') WHERE EXISTS (SELECT 1 FROM ins)) \
         SELECT (SELECT count(*) FROM ins), (SELECT max(global_position) FROM batch) \
         FROM (SELECT count(*) FROM notify) n",
    )
    .bind(perspective)
    .bind(after)
    .bind(up_to)
    .bind(limit)
    .fetch_one(conn)
    .await
    .map_err(map_db_error)?;
    Ok((row.0 as u64, row.1))
}

/// Appends events given as the JSON text of `append_events`' array
/// (`[{event_type, data, metadata?, event_id?}]`) inside the caller's transaction. The text goes
/// to PostgreSQL as written, so numbers reach jsonb exactly (no round trip through f64).
pub async fn append_events_json_in(
    conn: &mut sqlx::PgConnection,
    stream_id: Uuid,
    expected_version: Option<i32>,
    events_json: &str,
) -> Result<Vec<AppendedEvent>, StoreError> {
    sqlx::query_as(
        "SELECT global_position, event_id, stream_version FROM append_events($1, $2, $3::jsonb)",
    )
    .bind(stream_id)
    .bind(expected_version)
    .bind(events_json)
    .fetch_all(conn)
    .await
    .map_err(map_db_error)
}

/// Which of `event_ids` are already in the event store, with their global positions.
pub async fn stored_event_ids_in(
    conn: &mut sqlx::PgConnection,
    event_ids: &[Uuid],
) -> Result<Vec<(Uuid, i64)>, StoreError> {
    if event_ids.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query_as(
        "SELECT event_id, global_position FROM wh_event_store WHERE event_id = ANY ($1) \
         ORDER BY global_position",
    )
    .bind(event_ids)
    .fetch_all(conn)
    .await
    .map_err(map_db_error)
}
