//! What a perspective is to the daemon: the [`Perspective`] trait, the [`EventEnvelope`] it
//! is given, the [`ApplyTx`] it writes through and the [`ApplyError`] it fails with. The other
//! files of `perspective` build on these; this one reads none of theirs.

use async_trait::async_trait;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::sqlstate::is_conflict;

/// One event, as a perspective sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct EventEnvelope {
    /// The work row (one per event and perspective); the cooldown key.
    pub event_work_id: Uuid,
    /// The perspective this delivery is for.
    pub perspective_name: String,
    /// The event's id.
    pub event_id: Uuid,
    /// The stream (aggregate) the event belongs to: a perspective gets the events of one
    /// stream one at a time, in `stream_version` order.
    pub stream_id: Uuid,
    /// Its version within the stream.
    pub stream_version: i32,
    /// Its position in the whole store.
    pub global_position: i64,
    /// The type it was appended with ([`NewEvent::event_type`](crate::store::NewEvent), e.g.
    /// `OrderPlaced`); match on it to tell the events a perspective subscribes to apart.
    pub event_type: String,
    /// The payload as appended, undecoded; [`decode_event`](super::decode_event) deserializes
    /// it as a [`TypedPerspective`](super::TypedPerspective) would.
    pub data: serde_json::Value,
    /// Metadata (an empty object when none).
    pub metadata: serde_json::Value,
    /// How many times the row has been claimed (this delivery included).
    pub attempts: i32,
    /// How many apply failures were recorded before this delivery.
    pub failures: i32,
    /// Whether this delivery replays history the perspective already had: true for every event
    /// `vantage perspectives rebuild` queues again after its reset (and for the rows a version's
    /// backfill diverts to the drain; versioned perspectives are SQL only, so no Rust
    /// perspective sees those). False for a live event (the producer's append), for an event
    /// still queued when the rebuild began (it was never delivered), and for a dead letter's
    /// requeue or replay (its apply never committed: the operator retrying it wants its
    /// effects). The flag belongs to the work row, so it holds across retries and takeovers.
    ///
    /// A perspective with side effects outside the database (an email, a webhook, a message)
    /// rebuilds its read model as usual when `replay` is true but skips those effects: they
    /// happened when the event was first applied. See `examples/rust_perspective.rs`.
    pub replay: bool,
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
/// with serde, implement [`TypedPerspective`](super::TypedPerspective) instead and run it as
/// [`Typed`](super::Typed).
///
/// `apply` runs inside the transaction that also completes the event's work row, so effects
/// written through `tx` are exactly-once. Events of one stream arrive in `stream_version` order.
/// During a rebuild's catch-up, [`EventEnvelope::replay`] is true: effects outside the database
/// belong in the `!event.replay` case.
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

    /// Whether `apply` may read the event's payload ([`EventEnvelope::data`]); true by
    /// default. A SQL perspective none of whose statements mentions `$1` says false: when no
    /// perspective of the daemon reads it, claims do not fetch payloads at all (the envelope's
    /// `data` is then `null`), which spares the database sending them and the daemon decoding
    /// them.
    fn reads_data(&self) -> bool {
        true
    }
}

/// The database side of one apply: the transaction that also completes the event's work row,
/// when there is one.
///
/// The daemon on PostgreSQL always has one ([`ApplyTx::postgres`]); a host without a database
/// (an in-memory mode, a unit test of a perspective's handler) has none ([`ApplyTx::none`]),
/// and [`connection`](ApplyTx::connection) then fails with a clear permanent error instead of
/// writing somewhere else.
///
/// ```
/// use vantage::perspective::{ApplyError, ApplyTx};
///
/// let mut tx = ApplyTx::none();
/// assert!(!tx.has_database());
/// assert!(matches!(tx.connection(), Err(ApplyError::Permanent(_))));
/// ```
#[derive(Debug)]
pub struct ApplyTx<'a> {
    conn: Option<&'a mut PgConnection>,
}

/// The text of the error [`ApplyTx::connection`] returns when there is no transaction.
pub const NO_TRANSACTION: &str = "this perspective needs the database transaction, \
     and this apply has none (no PostgreSQL: in-memory mode or a unit test)";

impl<'a> ApplyTx<'a> {
    /// The transaction on PostgreSQL that also completes the event's work row.
    pub fn postgres(conn: &'a mut PgConnection) -> ApplyTx<'a> {
        ApplyTx { conn: Some(conn) }
    }

    /// No database: a perspective that asks for the connection fails permanently.
    pub fn none() -> ApplyTx<'static> {
        ApplyTx { conn: None }
    }

    /// Whether there is a database transaction.
    pub fn has_database(&self) -> bool {
        self.conn.is_some()
    }

    /// The transaction, to run statements on (`.execute(tx.connection()?)`); their effects
    /// commit together with the completion of the work row. Without a database:
    /// [`ApplyError::Permanent`] with the text [`NO_TRANSACTION`].
    pub fn connection(&mut self) -> Result<&mut PgConnection, ApplyError> {
        self.conn
            .as_deref_mut()
            .ok_or_else(|| ApplyError::Permanent(NO_TRANSACTION.to_string()))
    }
}
