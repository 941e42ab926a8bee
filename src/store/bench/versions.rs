//! The statements of the `versions` check: a versioned perspective's leftovers from an earlier
//! run (its schemas live outside the bench schema), what a backfill's transactions look like
//! from `pg_stat_activity`, and the live version's append → applied latency.

use sqlx::Row;

use super::readings::LatencyMs;
use super::BenchStore;
use crate::store::error::{map_db_error, StoreError};

/// The versioned perspective of the check, and its schemas.
pub const VERSIONED: &str = "bench_versioned";
/// Where readers of it look.
pub const VERSIONED_READ_SCHEMA: &str = "vantage_bench_rm";

impl BenchStore {
    /// Drops what an earlier run left of the versioned perspective outside the bench schema
    /// (the bench schema itself is recreated with its registry).
    pub async fn drop_version_schemas(&self) -> Result<(), StoreError> {
        sqlx::raw_sql(
            "DROP SCHEMA IF EXISTS bench_versioned_v1 CASCADE; \
             DROP SCHEMA IF EXISTS bench_versioned_v2 CASCADE; \
             DROP SCHEMA IF EXISTS vantage_bench_rm CASCADE",
        )
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// The oldest open transaction of the daemons' connections: its age in seconds (0 when
    /// none) and the start of the statement it runs or last ran (to name what held it open).
    pub async fn oldest_daemon_transaction(&self) -> Result<(f64, String), StoreError> {
        let row = sqlx::query(
            "/* vantage-bench */ SELECT extract(epoch FROM clock_timestamp() - xact_start)::float8, \
                    state || ': ' || left(regexp_replace(query, '\\s+', ' ', 'g'), 120) \
             FROM pg_stat_activity WHERE application_name = 'vantage bench daemon' \
               AND xact_start IS NOT NULL AND state <> 'idle' \
             ORDER BY xact_start LIMIT 1",
        )
        .fetch_optional(self.pool())
        .await
        .map_err(map_db_error)?;
        Ok(match row {
            Some(r) => (
                r.try_get(0).map_err(map_db_error)?,
                r.try_get(1).map_err(map_db_error)?,
            ),
            None => (0.0, String::new()),
        })
    }

    /// The backfill's batches as `pg_stat_statements` saw them (when the server has it loaded):
    /// calls, and their mean and longest execution time in milliseconds.
    pub async fn backfill_batch_times(&self) -> Result<Option<(i64, f64, f64)>, StoreError> {
        let row = sqlx::query(
            "/* vantage-bench */ SELECT sum(calls)::bigint, \
                    (sum(total_exec_time) / greatest(sum(calls), 1))::float8, max(max_exec_time)::float8 \
             FROM public.pg_stat_statements \
             WHERE query LIKE '%FROM backfill_perspective_version(%' \
               AND query NOT LIKE '%vantage-bench%'",
        )
        .fetch_one(self.pool())
        .await;
        // (no pg_stat_statements on this server: nothing to say)
        let Ok(row) = row else { return Ok(None) };
        let calls: Option<i64> = row.try_get(0).map_err(map_db_error)?;
        Ok(match calls {
            Some(calls) if calls > 0 => Some((
                calls,
                row.try_get(1).map_err(map_db_error)?,
                row.try_get(2).map_err(map_db_error)?,
            )),
            _ => None,
        })
    }

    /// Append → applied latency of version `version` for events appended at or after
    /// `from_position` (its table records when each row was written).
    pub async fn version_latency(
        &self,
        version: i32,
        from_position: i64,
    ) -> Result<LatencyMs, StoreError> {
        let table = match version {
            1 => "bench_versioned_v1.applied",
            _ => "bench_versioned_v2.applied",
        };
        // (the table name is one of two constants above, never input)
        let sql = format!(
            "/* vantage-bench */ SELECT count(*), \
                coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), 0)::float8, \
                coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), 0)::float8 \
             FROM (SELECT extract(epoch FROM a.applied_at - e.created_at) * 1000 AS ms \
                   FROM {table} a JOIN wh_event_store e ON e.global_position = a.global_position \
                   WHERE a.global_position >= $1) l"
        );
        let row = sqlx::query(&sql)
            .bind(from_position)
            .fetch_one(self.pool())
            .await
            .map_err(map_db_error)?;
        Ok(LatencyMs {
            count: row.get(0),
            p50: row.get(1),
            p99: row.get(2),
        })
    }
}
