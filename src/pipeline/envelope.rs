//! Deserialization: a raw claimed row becomes the typed [`EventEnvelope`] a perspective
//! receives (the type belongs to [`crate::perspective`]; this stage only builds it).
//!
//! Runs after the DLQ pre-filter, so rows that are going to be dead-lettered are never paid for.

use uuid::Uuid;

pub use crate::perspective::EventEnvelope;
use crate::store::WorkRow;

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
