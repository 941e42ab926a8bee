//! Dead letters: the move out of the work table, and the operator transitions, each a
//! compare-and-set on `status = 'exhausted'` done in SQL.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{map_db_error, InstanceId, Store, StoreError};

/// The only source table vantage dead-letters from.
pub const SOURCE_TABLE: &str = "wh_perspective_events";
/// Failure reason of a row claimed more than `max_perspective_event_attempts` times.
pub const FAILURE_MAX_ATTEMPTS: &str = "MaxAttemptsExceeded";
/// Failure reason of a row whose handler declared the failure permanent.
pub const FAILURE_PERMANENT: &str = "PermanentFailure";

/// The outcome of `move_to_dead_letters`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveOutcome {
    /// Moved; the dead letter's id.
    Moved(Uuid),
    /// The row was already gone (completed or moved by someone else): nothing to do.
    AlreadyGone,
}

/// Status of a dead letter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeadLetterStatus {
    /// Open: waiting for an operator.
    Exhausted,
    /// Replayed successfully.
    Resolved,
    /// Cleared by an operator; terminal.
    Purged,
    /// Handed back to the daemon.
    Requeued,
}

impl DeadLetterStatus {
    /// The value stored in `wh_dead_letters.status`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterStatus::Exhausted => "exhausted",
            DeadLetterStatus::Resolved => "resolved",
            DeadLetterStatus::Purged => "purged",
            DeadLetterStatus::Requeued => "requeued",
        }
    }
}

impl fmt::Display for DeadLetterStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DeadLetterStatus {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "exhausted" => Ok(DeadLetterStatus::Exhausted),
            "resolved" => Ok(DeadLetterStatus::Resolved),
            "purged" => Ok(DeadLetterStatus::Purged),
            "requeued" => Ok(DeadLetterStatus::Requeued),
            other => Err(format!("unknown dead letter status '{other}'")),
        }
    }
}

/// A dead letter as stored.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct DeadLetter {
    /// Its id.
    pub dead_letter_id: Uuid,
    /// The table the work row came from.
    pub source_table: String,
    /// The work row's id.
    pub source_id: Uuid,
    /// The event's stream.
    pub stream_id: Uuid,
    /// The event's id.
    pub event_id: Uuid,
    /// The event's global position (how operators address it).
    pub global_position: i64,
    /// The event's version in its stream.
    pub stream_version: i32,
    /// The event's type at the time of the move (`None` if it had vanished).
    pub event_type: Option<String>,
    /// The perspective that could not apply it.
    pub perspective_name: String,
    /// Why: `MaxAttemptsExceeded` or `PermanentFailure`.
    pub failure_reason: String,
    /// The error text, including the row's last apply error.
    pub error_text: Option<String>,
    /// Claims when dead-lettered.
    pub attempts_when_dlq: i32,
    /// Recorded failures when dead-lettered.
    pub failures_when_dlq: i32,
    /// When.
    pub dead_lettered_at: DateTime<Utc>,
    /// By which instance.
    pub dead_lettered_by: Option<Uuid>,
    /// `exhausted`, `resolved`, `purged` or `requeued`.
    pub status: String,
    /// When the status last changed.
    pub status_changed_at: DateTime<Utc>,
}

/// One transition in a dead letter's history.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct HistoryEntry {
    /// Monotonic id.
    pub history_id: i64,
    /// `Exhausted`, `ReplaySucceeded`, `ReplayFailed`, `Purged` or `Requeued`.
    pub kind: String,
    /// When.
    pub at: DateTime<Utc>,
    /// Who (an instance or an operator).
    pub actor: String,
    /// Detail, e.g. the error of a failed replay.
    pub detail: Option<String>,
}

const DEAD_LETTER_COLUMNS: &str = "dead_letter_id, source_table, source_id, stream_id, event_id, \
    global_position, stream_version, event_type, perspective_name, failure_reason, error_text, \
    attempts_when_dlq, failures_when_dlq, dead_lettered_at, dead_lettered_by, status, \
    status_changed_at";

impl Store {
    /// Moves a work row to the dead letters (atomic, idempotent).
    pub async fn move_to_dead_letters(
        &self,
        work_id: Uuid,
        reason: &str,
        error_text: &str,
        instance: Option<InstanceId>,
    ) -> Result<MoveOutcome, StoreError> {
        move_to_dead_letters_in(&self.pool, work_id, reason, error_text, instance).await
    }

    /// Open (`exhausted`) dead letters, optionally of one perspective, by perspective and position.
    pub async fn open_dead_letters(
        &self,
        perspective: Option<&str>,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        sqlx::query_as(&format!(
            "SELECT {DEAD_LETTER_COLUMNS} FROM wh_dead_letters \
             WHERE status = 'exhausted' AND ($1::text IS NULL OR perspective_name = $1) \
             ORDER BY perspective_name, global_position"
        ))
        .bind(perspective)
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Open dead letters at a global position (one per perspective that gave up on it).
    pub async fn open_dead_letters_at(
        &self,
        global_position: i64,
        perspective: Option<&str>,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        sqlx::query_as(&format!(
            "SELECT {DEAD_LETTER_COLUMNS} FROM wh_dead_letters \
             WHERE global_position = $1 AND status = 'exhausted' \
               AND ($2::text IS NULL OR perspective_name = $2) \
             ORDER BY perspective_name"
        ))
        .bind(global_position)
        .bind(perspective)
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// A dead letter by id, whatever its status.
    pub async fn dead_letter(&self, id: Uuid) -> Result<Option<DeadLetter>, StoreError> {
        sqlx::query_as(&format!(
            "SELECT {DEAD_LETTER_COLUMNS} FROM wh_dead_letters WHERE dead_letter_id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// The history of a dead letter, oldest first.
    pub async fn dead_letter_history(&self, id: Uuid) -> Result<Vec<HistoryEntry>, StoreError> {
        sqlx::query_as(
            "SELECT history_id, kind, at, actor, detail FROM wh_dead_letter_history \
             WHERE dead_letter_id = $1 ORDER BY at, history_id",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Requeues a dead letter (compare-and-set); false if it was no longer exhausted.
    pub async fn requeue_dead_letter(&self, id: Uuid, actor: &str) -> Result<bool, StoreError> {
        sqlx::query_scalar("SELECT requeue_dead_letter($1, $2)")
            .bind(id)
            .bind(actor)
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)
    }

    /// Purges a dead letter (compare-and-set, terminal); false if it was no longer exhausted.
    pub async fn purge_dead_letter(&self, id: Uuid, actor: &str) -> Result<bool, StoreError> {
        sqlx::query_scalar("SELECT purge_dead_letter($1, $2)")
            .bind(id)
            .bind(actor)
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)
    }

    /// Records a failed replay (the letter stays exhausted); false if it was no longer exhausted.
    pub async fn record_replay_failure(
        &self,
        id: Uuid,
        actor: &str,
        error: &str,
    ) -> Result<bool, StoreError> {
        sqlx::query_scalar("SELECT record_dead_letter_replay_failure($1, $2, $3)")
            .bind(id)
            .bind(actor)
            .bind(error)
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)
    }
}

/// Marks a dead letter resolved inside the caller's transaction, so a replay's writes and the
/// resolution commit together; false (roll back!) if another command changed it first.
pub async fn resolve_dead_letter_in(
    conn: &mut sqlx::PgConnection,
    id: Uuid,
    actor: &str,
) -> Result<bool, StoreError> {
    sqlx::query_scalar("SELECT resolve_dead_letter($1, $2)")
        .bind(id)
        .bind(actor)
        .fetch_one(conn)
        .await
        .map_err(map_db_error)
}

/// Moves a work row to the dead letters on any executor (e.g. the batch's transaction).
pub async fn move_to_dead_letters_in<'c, E: sqlx::PgExecutor<'c>>(
    executor: E,
    work_id: Uuid,
    reason: &str,
    error_text: &str,
    instance: Option<InstanceId>,
) -> Result<MoveOutcome, StoreError> {
    let id: Option<Uuid> =
        sqlx::query_scalar("SELECT move_to_dead_letters($1, $2, $3, $4, $5, $6)")
            .bind(Uuid::new_v4())
            .bind(SOURCE_TABLE)
            .bind(work_id)
            .bind(reason)
            .bind(error_text)
            .bind(instance.map(|i| i.0))
            .fetch_one(executor)
            .await
            .map_err(map_db_error)?;
    Ok(id.map_or(MoveOutcome::AlreadyGone, MoveOutcome::Moved))
}
