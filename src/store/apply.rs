//! The batched apply of SQL perspectives: many events' statements in one round trip, inside the
//! batch's transaction (migration 0005, `apply_perspective_statements`).

use uuid::Uuid;

use super::{map_db_error, InstanceId, StoreError};

/// The statements of a run of events, in apply order, with their bound parameters (borrowed
/// from the events: a batch's payloads are not copied to be sent).
#[derive(Debug, Default)]
pub struct StatementBatch<'a> {
    statements: Vec<&'a str>,
    statement: Vec<i32>,
    data: Vec<&'a serde_json::Value>,
    stream_id: Vec<Uuid>,
    event_id: Vec<Uuid>,
    event_type: Vec<&'a str>,
    global_position: Vec<i64>,
    stream_version: Vec<i32>,
    metadata: Vec<&'a serde_json::Value>,
}

/// One event's parameters (SPEC §3.1: `$1` … `$7`).
#[derive(Debug, Clone, Copy)]
pub struct StatementParams<'a> {
    /// `$1`
    pub data: &'a serde_json::Value,
    /// `$2`
    pub stream_id: Uuid,
    /// `$3`
    pub event_id: Uuid,
    /// `$4`
    pub event_type: &'a str,
    /// `$5`
    pub global_position: i64,
    /// `$6`
    pub stream_version: i32,
    /// `$7`
    pub metadata: &'a serde_json::Value,
}

impl<'a> StatementBatch<'a> {
    /// Adds one event's statement (each distinct statement is sent once).
    pub fn push(&mut self, statement: &'a str, p: StatementParams<'a>) {
        let index = match self.statements.iter().position(|s| *s == statement) {
            Some(i) => i,
            None => {
                self.statements.push(statement);
                self.statements.len() - 1
            }
        };
        self.statement.push(index as i32 + 1);
        self.data.push(p.data);
        self.stream_id.push(p.stream_id);
        self.event_id.push(p.event_id);
        self.event_type.push(p.event_type);
        self.global_position.push(p.global_position);
        self.stream_version.push(p.stream_version);
        self.metadata.push(p.metadata);
    }

    /// Events in the batch.
    pub fn len(&self) -> usize {
        self.statement.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.statement.is_empty()
    }
}

/// Runs every statement of `batch`, in order, and then completes `complete` (rows leased to
/// `instance`; may be empty), in the caller's transaction, in one round trip
/// (`apply_and_complete_perspective_events`).
/// Returns how many of `complete` were still ours: fewer means a lease was lost and the
/// transaction must be rolled back. An error of any statement fails the call.
pub async fn apply_statements_and_complete_in(
    conn: &mut sqlx::PgConnection,
    batch: &StatementBatch<'_>,
    instance: InstanceId,
    complete: &[Uuid],
) -> Result<u64, StoreError> {
    let n: i32 = sqlx::query_scalar(
        "SELECT apply_and_complete_perspective_events($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
    )
    .bind(instance.0)
    .bind(complete)
    .bind(&batch.statements)
    .bind(&batch.statement)
    .bind(&batch.data)
    .bind(&batch.stream_id)
    .bind(&batch.event_id)
    .bind(&batch.event_type)
    .bind(&batch.global_position)
    .bind(&batch.stream_version)
    .bind(&batch.metadata)
    .fetch_one(conn)
    .await
    .map_err(map_db_error)?;
    Ok(n as u64)
}
