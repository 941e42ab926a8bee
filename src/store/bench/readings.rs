//! What the harness reads back: the read model's verdict on a drain, the database's counters,
//! latencies, and progress.

use std::time::Duration;

use sqlx::Row;

use super::BenchStore;
use crate::store::StoreError;

/// Counters read before and after a run (see [`RunCounters`]).
const COUNTERS: &str = "
/* vantage-bench */ SELECT
    (SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database())::bigint,
    pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint,
    pg_backend_pid()";

/// Statements executed by anyone but the harness (pg_stat_statements, top level).
const STATEMENT_CALLS: &str = "
/* vantage-bench */ SELECT coalesce(sum(calls), 0)::bigint FROM public.pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND query NOT LIKE '%vantage-bench%'";

/// What the read model says about a finished drain.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DrainCheck {
    /// Work rows still queued for the perspectives.
    pub remaining: i64,
    /// Read model rows (events applied at least once).
    pub applied: i64,
    /// Rows applied more than once.
    pub duplicates: i64,
    /// Events applied before an earlier event of their (perspective, stream).
    pub out_of_order: i64,
}

/// Counters of the database, read before and after a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunCounters {
    /// Committed + rolled back transactions of this database (`pg_stat_database`).
    pub transactions: i64,
    /// WAL position, bytes.
    pub wal_bytes: i64,
    /// Top-level statements executed by others than the harness (`pg_stat_statements`), when
    /// the extension is loaded.
    pub statements: Option<i64>,
    /// The process id of the server backend that read these (to find the server's processes
    /// when it runs on this machine).
    pub backend_pid: i32,
}

/// Latency percentiles from the read model, milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LatencyMs {
    /// Events measured.
    pub count: i64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl BenchStore {
    /// The process id of the server backend that answers (on a pool of one connection, the
    /// backend of every statement of that pool).
    pub async fn backend_pid(&self) -> Result<i32, StoreError> {
        Ok(
            sqlx::query_scalar("/* vantage-bench */ SELECT pg_backend_pid()")
                .fetch_one(self.pool())
                .await?,
        )
    }

    /// Queued work rows of these perspectives.
    pub async fn queued(&self, perspectives: &[String]) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(
            "/* vantage-bench */ SELECT count(*) FROM wh_perspective_events \
             WHERE perspective_name = ANY ($1)",
        )
        .bind(perspectives)
        .fetch_one(self.pool())
        .await?)
    }

    /// Open dead letters of these perspectives.
    pub async fn dead_letters(&self, perspectives: &[String]) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(
            "/* vantage-bench */ SELECT count(*) FROM wh_dead_letters \
             WHERE perspective_name = ANY ($1) AND status = 'exhausted'",
        )
        .bind(perspectives)
        .fetch_one(self.pool())
        .await?)
    }

    /// Checks the read model of these perspectives: exactly once, in order.
    pub async fn check_drain(&self, perspectives: &[String]) -> Result<DrainCheck, StoreError> {
        let remaining = self.queued(perspectives).await?;
        let row = sqlx::query(
            "/* vantage-bench */ SELECT count(*), count(*) FILTER (WHERE applied > 1), \
                    count(*) FILTER (WHERE seq < prev_seq) \
             FROM (SELECT applied, seq, lag(seq) OVER (PARTITION BY perspective, stream_id \
                                                       ORDER BY stream_version) AS prev_seq \
                   FROM bench_applied WHERE perspective = ANY ($1)) a",
        )
        .bind(perspectives)
        .fetch_one(self.pool())
        .await?;
        Ok(DrainCheck {
            remaining,
            applied: row.get(0),
            duplicates: row.get(1),
            out_of_order: row.get(2),
        })
    }

    /// The database's counters now.
    pub async fn counters(&self, with_statements: bool) -> Result<RunCounters, StoreError> {
        // Statistics read in a transaction are a snapshot; each read here is its own.
        let row = sqlx::query(COUNTERS).fetch_one(self.pool()).await?;
        let statements = if with_statements {
            Some(
                sqlx::query_scalar(STATEMENT_CALLS)
                    .fetch_one(self.pool())
                    .await?,
            )
        } else {
            None
        };
        Ok(RunCounters {
            transactions: row.get(0),
            wal_bytes: row.get(1),
            statements,
            backend_pid: row.get(2),
        })
    }

    /// Waits `settle` for every backend to flush its pending statistics (PostgreSQL ≥ 15
    /// reports them at most once a second, and when a session goes idle).
    pub async fn settle_stats(&self, settle: Duration) {
        tokio::time::sleep(settle).await;
    }

    /// Append → applied latency of the read model rows of `perspective` whose event was
    /// appended at or after position `from_position`.
    pub async fn apply_latency(
        &self,
        perspective: &str,
        from_position: i64,
    ) -> Result<LatencyMs, StoreError> {
        let row = sqlx::query(
            "/* vantage-bench */ SELECT count(*), \
                coalesce(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), 0)::float8, \
                coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), 0)::float8 \
             FROM (SELECT extract(epoch FROM a.applied_at - e.created_at) * 1000 AS ms \
                   FROM bench_applied a JOIN wh_event_store e ON e.global_position = a.global_position \
                   WHERE a.perspective = $1 AND a.global_position >= $2) l",
        )
        .bind(perspective)
        .bind(from_position)
        .fetch_one(self.pool())
        .await?;
        Ok(LatencyMs {
            count: row.get(0),
            p50: row.get(1),
            p99: row.get(2),
        })
    }

    /// The highest global position so far (0 when empty).
    pub async fn max_position(&self) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(
            "/* vantage-bench */ SELECT coalesce(max(global_position), 0)::bigint FROM wh_event_store",
        )
        .fetch_one(self.pool())
        .await?)
    }

    /// Apply failures recorded so far on the perspective's queued rows.
    pub async fn failures_recorded(&self, perspective: &str) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(
            "/* vantage-bench */ SELECT coalesce(sum(failures), 0)::bigint \
             FROM wh_perspective_events WHERE perspective_name = $1",
        )
        .bind(perspective)
        .fetch_one(self.pool())
        .await?)
    }
}
