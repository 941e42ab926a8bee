//! The seeded state: the bench schema and its read model, the seed, and the shapes the checks
//! give the work rows (parked, exhausted, deleted behind a snapshot).

use sqlx::Row;
use uuid::Uuid;

use super::BenchStore;
use crate::store::error::map_db_error;
use crate::store::StoreError;

/// The read model: one row per applied (perspective, stream, version). `applied` counts how
/// often it was applied (exactly once: 1), `seq` the order in which rows were applied (ordering
/// check), `applied_at` when (append → applied latency).
const CREATE_READ_MODEL: &str = "
CREATE SEQUENCE bench_applied_seq;
CREATE TABLE bench_applied (
    perspective     text        NOT NULL,
    stream_id       uuid        NOT NULL,
    stream_version  int         NOT NULL,
    event_id        uuid        NOT NULL,
    global_position bigint      NOT NULL,
    applied         int         NOT NULL DEFAULT 1,
    seq             bigint      NOT NULL DEFAULT nextval('bench_applied_seq'),
    applied_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (perspective, stream_id, stream_version)
)";

/// Seeds `per_stream` events into each of `streams` streams, round robin (version 1 of every
/// stream, then version 2, ...), as concurrent producers would append them. Stream and event
/// ids derive from (salt, stream, version), so a re-seed is identical. The fan-out trigger
/// creates the work rows of every registered perspective. With `$6`, each event's metadata
/// carries a W3C `traceparent` of its own (a sampled producer span), as a traced producer's
/// would.
const SEED: &str = "
INSERT INTO wh_event_store (event_id, stream_id, stream_version, event_type, event_data, metadata)
SELECT md5($1 || ':e:' || s || ':' || v)::uuid,
       md5($1 || ':s:' || s)::uuid,
       v,
       $4,
       jsonb_build_object('s', s, 'v', v, 'pad', repeat('x', $5)),
       CASE WHEN $6 THEN jsonb_build_object('traceparent',
           '00-' || md5($1 || ':t:' || s || ':' || v) || '-'
                 || substr(md5($1 || ':p:' || s || ':' || v), 1, 16) || '-01')
            ELSE '{}'::jsonb END
FROM generate_series(1, $3) AS v, generate_series(0, $2 - 1) AS s
ORDER BY v, s";

/// Empties everything a run leaves behind (events, work rows, dead letters, the read model,
/// instances), restarting the identities so a re-seed gets the same global positions.
const RESET_DATA: &str = "
TRUNCATE wh_event_store, wh_perspective_events, wh_perspective_lanes, wh_lane_wakeups, wh_dead_letter_history,
         wh_dead_letters, wh_service_instances, wh_perspectives, wh_perspective_versions,
         wh_perspective_version_history, bench_applied RESTART IDENTITY;
ALTER SEQUENCE bench_applied_seq RESTART";

impl BenchStore {
    /// Drops and recreates the bench schema, migrates it and creates the read model.
    pub async fn recreate_schema(&self) -> Result<(), StoreError> {
        sqlx::query("DROP SCHEMA IF EXISTS vantage_bench CASCADE")
            .execute(self.pool())
            .await?;
        self.store.migrate().await?;
        sqlx::raw_sql(CREATE_READ_MODEL)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Loads `pg_stat_statements` into `shared_preload_libraries` (takes effect at the next
    /// server start; for a throwaway server the harness restarts it).
    pub async fn preload_pg_stat_statements(&self) -> Result<(), StoreError> {
        sqlx::query("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Creates `pg_stat_statements` in schema public if the server has it loaded; returns
    /// whether it can be read.
    pub async fn enable_statement_stats(&self) -> bool {
        let created =
            sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements SCHEMA public")
                .execute(self.pool())
                .await;
        if created.is_err() {
            return false;
        }
        sqlx::query("/* vantage-bench */ SELECT count(*) FROM public.pg_stat_statements")
            .execute(self.pool())
            .await
            .is_ok()
    }

    /// The server's version and the settings that shape the figures.
    pub async fn server_settings(&self) -> Result<Vec<(String, String)>, StoreError> {
        let rows = sqlx::query(
            "SELECT name, setting FROM pg_settings WHERE name IN \
             ('server_version', 'fsync', 'synchronous_commit', 'full_page_writes', \
              'shared_buffers', 'max_connections', 'shared_preload_libraries') ORDER BY name",
        )
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| (r.get::<String, _>(0), r.get::<String, _>(1)))
            .collect())
    }

    /// Empties every table a run writes.
    pub async fn reset_data(&self) -> Result<(), StoreError> {
        sqlx::raw_sql(RESET_DATA).execute(self.pool()).await?;
        Ok(())
    }

    /// Seeds `per_stream` events of `event_type` into each of `streams` streams (see `SEED`);
    /// `salt` keeps the stream ids of different seeds apart. Returns the events inserted.
    pub async fn seed(
        &self,
        salt: &str,
        streams: i64,
        per_stream: i64,
        event_type: &str,
        payload_bytes: i32,
        traced: bool,
    ) -> Result<u64, StoreError> {
        let done = sqlx::query(SEED)
            .bind(salt)
            .bind(streams)
            .bind(per_stream)
            .bind(event_type)
            .bind(payload_bytes)
            .bind(traced)
            .execute(self.pool())
            .await
            .map_err(map_db_error)?;
        Ok(done.rows_affected())
    }

    /// Refreshes planner statistics and the visibility map after a seed (as autovacuum would).
    pub async fn analyze(&self) -> Result<(), StoreError> {
        // Separate statements: VACUUM cannot run in the implicit transaction of a multi-statement string.
        sqlx::raw_sql("VACUUM (ANALYZE) wh_perspective_events")
            .execute(self.pool())
            .await?;
        sqlx::raw_sql("ANALYZE wh_event_store")
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Parks every queued row of `perspective` for an hour, as failed rows waiting out a backoff.
    pub async fn park(&self, perspective: &str) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "UPDATE wh_perspective_events SET scheduled_for = now() + interval '1 hour', \
             failures = 1, last_error = 'parked by vantage bench' WHERE perspective_name = $1",
        )
        .bind(perspective)
        .execute(self.pool())
        .await?;
        Ok(done.rows_affected())
    }

    /// Sets the attempts of every queued row of `perspective` to `attempts`, so that its next
    /// claim dead-letters it (attempts > max).
    pub async fn exhaust(&self, perspective: &str, attempts: i32) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "UPDATE wh_perspective_events SET attempts = $2, failures = $2, \
             last_error = 'exhausted by vantage bench' WHERE perspective_name = $1",
        )
        .bind(perspective)
        .bind(attempts)
        .execute(self.pool())
        .await?;
        Ok(done.rows_affected())
    }

    /// Deletes the queued rows of events after `position` (leaving dead tuples behind).
    pub async fn delete_work_after(&self, position: i64) -> Result<u64, StoreError> {
        let done = sqlx::query("DELETE FROM wh_perspective_events WHERE global_position > $1")
            .bind(position)
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected())
    }

    /// The stream ids `SEED` gave the streams of a part seeded with `salt`.
    pub async fn stream_ids(&self, salt: &str, streams: i64) -> Result<Vec<Uuid>, StoreError> {
        Ok(sqlx::query_scalar(
            "/* vantage-bench */ SELECT md5($1 || ':s:' || s)::uuid FROM generate_series(0, $2 - 1) s",
        )
        .bind(salt)
        .bind(streams)
        .fetch_all(self.pool())
        .await?)
    }
}
