//! Dead letters: the move out of the work table, and the operator transitions, each a
//! compare-and-set on `status = 'exhausted'` done in SQL.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::error::{map_db_error, StoreError};
use super::handle::Store;

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
    /// Its error fingerprint (`wh_error_fingerprint`: perspective, event type, SQLSTATE, masked
    /// error text), the key of `vantage dlq groups`.
    pub error_fingerprint: Option<String>,
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
    status_changed_at, error_fingerprint";

impl Store {
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
    pub(crate) async fn open_dead_letters_at(
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
    pub(crate) async fn dead_letter(&self, id: Uuid) -> Result<Option<DeadLetter>, StoreError> {
        sqlx::query_as(&format!(
            "SELECT {DEAD_LETTER_COLUMNS} FROM wh_dead_letters WHERE dead_letter_id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// The history of a dead letter, oldest first.
    pub(crate) async fn dead_letter_history(
        &self,
        id: Uuid,
    ) -> Result<Vec<HistoryEntry>, StoreError> {
        sqlx::query_as(
            "SELECT history_id, kind, at, actor, detail FROM wh_dead_letter_history \
             WHERE dead_letter_id = $1 ORDER BY at, history_id",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Whether a work row exists for (`perspective`, `event_id`): the event is queued for the
    /// daemon, so replaying or requeuing its dead letter would apply it twice.
    pub(crate) async fn is_queued(
        &self,
        perspective: &str,
        event_id: Uuid,
    ) -> Result<bool, StoreError> {
        let mut conn = self.pool.acquire().await?;
        Self::is_queued_in(&mut conn, perspective, event_id).await
    }

    /// [`is_queued`](Self::is_queued) on the caller's connection (e.g. a replay's transaction).
    pub(crate) async fn is_queued_in(
        conn: &mut sqlx::PgConnection,
        perspective: &str,
        event_id: Uuid,
    ) -> Result<bool, StoreError> {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM wh_perspective_events \
                            WHERE perspective_name = $1 AND event_id = $2)",
        )
        .bind(perspective)
        .bind(event_id)
        .fetch_one(conn)
        .await
        .map_err(map_db_error)
    }

    /// Takes the perspective's rebuild lock shared for the rest of the caller's transaction, so
    /// no rebuild can reset and re-queue the perspective until it ends. False (nothing taken)
    /// while a rebuild holds it.
    pub(crate) async fn try_lock_perspective_shared_in(
        conn: &mut sqlx::PgConnection,
        perspective: &str,
    ) -> Result<bool, StoreError> {
        sqlx::query_scalar("SELECT pg_try_advisory_xact_lock_shared(wh_perspective_lock_key($1))")
            .bind(perspective)
            .fetch_one(conn)
            .await
            .map_err(map_db_error)
    }

    /// Requeues a dead letter (compare-and-set); false if it was no longer exhausted. An error
    /// for which [`StoreError::is_already_queued`] holds when a work row for its event exists
    /// (nothing is changed: no work row, no `Requeued` history), and one for which
    /// [`StoreError::is_rebuild_in_progress`] holds while its perspective is being rebuilt.
    pub(crate) async fn requeue_dead_letter(
        &self,
        id: Uuid,
        actor: &str,
    ) -> Result<bool, StoreError> {
        sqlx::query_scalar("SELECT requeue_dead_letter($1, $2)")
            .bind(id)
            .bind(actor)
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)
    }

    /// Purges a dead letter (compare-and-set, terminal); false if it was no longer exhausted.
    pub(crate) async fn purge_dead_letter(
        &self,
        id: Uuid,
        actor: &str,
    ) -> Result<bool, StoreError> {
        sqlx::query_scalar("SELECT purge_dead_letter($1, $2)")
            .bind(id)
            .bind(actor)
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)
    }

    /// Records a failed replay (the letter stays exhausted); false if it was no longer exhausted.
    pub(crate) async fn record_replay_failure(
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

impl StoreError {
    /// The statement refused because its perspective is being rebuilt (SQLSTATE 55P03 raised by
    /// `wh_lock_perspective_shared`): transient, nothing was changed, try again after the rebuild.
    pub fn is_rebuild_in_progress(&self) -> bool {
        self.database_error()
            .is_some_and(|(code, message)| code == "55P03" && message.contains("is being rebuilt"))
    }

    /// `requeue_dead_letter` refused because the event is already queued (SQLSTATE 23505).
    pub fn is_already_queued(&self) -> bool {
        self.database_error()
            .is_some_and(|(code, message)| code == "23505" && message.contains("already queued"))
    }

    fn database_error(&self) -> Option<(String, &str)> {
        match self {
            StoreError::Database(sqlx::Error::Database(db)) => {
                Some((db.code()?.into_owned(), db.message()))
            }
            _ => None,
        }
    }
}

/// Marks a dead letter resolved inside the caller's transaction, so a replay's writes and the
/// resolution commit together; false (roll back!) if another command changed it first. Raises
/// ([`StoreError::is_rebuild_in_progress`]) while the perspective is being rebuilt, and otherwise
/// holds the rebuild lock shared until the transaction ends.
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
