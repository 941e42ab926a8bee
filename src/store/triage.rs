//! Triage at scale (docs/cli.md, "Commands" and "vantage dlq"): dead letters grouped by error
//! fingerprint, the lanes whose head is parked or failing (and what waits behind them), and
//! pausing a perspective.
//!
//! - Fingerprints are computed in SQL (`wh_error_fingerprint`, migrations/0008_triage.sql) and stored on
//!   every dead letter (`error_fingerprint`, a generated column); grouping runs in the database
//!   over the partial index of open dead letters by fingerprint, so millions of dead letters are
//!   never loaded into the process. A failing work row gets its fingerprint from its
//!   `last_error` with the same function, so a parked head and its future dead letter agree.
//! - Blocked lanes are found from the failing rows (`failures > 0`, or parked), keeping those
//!   that are the head of their lane; what waits behind a head is counted on the lane index.
//! - A paused perspective is not claimed (`wh_claimable_perspectives`, `get_stream_events`);
//!   pausing is a row update, so every daemon sees it at its next claim. Quarantine is the
//!   same update, made by a daemon when the perspective's recent dead letters reach its
//!   `quarantine_after` (migrations/0008_triage.sql).

use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::error::{map_db_error, StoreError};
use super::handle::Store;

/// Who a quarantine's pause is by (`paused_by`, shown by `status` and the console).
pub const QUARANTINE_BY: &str = "vantage quarantine";

/// One error group: the open dead letters that share a fingerprint.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct ErrorGroup {
    /// `wh_error_fingerprint(perspective, event type, error text)`: 12 hex digits.
    pub fingerprint: String,
    /// The perspective (part of the fingerprint).
    pub perspective_name: String,
    /// The event type (part of the fingerprint; `None` if the event had vanished).
    pub event_type: Option<String>,
    /// The SQLSTATE the error text names, if any.
    pub sqlstate: Option<String>,
    /// The error text with its variable parts masked.
    pub message: String,
    /// How many open dead letters.
    pub count: i64,
    /// The earliest `dead_lettered_at`.
    pub first_seen: DateTime<Utc>,
    /// The latest `dead_lettered_at`.
    pub last_seen: DateTime<Utc>,
    /// The lowest position in the group (one to inspect, or to replay with `--dry-run`).
    pub sample_position: i64,
}

/// A lane whose head is parked or failing, and what waits behind it.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct BlockedLane {
    /// The perspective.
    pub perspective_name: String,
    /// The stream.
    pub stream_id: Uuid,
    /// The head's global position.
    pub head_position: i64,
    /// The head's stream version.
    pub head_version: i32,
    /// The head's event type (`None` if the event had vanished).
    pub event_type: Option<String>,
    /// Claims of the head so far.
    pub attempts: i32,
    /// Recorded failures of the head.
    pub failures: i32,
    /// When the head may be claimed again (its backoff), when it is not leased.
    pub next_retry_at: Option<DateTime<Utc>>,
    /// Whether the head is leased right now (being retried).
    pub leased: bool,
    /// The head's last error.
    pub last_error: Option<String>,
    /// The fingerprint of the head's last error (as its dead letter will have).
    pub fingerprint: String,
    /// Events waiting behind the head in its lane.
    pub waiting: i64,
    /// When the oldest of those was queued (`None` when none waits).
    pub waiting_since: Option<DateTime<Utc>>,
    /// When the head was queued.
    pub head_queued_at: DateTime<Utc>,
}

/// Per perspective: how many lanes are blocked and how many events wait behind their heads.
#[derive(Clone, Debug, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct BlockedTotals {
    /// The perspective.
    pub perspective_name: String,
    /// Lanes whose head is parked or failing.
    pub lanes: i64,
    /// Events waiting behind those heads.
    pub events: i64,
}

/// A registered perspective's pause, if it is paused.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct PauseState {
    /// The perspective.
    pub perspective_name: String,
    /// Since when (`None`: not paused).
    pub paused_at: Option<DateTime<Utc>>,
    /// Why, as the operator said.
    pub paused_reason: Option<String>,
    /// Who paused it.
    pub paused_by: Option<String>,
}

/// The failing heads (`failures > 0`, or parked until a backoff passes), with their lane.
const FAILING_HEADS: &str = "\
    heads AS ( \
        SELECT pe.* FROM wh_perspective_events pe \
        WHERE (pe.failures > 0 OR (pe.instance_id IS NULL AND pe.scheduled_for > now())) \
          AND ($1::text IS NULL OR pe.perspective_name = $1) \
          AND NOT EXISTS (SELECT 1 FROM wh_perspective_events e \
                          WHERE e.perspective_name = pe.perspective_name \
                            AND e.stream_id = pe.stream_id \
                            AND e.stream_version < pe.stream_version))";

impl Store {
    /// Open dead letters grouped by fingerprint (of one perspective, when given), biggest first
    /// (then the most recent, then the fingerprint). Grouped in the database.
    pub(crate) async fn error_groups(
        &self,
        perspective: Option<&str>,
    ) -> Result<Vec<ErrorGroup>, StoreError> {
        sqlx::query_as(
            "WITH g AS ( \
                 SELECT error_fingerprint, count(*) AS count, \
                        min(dead_lettered_at) AS first_seen, max(dead_lettered_at) AS last_seen, \
                        min(global_position) AS sample_position \
                 FROM wh_dead_letters \
                 WHERE status = 'exhausted' AND ($1::text IS NULL OR perspective_name = $1) \
                 GROUP BY error_fingerprint) \
             SELECT g.error_fingerprint AS fingerprint, s.perspective_name, s.event_type, \
                    wh_error_sqlstate(s.error_text) AS sqlstate, \
                    coalesce(wh_error_mask(s.error_text), '') AS message, \
                    g.count, g.first_seen, g.last_seen, g.sample_position \
             FROM g CROSS JOIN LATERAL ( \
                 SELECT d.perspective_name, d.event_type, d.error_text FROM wh_dead_letters d \
                 WHERE d.status = 'exhausted' AND d.error_fingerprint = g.error_fingerprint \
                   AND d.global_position = g.sample_position \
                 LIMIT 1) s \
             ORDER BY g.count DESC, g.last_seen DESC, g.error_fingerprint",
        )
        .bind(perspective)
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Lanes whose head is parked or failing (of one perspective, when given), the most events
    /// waiting first; at most `limit`.
    pub(crate) async fn blocked_lanes(
        &self,
        perspective: Option<&str>,
        limit: i64,
    ) -> Result<Vec<BlockedLane>, StoreError> {
        sqlx::query_as(&format!(
            "WITH {FAILING_HEADS} \
             SELECT h.perspective_name, h.stream_id, h.global_position AS head_position, \
                    h.stream_version AS head_version, ev.event_type, h.attempts, h.failures, \
                    CASE WHEN h.instance_id IS NULL THEN h.scheduled_for END AS next_retry_at, \
                    h.instance_id IS NOT NULL AS leased, h.last_error, \
                    wh_error_fingerprint(h.perspective_name, ev.event_type, h.last_error) AS fingerprint, \
                    b.waiting, b.waiting_since, h.created_at AS head_queued_at \
             FROM heads h \
             LEFT JOIN wh_event_store ev ON ev.global_position = h.global_position \
             CROSS JOIN LATERAL ( \
                 SELECT count(*) AS waiting, min(e.created_at) AS waiting_since \
                 FROM wh_perspective_events e \
                 WHERE e.perspective_name = h.perspective_name AND e.stream_id = h.stream_id \
                   AND e.stream_version > h.stream_version) b \
             ORDER BY b.waiting DESC, h.created_at, h.perspective_name, h.stream_id \
             LIMIT $2"
        ))
        .bind(perspective)
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Per perspective with blocked lanes: how many, and how many events wait behind them.
    pub(crate) async fn blocked_totals(
        &self,
        perspective: Option<&str>,
    ) -> Result<Vec<BlockedTotals>, StoreError> {
        sqlx::query_as(&format!(
            "WITH {FAILING_HEADS} \
             SELECT h.perspective_name, count(*) AS lanes, \
                    coalesce(sum(b.waiting), 0)::bigint AS events \
             FROM heads h \
             CROSS JOIN LATERAL ( \
                 SELECT count(*) AS waiting FROM wh_perspective_events e \
                 WHERE e.perspective_name = h.perspective_name AND e.stream_id = h.stream_id \
                   AND e.stream_version > h.stream_version) b \
             GROUP BY h.perspective_name ORDER BY h.perspective_name"
        ))
        .bind(perspective)
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Pauses a registered perspective: claims skip it from the next one on. True if it was
    /// running (now paused); false if it was paused already (nothing changed: the first
    /// reason and time stand). `None` if no such perspective is registered.
    pub(crate) async fn pause_perspective(
        &self,
        name: &str,
        reason: Option<&str>,
        by: &str,
    ) -> Result<Option<bool>, StoreError> {
        let changed: Option<bool> = sqlx::query_scalar(
            "WITH p AS (SELECT perspective_name, paused_at FROM wh_perspectives \
                        WHERE perspective_name = $1 FOR UPDATE), \
                  u AS (UPDATE wh_perspectives w \
                        SET paused_at = now(), paused_reason = $2, paused_by = $3, \
                            updated_at = now() \
                        FROM p WHERE w.perspective_name = p.perspective_name \
                          AND p.paused_at IS NULL \
                        RETURNING 1) \
             SELECT EXISTS (SELECT 1 FROM u) FROM p",
        )
        .bind(name)
        .bind(reason)
        .bind(by)
        .fetch_optional(&self.pool)
        .await
        .map_err(map_db_error)?;
        Ok(changed)
    }

    /// Resumes a paused perspective and wakes the daemons. True if it was paused; false if it
    /// was not (nothing changed). `None` if no such perspective is registered. Records when
    /// (`resumed_at`): quarantine counts only the dead letters after it.
    pub(crate) async fn resume_perspective(&self, name: &str) -> Result<Option<bool>, StoreError> {
        let changed: Option<bool> = sqlx::query_scalar(
            "WITH p AS (SELECT perspective_name, paused_at FROM wh_perspectives \
                        WHERE perspective_name = $1 FOR UPDATE), \
                  u AS (UPDATE wh_perspectives w \
                        SET paused_at = NULL, paused_reason = NULL, paused_by = NULL, \
                            resumed_at = now(), updated_at = now() \
                        FROM p WHERE w.perspective_name = p.perspective_name \
                          AND p.paused_at IS NOT NULL \
                        RETURNING 1) \
             SELECT EXISTS (SELECT 1 FROM u) FROM p",
        )
        .bind(name)
        .fetch_optional(&self.pool)
        .await
        .map_err(map_db_error)?;
        if changed == Some(true) {
            self.notify_work().await?;
        }
        Ok(changed)
    }

    /// Quarantine (`perspectives[].quarantine_after`): pauses `name` with `reason`, by
    /// [`QUARANTINE_BY`], if it runs and at least `dead_letters` of its events were
    /// dead-lettered within the last `window` and since it was last resumed. One statement,
    /// fenced on `paused_at IS NULL`: of several daemons checking at once only one pauses it,
    /// and only that one gets `Some(paused_at)`; `None` when nothing changed. The count reads
    /// at most `dead_letters` entries of the perspective's index of recent dead letters.
    pub(crate) async fn quarantine_perspective(
        &self,
        name: &str,
        dead_letters: u32,
        window: Duration,
        reason: &str,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        sqlx::query_scalar(
            "UPDATE wh_perspectives p \
             SET paused_at = now(), paused_reason = $4, paused_by = $5, updated_at = now() \
             WHERE p.perspective_name = $1 \
               AND p.paused_at IS NULL \
               AND (SELECT count(*) FROM ( \
                        SELECT 1 FROM wh_dead_letters d \
                        WHERE d.perspective_name = $1 \
                          AND d.dead_lettered_at > greatest(now() - make_interval(secs => $3), \
                                                            p.resumed_at) \
                        LIMIT $2) n) >= $2 \
             RETURNING p.paused_at",
        )
        .bind(name)
        .bind(i64::from(dead_letters))
        .bind(window.as_secs_f64())
        .bind(reason)
        .bind(QUARANTINE_BY)
        .fetch_optional(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Every registered perspective's pause state, by name.
    pub(crate) async fn pause_states(&self) -> Result<Vec<PauseState>, StoreError> {
        sqlx::query_as(
            "SELECT perspective_name, paused_at, paused_reason, paused_by \
             FROM wh_perspectives ORDER BY perspective_name",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }
}
