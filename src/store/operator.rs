//! Small read-only queries the operator commands need beyond the daemon's API.

use chrono::{DateTime, Utc};

use super::{map_db_error, Store, StoreError};

impl Store {
    /// The database's clock, so ages shown to operators (heartbeats, dead letters) are measured
    /// on the clock that wrote the timestamps, not on the operator's machine.
    pub async fn database_now(&self) -> Result<DateTime<Utc>, StoreError> {
        sqlx::query_scalar("SELECT now()")
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)
    }

    /// How many stored events up to `up_to` a registered perspective subscribes to: the
    /// denominator of a rebuild's progress. 0 for an unregistered perspective.
    pub async fn history_event_count(
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
