//! Deserialization: a raw claimed row becomes the typed [`EventEnvelope`] a perspective
//! receives (the type belongs to [`crate::perspective`]; this stage only builds it).
//!
//! Runs after the DLQ pre-filter, so rows that are going to be dead-lettered are never paid for.

use uuid::Uuid;

use super::lease::LeasedBatch;
pub use crate::perspective::EventEnvelope;
use crate::store::{MoveOutcome, StoreError, WorkRow, WorkStore, FAILURE_PERMANENT};

/// The envelope stage: the typed envelopes of `rows`, in order. A row that cannot become one
/// is dead-lettered at once through the lease handle (it never will); returns the envelopes and
/// how many rows were moved. A failed move fails the stage (the caller gives the batch back).
pub async fn open<S: WorkStore>(
    lease: &mut LeasedBatch<S>,
    rows: Vec<WorkRow>,
) -> Result<(Vec<EventEnvelope>, usize), StoreError> {
    let mut envelopes = Vec::with_capacity(rows.len());
    let mut moved = 0;
    for row in rows {
        let work_id = row.event_work_id;
        match from_row(row) {
            Ok(envelope) => envelopes.push(envelope),
            Err(error) => {
                let outcome = lease
                    .dead_letter_now(work_id, FAILURE_PERMANENT, &error.to_string())
                    .await?;
                if let MoveOutcome::Moved(_) = outcome {
                    moved += 1;
                }
            }
        }
    }
    Ok((envelopes, moved))
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
        replay: row.replay,
    })
}
