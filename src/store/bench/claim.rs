//! The daemon's claim, timed and explained inside transactions that are rolled back, and a
//! snapshot held open to keep dead tuples from being pruned.

use std::time::Duration;

use uuid::Uuid;

use super::limit::LIMIT_LEASE;
use super::BenchStore;
use crate::store::StoreError;

impl BenchStore {
    /// One claim as the daemon's claim stage issues it (`get_stream_events`), for an
    /// instance registered inside a transaction that is rolled back, so the backlog is unchanged.
    /// Returns (rows claimed, elapsed).
    pub async fn timed_claim(
        &self,
        perspectives: &[String],
        max_streams: i32,
        batch_size: i32,
    ) -> Result<(usize, Duration), StoreError> {
        let mut tx = self.pool().begin().await?;
        let holder = register_in(&mut tx).await?;
        let started = std::time::Instant::now();
        let rows: i64 = sqlx::query_scalar(
            "/* vantage-bench */ SELECT count(*) FROM get_stream_events($1, NULL, 60, $4, $3, $2)",
        )
        .bind(holder)
        .bind(max_streams)
        .bind(batch_size)
        .bind(perspectives)
        .fetch_one(&mut *tx)
        .await?;
        let elapsed = started.elapsed();
        tx.rollback().await?;
        Ok((rows as usize, elapsed))
    }

    /// `EXPLAIN (ANALYZE, BUFFERS)` of one `get_stream_events` call (rolled back): the
    /// function scan's buffers include every statement inside it.
    pub async fn explain_claim(
        &self,
        perspectives: &[String],
        max_streams: i32,
        batch_size: i32,
    ) -> Result<String, StoreError> {
        let mut tx = self.pool().begin().await?;
        let holder = register_in(&mut tx).await?;
        let lines: Vec<String> = sqlx::query_scalar(
            "/* vantage-bench */ EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) SELECT * \
             FROM get_stream_events($1, NULL, 60, $4, $3, $2)",
        )
        .bind(holder)
        .bind(max_streams)
        .bind(batch_size)
        .bind(perspectives)
        .fetch_all(&mut *tx)
        .await?;
        tx.rollback().await?;
        Ok(lines.join("\n"))
    }

    /// `EXPLAIN (ANALYZE, BUFFERS)` of the limit's lease statement (rolled back).
    pub async fn explain_limit_lease(
        &self,
        perspectives: &[String],
        batch_size: i32,
    ) -> Result<String, StoreError> {
        let statement = format!("/* vantage-bench */ EXPLAIN (ANALYZE, BUFFERS) {LIMIT_LEASE}");
        let mut tx = self.pool().begin().await?;
        let lines: Vec<String> = sqlx::query_scalar(&statement)
            .bind(Uuid::new_v4())
            .bind(perspectives)
            .bind(batch_size)
            .fetch_all(&mut *tx)
            .await?;
        tx.rollback().await?;
        Ok(lines.join("\n"))
    }

    /// Opens a session that holds a snapshot (REPEATABLE READ, one read done) until the
    /// returned transaction is dropped: dead tuples newer than it cannot be pruned.
    pub async fn hold_snapshot(
        &self,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, StoreError> {
        let mut tx = self.pool().begin().await?;
        sqlx::query("/* vantage-bench */ SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *tx)
            .await?;
        sqlx::query("/* vantage-bench */ SELECT count(*) FROM wh_perspectives")
            .execute(&mut *tx)
            .await?;
        Ok(tx)
    }
}

/// Registers a throwaway instance inside `tx` (claims lease only for registered instances).
async fn register_in(tx: &mut sqlx::PgConnection) -> Result<Uuid, StoreError> {
    let holder = Uuid::new_v4();
    sqlx::query(
        "/* vantage-bench */ INSERT INTO wh_service_instances \
         (instance_id, service_name, host_name, process_id, version) \
         VALUES ($1, 'vantage-bench', 'bench', 0, 'bench')",
    )
    .bind(holder)
    .execute(&mut *tx)
    .await?;
    Ok(holder)
}
