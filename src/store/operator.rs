//! Small read-only queries the operator commands need beyond the daemon's API.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnection;

use super::error::{map_db_error, StoreError};
use super::handle::Store;

impl Store {
    /// The database's clock, so ages shown to operators (heartbeats, dead letters) are measured
    /// on the clock that wrote the timestamps, not on the operator's machine.
    pub(crate) async fn database_now(&self) -> Result<DateTime<Utc>, StoreError> {
        sqlx::query_scalar("SELECT now()")
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)
    }

    /// How many stored events up to `up_to` a registered perspective subscribes to: the
    /// denominator of a rebuild's progress. 0 for an unregistered perspective.
    pub(crate) async fn history_event_count(
        &self,
        perspective: &str,
        up_to: i64,
    ) -> Result<i64, StoreError> {
        sqlx::query_scalar(
            "SELECT count(*) FROM wh_event_store e, wh_perspectives p \
             WHERE p.perspective_name = $1 AND e.global_position <= $2 \
               AND (e.event_type = ANY (p.event_types) OR '*' = ANY (p.event_types))",
        )
        .bind(perspective)
        .bind(up_to)
        .fetch_one(&self.pool)
        .await
        .map_err(map_db_error)
    }
}

/// Rebuilding a perspective on a running daemon (`vantage perspectives rebuild`).
///
/// The rebuild holds a session-level advisory lock on `wh_perspective_lock_key(name)` on one
/// dedicated connection for its whole run (these functions take that connection): claims skip
/// the perspective while it is held, and dead-letter moves, requeues and replays of it refuse
/// with SQLSTATE 55P03. Nothing is persisted: if the process dies, the server ends its session
/// and the lock is gone with it.
impl Store {
    /// Takes the perspective's rebuild lock if nobody holds it (not even shared: a claim, a
    /// move, a requeue or a replay in progress). False when it is busy.
    pub(crate) async fn try_lock_for_rebuild(
        conn: &mut PgConnection,
        perspective: &str,
    ) -> Result<bool, StoreError> {
        sqlx::query_scalar("SELECT pg_try_advisory_lock(wh_perspective_lock_key($1))")
            .bind(perspective)
            .fetch_one(conn)
            .await
            .map_err(map_db_error)
    }

    /// Waits up to `timeout` for the perspective's rebuild lock. While it waits, new claims,
    /// moves, requeues and replays of the perspective already skip or refuse (a queued
    /// exclusive request blocks new shared ones), so only those in progress are waited for.
    /// False when the wait timed out.
    pub(crate) async fn lock_for_rebuild(
        conn: &mut PgConnection,
        perspective: &str,
        timeout: Duration,
    ) -> Result<bool, StoreError> {
        use sqlx::Connection;
        // A session-level lock outlives the transaction that bounds the wait.
        let mut tx = conn.begin().await?;
        set_local_lock_timeout(&mut tx, timeout).await?;
        let locked = sqlx::query("SELECT pg_advisory_lock(wh_perspective_lock_key($1))")
            .bind(perspective)
            .execute(&mut *tx)
            .await;
        match locked {
            Ok(_) => {
                tx.commit().await?;
                Ok(true)
            }
            Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03") => {
                tx.rollback().await?;
                Ok(false)
            }
            Err(e) => Err(map_db_error(e)),
        }
    }

    /// Releases the rebuild lock; false if this session did not hold it.
    pub(crate) async fn unlock_after_rebuild(
        conn: &mut PgConnection,
        perspective: &str,
    ) -> Result<bool, StoreError> {
        sqlx::query_scalar("SELECT pg_advisory_unlock(wh_perspective_lock_key($1))")
            .bind(perspective)
            .fetch_one(conn)
            .await
            .map_err(map_db_error)
    }

    /// Whether some session (a `vantage perspectives rebuild`) holds the perspective's rebuild
    /// lock right now. For messages: the locks themselves are what keep commands safe.
    pub(crate) async fn perspective_is_rebuilding(
        &self,
        perspective: &str,
    ) -> Result<bool, StoreError> {
        sqlx::query_scalar("SELECT wh_perspective_is_rebuilding($1)")
            .bind(perspective)
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)
    }

    /// Rows of the perspective validly leased to a live instance: applies that may be in flight.
    pub(crate) async fn live_leases_in(
        conn: &mut PgConnection,
        perspective: &str,
    ) -> Result<i64, StoreError> {
        sqlx::query_scalar(
            "SELECT count(*) FROM wh_perspective_events pe \
             WHERE pe.perspective_name = $1 AND pe.instance_id IS NOT NULL \
               AND pe.lease_expiry > now() \
               AND EXISTS (SELECT 1 FROM wh_service_instances si \
                           WHERE si.instance_id = pe.instance_id)",
        )
        .bind(perspective)
        .fetch_one(conn)
        .await
        .map_err(map_db_error)
    }

    /// Inside the rebuild's transaction: clears every lease of the perspective (no refund, as
    /// with any takeover). Fences stragglers: a holder whose apply is still running completes,
    /// fails or renews nothing any more, so its transaction rolls back instead of committing
    /// effects the reset would not see. Returns how many rows were leased.
    pub(crate) async fn take_back_leases_in(
        conn: &mut PgConnection,
        perspective: &str,
    ) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "UPDATE wh_perspective_events SET instance_id = NULL, lease_expiry = NULL \
             WHERE perspective_name = $1 AND instance_id IS NOT NULL",
        )
        .bind(perspective)
        .execute(conn)
        .await
        .map_err(map_db_error)?;
        Ok(done.rows_affected())
    }

    /// Marks the perspective as being rebuilt up to `up_to` (claims skip it until
    /// [`clear_rebuild_in`](Self::clear_rebuild_in)); returns the position an earlier, interrupted
    /// rebuild had marked, if any.
    pub(crate) async fn mark_rebuild_in(
        conn: &mut PgConnection,
        perspective: &str,
        up_to: i64,
    ) -> Result<Option<i64>, StoreError> {
        let before: Option<Option<i64>> = sqlx::query_scalar(
            "WITH old AS (SELECT rebuild_up_to FROM wh_perspectives                           WHERE perspective_name = $1 FOR UPDATE)              UPDATE wh_perspectives p SET rebuild_up_to = $2, rebuild_started_at = now()              FROM old WHERE p.perspective_name = $1 RETURNING old.rebuild_up_to",
        )
        .bind(perspective)
        .bind(up_to)
        .fetch_optional(conn)
        .await
        .map_err(map_db_error)?;
        Ok(before.flatten())
    }

    /// Ends a rebuild: its history is queued, claims may take the perspective again.
    pub(crate) async fn clear_rebuild_in(
        conn: &mut PgConnection,
        perspective: &str,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE wh_perspectives SET rebuild_up_to = NULL, rebuild_started_at = NULL              WHERE perspective_name = $1",
        )
        .bind(perspective)
        .execute(conn)
        .await
        .map_err(map_db_error)?;
        Ok(())
    }

    /// The highest global position in the store (0 when empty), on the caller's connection.
    pub(crate) async fn max_global_position_in(conn: &mut PgConnection) -> Result<i64, StoreError> {
        sqlx::query_scalar("SELECT coalesce(max(global_position), 0) FROM wh_event_store")
            .fetch_one(conn)
            .await
            .map_err(map_db_error)
    }

    /// Bounds every lock wait of the caller's transaction.
    pub(crate) async fn set_local_lock_timeout_in(
        conn: &mut PgConnection,
        timeout: Duration,
    ) -> Result<(), StoreError> {
        set_local_lock_timeout(conn, timeout).await
    }

    /// Wakes the daemons (`vantage_work`), e.g. once a rebuild has released its lock.
    pub(crate) async fn notify_work(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(super::WORK_CHANNEL)
            .execute(&self.pool)
            .await
            .map_err(map_db_error)?;
        Ok(())
    }
}

async fn set_local_lock_timeout(
    conn: &mut PgConnection,
    timeout: Duration,
) -> Result<(), StoreError> {
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128).to_string();
    sqlx::query("SELECT set_config('lock_timeout', $1, true)")
        .bind(ms)
        .execute(conn)
        .await
        .map_err(map_db_error)?;
    Ok(())
}
