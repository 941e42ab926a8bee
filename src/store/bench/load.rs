//! The load the checks put beside the daemon: a producer's appends, an operator's dead
//! letters, a rebuild's re-queue.

use uuid::Uuid;

use super::{BenchStore, BENCH_EVENT_TYPE};
use crate::store::error::map_db_error;
use crate::store::StoreError;

impl BenchStore {
    /// Appends `count` events to `stream` (versions after `after_version`), as a producer would:
    /// one autocommit statement, created_at = the append's time. Returns the first global position.
    pub async fn append_ticks(
        &self,
        salt: &str,
        stream: i64,
        after_version: i32,
        count: i32,
    ) -> Result<i64, StoreError> {
        sqlx::query_scalar(
            "/* vantage-bench */ WITH ins AS (
                INSERT INTO wh_event_store (event_id, stream_id, stream_version, event_type, event_data, created_at)
                SELECT gen_random_uuid(), md5($1 || ':s:' || $2)::uuid, $3 + v, $5,
                       jsonb_build_object('s', $2, 'v', $3 + v), clock_timestamp()
                FROM generate_series(1, $4) AS v
                RETURNING global_position)
             SELECT min(global_position) FROM ins",
        )
        .bind(salt)
        .bind(stream)
        .bind(after_version)
        .bind(count)
        .bind(BENCH_EVENT_TYPE)
        .fetch_one(self.pool())
        .await
        .map_err(map_db_error)
    }

    /// Dead-letters every queued row of `perspective` (unleased or not: the bench's operator
    /// phase runs with no daemon) in one move, and returns the dead letters' ids, for a bulk
    /// requeue to hand back.
    pub async fn dead_letter_queued(&self, perspective: &str) -> Result<Vec<Uuid>, StoreError> {
        Ok(sqlx::query_scalar(
            "/* vantage-bench */ SELECT m.dead_letter_id
             FROM (SELECT array_agg(pe.event_work_id) AS ids
                   FROM wh_perspective_events pe WHERE pe.perspective_name = $1) q
             CROSS JOIN LATERAL wh_move_to_dead_letters(
                 NULL, q.ids, array_fill(NULL::uuid, ARRAY[cardinality(q.ids)]),
                 'PermanentFailure',
                 array_fill('dead-lettered by the bench'::text, ARRAY[cardinality(q.ids)])) m
             WHERE q.ids IS NOT NULL
             ORDER BY m.dead_letter_id",
        )
        .bind(perspective)
        .fetch_all(self.pool())
        .await?)
    }

    /// A rebuild's re-queue, once over: deletes the perspective's queued rows, then queues its
    /// whole history again in chunks of `chunk` events, each chunk its own transaction (as
    /// `perspectives rebuild` does).
    pub async fn requeue_history_chunks(
        &self,
        perspective: &str,
        chunk: i64,
    ) -> Result<u64, StoreError> {
        sqlx::query(
            "/* vantage-bench */ DELETE FROM wh_perspective_events WHERE perspective_name = $1",
        )
        .bind(perspective)
        .execute(self.pool())
        .await?;
        let up_to: i64 = sqlx::query_scalar(
            "/* vantage-bench */ SELECT coalesce(max(global_position), 0) FROM wh_event_store",
        )
        .fetch_one(self.pool())
        .await?;
        let mut conn = self.pool().acquire().await?;
        let (mut after, mut queued) = (0i64, 0u64);
        loop {
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            let (n, last) =
                crate::store::requeue_history_batch_in(&mut tx, perspective, after, up_to, chunk)
                    .await?;
            tx.commit().await?;
            queued += n;
            match last {
                Some(last) => after = last,
                None => return Ok(queued),
            }
        }
    }
}
