//! Deserialization: a raw claimed row becomes a typed [`EventEnvelope`].
//!
//! Runs after the DLQ pre-filter, so rows that are going to be dead-lettered are never paid for.

use uuid::Uuid;

use crate::store::WorkRow;

/// One event, as a perspective sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct EventEnvelope {
    /// The work row (one per event and perspective); the cooldown key.
    pub event_work_id: Uuid,
    /// The perspective this delivery is for.
    pub perspective_name: String,
    /// The event's id.
    pub event_id: Uuid,
    /// Its stream.
    pub stream_id: Uuid,
    /// Its version within the stream.
    pub stream_version: i32,
    /// Its position in the whole store.
    pub global_position: i64,
    /// Its type.
    pub event_type: String,
    /// The payload.
    pub data: serde_json::Value,
    /// Metadata (an empty object when none).
    pub metadata: serde_json::Value,
    /// How many times the row has been claimed (this delivery included).
    pub attempts: i32,
    /// How many apply failures were recorded before this delivery.
    pub failures: i32,
}

/// Why a row could not become an envelope. Never transient: such a row is dead-lettered at once.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    /// The work row points at an event that no longer exists in the event store.
    #[error(
        "event {event_id} at global position {global_position} no longer exists in wh_event_store"
    )]
    EventVanished {
        /// The missing event.
        event_id: Uuid,
        /// Where it was.
        global_position: i64,
    },
}

impl EventEnvelope {
    /// Builds the typed envelope of a claimed row.
    pub fn from_row(row: WorkRow) -> Result<EventEnvelope, EnvelopeError> {
        let Some(event_type) = row.event_type else {
            return Err(EnvelopeError::EventVanished {
                event_id: row.event_id,
                global_position: row.global_position,
            });
        };
        Ok(EventEnvelope {
            event_work_id: row.event_work_id,
            perspective_name: row.perspective_name,
            event_id: row.event_id,
            stream_id: row.stream_id,
            stream_version: row.stream_version,
            global_position: row.global_position,
            event_type,
            data: row.event_data.unwrap_or(serde_json::Value::Null),
            metadata: row
                .metadata
                .unwrap_or_else(|| serde_json::Value::Object(Default::default())),
            attempts: row.attempts,
            failures: row.failures,
        })
    }
}
