//! The metric history behind the console's charts (migrations/0014_metric_samples.sql,
//! docs/operations.md "The metric history"): the sampler's upsert and trim, and the console's
//! bucketed reads of it and of the dead letters' arrivals.
//!
//! Every statement here is one short statement on a small table (or an index range of
//! `wh_dead_letters`); none takes a lock a producer or the drain waits for.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::error::{map_db_error, StoreError};
use super::handle::Store;

/// How long the history keeps a minute: 24 hours, so at most [`SAMPLE_MINUTES`] rows per
/// perspective once a trim has run.
pub const SAMPLE_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// Rows one perspective has at most after a trim: one per minute of [`SAMPLE_RETENTION`].
pub const SAMPLE_MINUTES: i64 = (SAMPLE_RETENTION.as_secs() / 60) as i64;

/// What one sampler round writes for one perspective into the current minute.
#[derive(Clone, Debug, PartialEq)]
pub struct MinuteSample {
    /// The perspective.
    pub perspective_name: String,
    /// Events this daemon applied since its last write (added to the minute's count).
    pub applied: i64,
    /// Work rows now (the minute keeps the greatest); `None` when the gauges failed.
    pub backlog: Option<i64>,
    /// Age in seconds of the oldest work row now (the minute keeps the greatest).
    pub lag_seconds: Option<f64>,
}

/// One bucket of a chart: the minutes of the history that fall into it, aggregated.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct SampleBucket {
    /// Its index from the window's start (0-based).
    pub bucket: i64,
    /// Minutes with a sample in it (a daemon was sampling).
    pub minutes: i64,
    /// Events applied in those minutes.
    pub applied: i64,
    /// The highest backlog sampled (summed over perspectives per minute first).
    pub backlog: Option<i64>,
    /// The highest lag sampled (over every perspective).
    pub lag_seconds: Option<f64>,
}

/// A count in one bucket of a window.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct BucketCount {
    /// Its index from the window's start (0-based).
    pub bucket: i64,
    /// How many.
    pub count: i64,
}

/// Dead letters of one error group arriving in one bucket of a window.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct GroupBucketCount {
    /// The group (error fingerprint).
    pub fingerprint: String,
    /// Its index from the window's start (0-based).
    pub bucket: i64,
    /// Open dead letters of the group that arrived in it.
    pub count: i64,
}

/// A window of the history cut into equal buckets: `[start, start + buckets × bucket)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// Where the first bucket starts.
    pub start: DateTime<Utc>,
    /// How long one bucket is (a whole number of seconds, at least one).
    pub bucket: Duration,
    /// How many buckets.
    pub buckets: i64,
}

impl Window {
    fn bucket_seconds(&self) -> f64 {
        self.bucket.as_secs().max(1) as f64
    }

    /// Where the last bucket ends.
    pub fn end(&self) -> DateTime<Utc> {
        let span = self.bucket.as_secs().max(1) as i64 * self.buckets.max(0);
        self.start + chrono::Duration::seconds(span)
    }
}

impl Store {
    /// Upserts this round's samples into the current minute (the database's clock), in one
    /// statement: `applied` adds, `backlog` and `lag_seconds` keep the greatest, so several
    /// daemons writing the same minute neither double nor undo each other.
    pub(crate) async fn record_samples(&self, samples: &[MinuteSample]) -> Result<(), StoreError> {
        if samples.is_empty() {
            return Ok(());
        }
        let names: Vec<&str> = samples
            .iter()
            .map(|s| s.perspective_name.as_str())
            .collect();
        let applied: Vec<i64> = samples.iter().map(|s| s.applied.max(0)).collect();
        let backlog: Vec<Option<i64>> = samples.iter().map(|s| s.backlog).collect();
        let lag: Vec<Option<f64>> = samples
            .iter()
            .map(|s| s.lag_seconds.filter(|l| l.is_finite()).map(|l| l.max(0.0)))
            .collect();
        sqlx::query(
            "INSERT INTO wh_metric_samples AS s (minute, perspective_name, applied, backlog, lag_seconds) \
             SELECT date_trunc('minute', now()), n, a, b, l \
             FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::float8[]) AS u(n, a, b, l) \
             ON CONFLICT (minute, perspective_name) DO UPDATE SET \
                 applied = s.applied + EXCLUDED.applied, \
                 backlog = greatest(s.backlog, EXCLUDED.backlog), \
                 lag_seconds = greatest(s.lag_seconds, EXCLUDED.lag_seconds)",
        )
        .bind(&names)
        .bind(&applied)
        .bind(&backlog)
        .bind(&lag)
        .execute(&self.pool)
        .await
        .map_err(map_db_error)?;
        Ok(())
    }

    /// Deletes the minutes older than [`SAMPLE_RETENTION`] (the current one and the
    /// [`SAMPLE_MINUTES`]` - 1` before it stay); returns how many rows went.
    pub(crate) async fn trim_samples(&self) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "DELETE FROM wh_metric_samples \
             WHERE minute <= date_trunc('minute', now()) - make_interval(mins => $1::int)",
        )
        .bind(SAMPLE_MINUTES as i32)
        .execute(&self.pool)
        .await
        .map_err(map_db_error)?;
        Ok(done.rows_affected())
    }

    /// The history in `window`, one row per bucket that has a sample, of one perspective or
    /// (`None`) of all: per minute the perspectives' applied counts and backlogs are summed and
    /// the highest lag taken, then per bucket the minutes' applied summed and the highest
    /// backlog and lag kept.
    pub(crate) async fn sample_buckets(
        &self,
        perspective: Option<&str>,
        window: Window,
    ) -> Result<Vec<SampleBucket>, StoreError> {
        sqlx::query_as(
            "WITH m AS ( \
                 SELECT minute, sum(applied)::bigint AS applied, sum(backlog)::bigint AS backlog, \
                        max(lag_seconds) AS lag_seconds \
                 FROM wh_metric_samples \
                 WHERE minute >= $1 AND minute < $2 AND ($3::text IS NULL OR perspective_name = $3) \
                 GROUP BY minute) \
             SELECT floor(extract(epoch FROM minute - $1) / $4)::bigint AS bucket, \
                    count(*) AS minutes, sum(applied)::bigint AS applied, \
                    max(backlog) AS backlog, max(lag_seconds) AS lag_seconds \
             FROM m GROUP BY 1 ORDER BY 1",
        )
        .bind(window.start)
        .bind(window.end())
        .bind(perspective)
        .bind(window.bucket_seconds())
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Dead letters of `perspectives` that arrived (`dead_lettered_at`) in `window`, whatever
    /// their status now, per bucket with any: an index range per perspective
    /// (`wh_dead_letters_recent_idx`).
    pub(crate) async fn dead_letter_arrivals(
        &self,
        perspectives: &[String],
        window: Window,
    ) -> Result<Vec<BucketCount>, StoreError> {
        sqlx::query_as(
            "SELECT floor(extract(epoch FROM dead_lettered_at - $2) / $4)::bigint AS bucket, \
                    count(*) AS count \
             FROM wh_dead_letters \
             WHERE perspective_name = ANY($1) AND dead_lettered_at >= $2 AND dead_lettered_at < $3 \
             GROUP BY 1 ORDER BY 1",
        )
        .bind(perspectives)
        .bind(window.start)
        .bind(window.end())
        .bind(window.bucket_seconds())
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Open dead letters per error group (of one perspective, when given) that arrived in
    /// `window`, per bucket with any, in one statement: at most groups × buckets rows.
    pub(crate) async fn group_arrivals(
        &self,
        perspective: Option<&str>,
        window: Window,
    ) -> Result<Vec<GroupBucketCount>, StoreError> {
        sqlx::query_as(
            "SELECT error_fingerprint AS fingerprint, \
                    floor(extract(epoch FROM dead_lettered_at - $2) / $4)::bigint AS bucket, \
                    count(*) AS count \
             FROM wh_dead_letters \
             WHERE status = 'exhausted' AND error_fingerprint IS NOT NULL \
               AND ($1::text IS NULL OR perspective_name = $1) \
               AND dead_lettered_at >= $2 AND dead_lettered_at < $3 \
             GROUP BY 1, 2 ORDER BY 1, 2",
        )
        .bind(perspective)
        .bind(window.start)
        .bind(window.end())
        .bind(window.bucket_seconds())
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }
}
