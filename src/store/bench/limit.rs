//! The physical limit: the crash-safe shape's two statements (on vantage's work table or on a
//! trigger-free copy of it) and the single-transaction floor.

use uuid::Uuid;

use super::BenchStore;
use crate::store::StoreError;

/// The physical limit's own work table: a copy of `wh_perspective_events` with the same
/// columns, constraints, storage options and best index (the lane index), and none of vantage's
/// triggers (no lane index, no wake-ups), so the limit pays for nothing of vantage's
/// bookkeeping. Filled from the seeded work rows, which then leave vantage's table, in the
/// physical order the fan-out gave them (by position): copied in lane order instead, a batch's
/// rows would share pages and most leases would find no room for a HOT update.
const LIMIT_COPY: &str = "
CREATE TABLE IF NOT EXISTS bench_limit_work
    (LIKE wh_perspective_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)
    WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.01,
          autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_insert_scale_factor = 0.05,
          autovacuum_analyze_scale_factor = 0.02);
TRUNCATE bench_limit_work;
INSERT INTO bench_limit_work
SELECT * FROM wh_perspective_events ORDER BY global_position, perspective_name;
TRUNCATE wh_perspective_events, wh_perspective_lanes, wh_lane_wakeups";

/// The crash-safe limit's two statements on a given work table (a literal: `wh_perspective_events`
/// or the trigger-free copy), see `LIMIT_LEASE` and `LIMIT_APPLY`.
macro_rules! limit_lease_on {
    ($table:literal) => {
        concat!(
            "
UPDATE ",
            $table,
            " pe
SET instance_id = $1,
    lease_expiry = clock_timestamp() + interval '60 seconds',
    attempts = pe.attempts + 1
FROM (SELECT w.event_work_id
      FROM ",
            $table,
            " w
      WHERE w.perspective_name = ANY ($2) AND w.instance_id IS NULL AND w.scheduled_for <= now()
      ORDER BY w.perspective_name, w.stream_id, w.stream_version
      LIMIT $3
      FOR UPDATE SKIP LOCKED) c
WHERE pe.event_work_id = c.event_work_id
RETURNING pe.event_work_id"
        )
    };
}
macro_rules! limit_apply_on {
    ($table:literal) => {
        concat!(
            "
WITH done AS (
    DELETE FROM ", $table, " pe
    WHERE pe.event_work_id = ANY ($2) AND pe.instance_id = $1
    RETURNING pe.perspective_name, pe.stream_id, pe.stream_version, pe.event_id, pe.global_position
)
INSERT INTO bench_applied (perspective, stream_id, stream_version, event_id, global_position)
SELECT d.perspective_name, d.stream_id, d.stream_version, d.event_id, d.global_position
FROM done d
JOIN wh_event_store e ON e.global_position = d.global_position
ORDER BY d.perspective_name, d.stream_id, d.stream_version
ON CONFLICT (perspective, stream_id, stream_version)
DO UPDATE SET applied = bench_applied.applied + 1"
        )
    };
}

/// Which work table a limit run leases from and deletes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitTable {
    /// A trigger-free copy of the work table (`bench_limit_work`): the true physical limit.
    TriggerFree,
    /// vantage's own work table, paying its lane triggers (the figure reported before).
    Vantage,
}

/// The physical limit, crash-safe shape, transaction 1: lease up to `$3` due, unleased rows of
/// the given perspectives in lane order (the lane index is the best index for it: every other
/// order needs an index on a lease column, which makes every lease a non-HOT update), with
/// attempts + 1, and return their ids. Autocommit: the lease is committed.
pub(super) const LIMIT_LEASE: &str = limit_lease_on!("wh_perspective_events");
const LIMIT_LEASE_COPY: &str = limit_lease_on!("bench_limit_work");

/// Transaction 2: for the rows leased in transaction 1 (fenced on the lease holder), the
/// perspective's upsert for each row (set-based, reading the event as the daemon does), and
/// their deletion, in one statement.
const LIMIT_APPLY: &str = limit_apply_on!("wh_perspective_events");
const LIMIT_APPLY_COPY: &str = limit_apply_on!("bench_limit_work");

/// The single-transaction floor: claim (locked, never leased), upsert and delete in one
/// autocommit statement.
const LIMIT_FLOOR: &str = "
WITH c AS (
    SELECT w.event_work_id
    FROM wh_perspective_events w
    WHERE w.perspective_name = ANY ($1) AND w.instance_id IS NULL AND w.scheduled_for <= now()
    ORDER BY w.perspective_name, w.stream_id, w.stream_version
    LIMIT $2
    FOR UPDATE SKIP LOCKED
), done AS (
    DELETE FROM wh_perspective_events pe USING c
    WHERE pe.event_work_id = c.event_work_id
    RETURNING pe.perspective_name, pe.stream_id, pe.stream_version, pe.event_id, pe.global_position
)
INSERT INTO bench_applied (perspective, stream_id, stream_version, event_id, global_position)
SELECT d.perspective_name, d.stream_id, d.stream_version, d.event_id, d.global_position
FROM done d
JOIN wh_event_store e ON e.global_position = d.global_position
ORDER BY d.perspective_name, d.stream_id, d.stream_version
ON CONFLICT (perspective, stream_id, stream_version)
DO UPDATE SET applied = bench_applied.applied + 1";

impl BenchStore {
    /// Crash-safe shape, transaction 1 (see `LIMIT_LEASE`): the leased ids.
    pub async fn limit_lease(
        &self,
        table: LimitTable,
        holder: Uuid,
        perspectives: &[String],
        batch_size: i32,
    ) -> Result<Vec<Uuid>, StoreError> {
        let sql = match table {
            LimitTable::TriggerFree => LIMIT_LEASE_COPY,
            LimitTable::Vantage => LIMIT_LEASE,
        };
        Ok(sqlx::query_scalar(sql)
            .bind(holder)
            .bind(perspectives)
            .bind(batch_size)
            .fetch_all(self.pool())
            .await?)
    }

    /// Crash-safe shape, transaction 2 (see `LIMIT_APPLY`): rows applied and deleted.
    pub async fn limit_apply(
        &self,
        table: LimitTable,
        holder: Uuid,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        let sql = match table {
            LimitTable::TriggerFree => LIMIT_APPLY_COPY,
            LimitTable::Vantage => LIMIT_APPLY,
        };
        Ok(sqlx::query(sql)
            .bind(holder)
            .bind(ids)
            .execute(self.pool())
            .await?
            .rows_affected())
    }

    /// Moves the seeded work rows into the trigger-free copy (see `LIMIT_COPY`) and refreshes
    /// its statistics, for a limit run on [`LimitTable::TriggerFree`].
    pub async fn move_work_to_limit_copy(&self) -> Result<u64, StoreError> {
        sqlx::raw_sql(LIMIT_COPY).execute(self.pool()).await?;
        sqlx::raw_sql("VACUUM (ANALYZE) bench_limit_work")
            .execute(self.pool())
            .await?;
        Ok(
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM bench_limit_work")
                .fetch_one(self.pool())
                .await? as u64,
        )
    }

    /// Rows left in the trigger-free copy after a limit run.
    pub async fn limit_copy_remaining(&self) -> Result<i64, StoreError> {
        Ok(
            sqlx::query_scalar("/* vantage-bench */ SELECT count(*) FROM bench_limit_work")
                .fetch_one(self.pool())
                .await?,
        )
    }

    /// The single-transaction floor (see `LIMIT_FLOOR`): rows applied and deleted.
    pub async fn limit_floor(
        &self,
        perspectives: &[String],
        batch_size: i32,
    ) -> Result<u64, StoreError> {
        Ok(sqlx::query(LIMIT_FLOOR)
            .bind(perspectives)
            .bind(batch_size)
            .execute(self.pool())
            .await?
            .rows_affected())
    }
}
