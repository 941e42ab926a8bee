//! Perspectives: the [`Perspective`] trait, typed Rust perspectives, SQL perspectives from
//! configuration, the registry.
//!
//! A Rust perspective implements either
//! - [`TypedPerspective`]: its payloads arrive deserialized (serde) as its own `Event` type in
//!   a [`TypedEnvelope`]; a payload that does not deserialize is dead-lettered at once
//!   (`PermanentFailure`) with serde's error as its text. Run it as [`Typed`]`(perspective)`.
//!   This is the one to start with;
//! - or [`Perspective`]: payloads as raw JSON in an [`EventEnvelope`].
//!
//! Either way the handler gets the database side of the apply as an [`ApplyTx`]: the
//! PostgreSQL transaction that also completes the event's work row, or, on the in-memory store
//! ([`MemoryStore`](crate::store::MemoryStore), the [`testkit`](crate::testkit)), none.
//!
//! Both are added to a daemon with
//! [`DaemonBuilder::perspective`](crate::daemon::DaemonBuilder::perspective); the README's
//! "Build your own daemon binary" and `examples/inventory.rs` walk through one.

mod registry;
mod sql;
mod typed;

pub use registry::{prepare_sql_perspectives, PerspectiveRegistry, RegistryError};
pub use sql::{SqlPerspective, SqlPerspectiveError};
pub use typed::{
    decode_event, ApplyTx, PayloadError, Typed, TypedEnvelope, TypedPerspective, NO_TRANSACTION,
};

pub use crate::sqlstate::is_conflict;

use async_trait::async_trait;
use uuid::Uuid;

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

/// What a handler's failure means for the event.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// Try again later (with backoff); after `max_perspective_event_attempts` claims the event
    /// is dead-lettered with reason `MaxAttemptsExceeded`.
    #[error("{0}")]
    Retryable(String),
    /// Will never succeed (e.g. a payload that can never be deserialized): dead-lettered at once
    /// with reason `PermanentFailure`.
    #[error("{0}")]
    Permanent(String),
    /// The database connection failed: not the event's fault. The batch is given back with a
    /// refund and nobody is charged.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// The transaction lost a lock conflict (deadlock, serialization failure, lock not
    /// available): not the event's fault either. The batch is retried; nobody is charged.
    #[error("transaction conflict: {0}")]
    Conflict(String),
}

impl ApplyError {
    /// Classifies a database error raised by a handler's statement.
    pub fn from_sqlx(e: sqlx::Error) -> ApplyError {
        if crate::sqlstate::is_connection_error(&e) {
            ApplyError::Unavailable(e.to_string())
        } else if is_conflict(&e) {
            ApplyError::Conflict(e.to_string())
        } else {
            match e {
                sqlx::Error::Database(db) => ApplyError::Retryable(match db.code() {
                    Some(code) => format!("{} (SQLSTATE {code})", db.message()),
                    None => db.message().to_string(),
                }),
                other => ApplyError::Retryable(other.to_string()),
            }
        }
    }

    /// The error text kept on the work row and carried into a dead letter.
    pub fn message(&self) -> &str {
        match self {
            ApplyError::Retryable(m)
            | ApplyError::Permanent(m)
            | ApplyError::Unavailable(m)
            | ApplyError::Conflict(m) => m,
        }
    }
}

/// A read model kept current by vantage, with payloads as raw JSON. For payloads deserialized
/// with serde, implement [`TypedPerspective`] instead and run it as [`Typed`].
///
/// `apply` runs inside the transaction that also completes the event's work row, so effects
/// written through `tx` are exactly-once. Events of one stream arrive in `stream_version` order.
/// On the in-memory store there is no transaction ([`ApplyTx::has_database`] is false, and
/// [`ApplyTx::connection`] fails permanently).
#[async_trait]
pub trait Perspective: Send + Sync + 'static {
    /// Unique name (`wh_perspectives.perspective_name`).
    fn name(&self) -> &str;

    /// Event types this perspective subscribes to (`"*"` = every type).
    fn event_types(&self) -> Vec<String>;

    /// Applies one event.
    async fn apply(&self, event: &EventEnvelope, tx: &mut ApplyTx<'_>) -> Result<(), ApplyError>;

    /// Clears the read model before a rebuild (`vantage perspectives rebuild`). Default: nothing.
    async fn reset(&self, _tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        Ok(())
    }

    /// The SQL statement `apply` would run for this event type, when applying the perspective
    /// is exactly "run this statement with the seven bound parameters" (SQL perspectives). The
    /// daemon then runs many events' statements in one round trip. Default: none (Rust
    /// perspectives are applied one event at a time through [`Perspective::apply`]).
    fn batch_statement(&self, _event_type: &str) -> Option<&str> {
        None
    }

    /// Whether every effect of `apply` goes through `tx` (true by default). A perspective with
    /// effects outside the database (calls, messages) returns false: the cooldown cache then
    /// keeps its mark even if the completion's transaction fails, so a re-claimed row is not
    /// applied twice.
    fn effects_in_transaction(&self) -> bool {
        true
    }
}
