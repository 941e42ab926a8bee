//! Every SQL statement `vantage soak` issues (the harness in [`crate::soak`] writes none).
//!
//! The soak works in a schema of its own ([`SOAK_SCHEMA`]), dropped and recreated: the vantage
//! objects (by the ordinary migrations) and four tables of its own:
//! - `soak_produced`: what the producer appended, written in the same statement as the append
//!   (so it is exactly the event store's content, and durable);
//! - `soak_applied`: one row per applied (perspective, event), `applications` counting how often
//!   it was applied (exactly once: 1) and `applied_at` the first application;
//! - `soak_lanes`: per (perspective, stream) the highest version applied and how many events
//!   were applied for the first time behind a later one (`disorders`); its `healthy` column has
//!   a CHECK that a poison event violates, which is how a poison event fails (SQLSTATE 23514);
//! - `soak_cured`: poison events the operator phase cured before requeuing them (they must then
//!   apply exactly once, and out of their lane's order by design);
//! - `soak_requeued`: the dead letters the operator phase requeued, with the claims after which
//!   they had been dead-lettered (dead-lettering again overwrites the dead letter's figure).
//!
//! Event data is never formatted into SQL: the only text spliced is a perspective name the
//! harness generated itself (`soak_a`, ...), into the perspective's statements, as a
//! configuration file would hold it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Row};
use uuid::Uuid;

use super::{Store, StoreError};

/// The schema the soak drops and recreates (never the configured `database.schema`).
pub const SOAK_SCHEMA: &str = "vantage_soak";

const CREATE_TABLES: &str = "
CREATE TABLE soak_produced (
    global_position bigint      PRIMARY KEY,
    stream_id       uuid        NOT NULL,
    stream_version  int         NOT NULL,
    event_type      text        NOT NULL,
    poison          text,
    poison_stream   boolean     NOT NULL,
    appended_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX soak_produced_appended ON soak_produced (appended_at);
CREATE INDEX soak_produced_poison ON soak_produced (poison) WHERE poison IS NOT NULL;
CREATE TABLE soak_applied (
    perspective     text        NOT NULL,
    global_position bigint      NOT NULL,
    applications    int         NOT NULL DEFAULT 1,
    applied_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (perspective, global_position)
);
CREATE TABLE soak_lanes (
    perspective     text        NOT NULL,
    stream_id       uuid        NOT NULL,
    last_version    int         NOT NULL,
    disorders       int         NOT NULL DEFAULT 0,
    first_apply     boolean     NOT NULL,
    healthy         boolean     NOT NULL CONSTRAINT soak_poison CHECK (healthy),
    PRIMARY KEY (perspective, stream_id)
);
CREATE TABLE soak_requeued (
    perspective       text        NOT NULL,
    global_position   bigint      NOT NULL,
    attempts_when_dlq int         NOT NULL,
    dead_lettered_at  timestamptz NOT NULL
);
CREATE TABLE soak_cured (
    perspective     text        NOT NULL,
    global_position bigint      NOT NULL,
    PRIMARY KEY (perspective, global_position)
)";

/// The apply statement of perspective `name` (for every event type it subscribes to).
///
/// It counts the application of the event (`soak_applied`), then records it on its lane: a
/// first application of a version at or below the lane's highest is a disorder. A poison event
/// for this perspective (`data.poison = name`) sets `healthy = false`, which the CHECK refuses,
/// so the whole apply fails and is retried until dead-lettered; a cured one skips the lane (a
/// requeued event applies after its successors by design).
pub fn perspective_statement(name: &str) -> String {
    debug_assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    format!(
        "WITH a AS (\
            INSERT INTO soak_applied AS s (perspective, global_position) VALUES ('{name}', $5) \
            ON CONFLICT (perspective, global_position) DO UPDATE SET applications = s.applications + 1 \
            RETURNING s.applications), \
         c AS (SELECT EXISTS (SELECT 1 FROM soak_cured WHERE perspective = '{name}' AND global_position = $5) AS cured) \
         INSERT INTO soak_lanes AS l (perspective, stream_id, last_version, first_apply, healthy) \
         SELECT '{name}', $2, $6, a.applications = 1, ($1->>'poison') IS DISTINCT FROM '{name}' \
         FROM a, c WHERE NOT c.cured \
         ON CONFLICT (perspective, stream_id) DO UPDATE SET \
            healthy = EXCLUDED.healthy, \
            disorders = l.disorders + CASE WHEN EXCLUDED.first_apply AND EXCLUDED.last_version <= l.last_version THEN 1 ELSE 0 END, \
            last_version = GREATEST(l.last_version, EXCLUDED.last_version), \
            first_apply = EXCLUDED.first_apply"
    )
}

/// The `reset` statement of perspective `name` (used by `vantage perspectives rebuild`).
pub fn reset_statement(name: &str) -> String {
    debug_assert!(name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
    format!(
        "WITH d AS (DELETE FROM soak_applied WHERE perspective = '{name}') \
         DELETE FROM soak_lanes WHERE perspective = '{name}'"
    )
}

/// Appends one event to each stream of the batch and records it in `soak_produced`, in one
/// statement (one transaction).
const APPEND: &str = "
INSERT INTO soak_produced (global_position, stream_id, stream_version, event_type, poison, poison_stream)
SELECT a.global_position, u.stream_id, a.stream_version, u.event_type, u.poison, u.poison_stream
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bool[]) WITH ORDINALITY
         AS u(stream_id, event_type, poison, poison_stream, n)
CROSS JOIN LATERAL append_events(u.stream_id, NULL, jsonb_build_array(jsonb_build_object(
    'event_type', u.event_type,
    'data', CASE WHEN u.poison IS NULL THEN jsonb_build_object('n', u.n)
                 ELSE jsonb_build_object('n', u.n, 'poison', u.poison) END))) AS a";

/// One event of a producer's batch.
#[derive(Clone, Debug)]
pub struct SoakEvent {
    /// Its stream.
    pub stream_id: Uuid,
    /// Its type.
    pub event_type: &'static str,
    /// The perspective it poisons, if any.
    pub poison: Option<String>,
    /// Whether its stream is one that receives poison events.
    pub poison_stream: bool,
}

/// The expected outcome of one perspective: which event types it subscribes to.
#[derive(Clone, Debug)]
pub struct Subscription {
    /// The perspective.
    pub perspective: String,
    /// Its event types.
    pub event_types: Vec<String>,
}

/// The read model's verdict at the end of a run (every count but the totals must be zero).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Accounting {
    /// Events the producer appended.
    pub appended: u64,
    /// (event, perspective) pairs expected to be applied (healthy, or poison cured and requeued).
    pub expected_applies: u64,
    /// Of those, never applied.
    pub lost: u64,
    /// Applied more than once.
    pub applied_twice: u64,
    /// Applied for the first time behind a later version of their lane.
    pub out_of_order: u64,
    /// Applied although nothing expected it (an uncured poison event).
    pub unexpected_applies: u64,
    /// Healthy events applied while an earlier poison event of their lane was not yet
    /// dead-lettered (the head-of-line gate broken).
    pub applied_past_poison: u64,
    /// (poison event, perspective) pairs that must end dead-lettered.
    pub poison: u64,
    /// Of those, dead-lettered exactly as required (one open dead letter, every dead letter of
    /// it after exactly max + 1 claims, or more only as [`poison_cut`](Self::poison_cut) allows).
    pub poison_dead_lettered: u64,
    /// Poison events (cured ones included) dead-lettered after more than max + 1 claims inside
    /// a window where a claim's answer can be lost: a session-cutting fault (SIGKILL,
    /// PostgreSQL restart, terminated backends, black hole) until a lease and 30 s after it.
    /// A claim that committed while its session was cut, or whose daemon died before its
    /// dead-letter move, is one the daemon never acted on; the row is claimed again when the
    /// lease lapses, and every claim counts. Allowed, and reported.
    pub poison_cut: u64,
    /// Poison events not dead-lettered as required.
    pub poison_wrong: u64,
    /// Poison events cured and requeued by the operator phase.
    pub cured: u64,
    /// Cured events that are still (or again) dead-lettered.
    pub cured_still_dead: u64,
    /// Dead letters of events that never failed by design.
    pub healthy_dead_lettered: u64,
    /// Of those, how many had no recorded apply failure (dead-lettered by claims alone).
    pub healthy_dead_lettered_without_failure: u64,
    /// Work rows of the soak's perspectives left at the end.
    pub stranded: u64,
    /// Up to sixteen examples of what went wrong, for the report.
    pub examples: Vec<String>,
    /// When an event was lost, a cured event stayed dead, or a poison event was dead-lettered
    /// after the wrong number of claims: the whole record of each such event (for the file
    /// the run keeps, not the report).
    #[serde(skip)]
    pub forensics: Vec<String>,
}

/// Lag of applies (append → applied), seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Lag {
    /// Events sampled.
    pub samples: u64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// The largest.
    pub max: f64,
}

/// What a daemon's instance row and its sessions say.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InstanceSessions {
    /// Its instance id, once registered.
    pub instance_id: Option<Uuid>,
    /// Its sessions in `pg_stat_activity`.
    pub connections: u64,
}

/// The soak's statements, on the soak schema's store.
#[derive(Clone, Debug)]
pub struct SoakStore {
    store: Store,
}

/// The CTEs the proof and the forensics share (so they cannot disagree on what was expected):
/// `subs` the (perspective, event type) pairs subscribed (`$1`/`$2`), `names` the perspectives,
/// `expected` every (perspective, event) that must be applied: healthy, or poison cured.
macro_rules! subscribed_and_expected {
    () => {
        "subs AS (SELECT * FROM unnest($1::text[], $2::text[]) AS s(perspective, event_type)),
names AS (SELECT DISTINCT perspective FROM subs),
expected AS (
    SELECT s.perspective, p.global_position
    FROM soak_produced p JOIN subs s ON s.event_type = p.event_type
    WHERE p.poison IS DISTINCT FROM s.perspective
       OR EXISTS (SELECT 1 FROM soak_cured c
                  WHERE c.perspective = s.perspective AND c.global_position = p.global_position)),"
    };
}

/// The proof in one statement (one snapshot): `$1`/`$2` the (perspective, event type) pairs
/// subscribed, `$3` max + 1 (the claims after which a poison event must be dead-lettered),
/// `$4`/`$5` the windows in which a claim's answer can be lost (see [`Accounting::poison_cut`]).
const ACCOUNT: &str = concat!(
    "
WITH ",
    subscribed_and_expected!(),
    "
cuts AS (SELECT * FROM unnest($4::timestamptz[], $5::timestamptz[]) AS c(from_at, to_at)),
-- A dead letter's claims are right at max + 1, or above it inside a window where a claim's
-- answer can be lost; 'over' marks the second kind.
claims_ok AS (
    SELECT d.perspective_name AS perspective, d.global_position,
           d.attempts_when_dlq = $3
           OR (d.attempts_when_dlq > $3 AND EXISTS (SELECT 1 FROM cuts
                   WHERE d.dead_lettered_at BETWEEN cuts.from_at AND cuts.to_at)) AS ok,
           d.attempts_when_dlq > $3 AS over
    FROM wh_dead_letters d
    UNION ALL
    SELECT r.perspective, r.global_position,
           r.attempts_when_dlq = $3
           OR (r.attempts_when_dlq > $3 AND EXISTS (SELECT 1 FROM cuts
                   WHERE r.dead_lettered_at BETWEEN cuts.from_at AND cuts.to_at)),
           r.attempts_when_dlq > $3
    FROM soak_requeued r),
poison AS (
    SELECT p.poison AS perspective, p.global_position, p.stream_id, p.stream_version
    FROM soak_produced p
    WHERE p.poison IN (SELECT perspective FROM names)
      AND NOT EXISTS (SELECT 1 FROM soak_cured c
                      WHERE c.perspective = p.poison AND c.global_position = p.global_position)),
healthy_dead AS (
    SELECT d.failures_when_dlq FROM wh_dead_letters d JOIN soak_produced p USING (global_position)
    WHERE d.perspective_name IN (SELECT perspective FROM names)
      AND p.poison IS DISTINCT FROM d.perspective_name)
SELECT
    (SELECT count(*) FROM soak_produced),
    (SELECT count(*) FROM expected),
    (SELECT count(*) FROM expected e WHERE NOT EXISTS (SELECT 1 FROM soak_applied a
        WHERE a.perspective = e.perspective AND a.global_position = e.global_position)),
    (SELECT count(*) FROM soak_applied WHERE applications > 1
        AND perspective IN (SELECT perspective FROM names)),
    (SELECT COALESCE(sum(disorders), 0)::bigint FROM soak_lanes
        WHERE perspective IN (SELECT perspective FROM names)),
    (SELECT count(*) FROM soak_applied a WHERE a.perspective IN (SELECT perspective FROM names)
        AND NOT EXISTS (SELECT 1 FROM expected e
                        WHERE e.perspective = a.perspective AND e.global_position = a.global_position)),
    (SELECT count(*) FROM poison x
        JOIN soak_produced h ON h.stream_id = x.stream_id AND h.stream_version > x.stream_version
        JOIN soak_applied a ON a.perspective = x.perspective AND a.global_position = h.global_position
        WHERE a.applied_at < COALESCE((SELECT min(h.at) FROM wh_dead_letters d
              JOIN wh_dead_letter_history h ON h.dead_letter_id = d.dead_letter_id AND h.kind = 'Exhausted'
              WHERE d.perspective_name = x.perspective AND d.global_position = x.global_position),
              'infinity')),
    (SELECT count(*) FROM poison),
    (SELECT count(*) FROM poison x
        WHERE (SELECT count(*) FROM wh_dead_letters d WHERE d.perspective_name = x.perspective
                 AND d.global_position = x.global_position AND d.status = 'exhausted') = 1
          AND NOT EXISTS (SELECT 1 FROM claims_ok k WHERE k.perspective = x.perspective
                 AND k.global_position = x.global_position AND NOT k.ok)),
    (SELECT count(*) FROM soak_cured WHERE perspective IN (SELECT perspective FROM names)),
    (SELECT count(*) FROM soak_cured c WHERE c.perspective IN (SELECT perspective FROM names)
        AND (EXISTS (SELECT 1 FROM wh_dead_letters d WHERE d.perspective_name = c.perspective
                     AND d.global_position = c.global_position AND d.status = 'exhausted')
             OR EXISTS (SELECT 1 FROM claims_ok k WHERE k.perspective = c.perspective
                     AND k.global_position = c.global_position AND NOT k.ok))),
    (SELECT count(*) FROM healthy_dead),
    (SELECT count(*) FROM healthy_dead WHERE failures_when_dlq = 0),
    (SELECT count(*) FROM wh_perspective_events
        WHERE perspective_name IN (SELECT perspective FROM names)),
    (SELECT count(DISTINCT (k.perspective, k.global_position)) FROM claims_ok k
        WHERE k.perspective IN (SELECT perspective FROM names) AND k.ok AND k.over)"
);

/// Up to sixteen lines naming what broke a rule, for the report: `$1` the perspectives, `$2`
/// max + 1.
const EXAMPLES: &str = "
(SELECT 'healthy event dead-lettered: ' || d.perspective_name || ' position ' || d.global_position
        || ' after ' || d.attempts_when_dlq || ' claims and ' || d.failures_when_dlq
        || ' apply failures (' || d.failure_reason || ')'
 FROM wh_dead_letters d JOIN soak_produced p USING (global_position)
 WHERE d.perspective_name = ANY($1) AND p.poison IS DISTINCT FROM d.perspective_name
 ORDER BY d.dead_lettered_at LIMIT 4)
UNION ALL
(SELECT 'poison event dead-lettered after ' || d.attempts_when_dlq || ' claims (expected '
        || $2 || '): ' || d.perspective_name || ' position ' || d.global_position
 FROM wh_dead_letters d JOIN soak_produced p USING (global_position)
 WHERE d.perspective_name = ANY($1) AND p.poison = d.perspective_name
   AND d.attempts_when_dlq <> $2
 ORDER BY d.dead_lettered_at LIMIT 3)
UNION ALL
(SELECT 'lane applied out of order ' || disorders || ' time(s): ' || perspective || ' stream ' || stream_id
        || ' (highest version ' || last_version || ')'
 FROM soak_lanes WHERE perspective = ANY($1) AND disorders > 0
 ORDER BY disorders DESC LIMIT 3)
UNION ALL
(SELECT 'applied ' || applications || ' times: ' || perspective || ' position ' || global_position
 FROM soak_applied WHERE perspective = ANY($1) AND applications > 1
 ORDER BY global_position LIMIT 3)
UNION ALL
(SELECT 'cured and requeued, yet dead-lettered: ' || d.perspective_name || ' position '
        || d.global_position || ' after ' || d.attempts_when_dlq || ' claims'
 FROM wh_dead_letters d JOIN soak_cured c
   ON c.perspective = d.perspective_name AND c.global_position = d.global_position
 WHERE d.perspective_name = ANY($1) AND d.status = 'exhausted'
 ORDER BY d.global_position LIMIT 3)";

/// The whole record of every (perspective, event) that broke a rule of the proof (never applied,
/// cured yet still dead-lettered, poison dead-lettered after the wrong number of claims), one
/// line each, at most 20 per rule: the produced event, its work rows, its dead letters with their
/// history, what the operator phase did to it, its lane (vantage's and the read model's) and its
/// neighbours in the lane. `$1`/`$2` the subscriptions, `$3` max + 1. The daemons' logs name
/// events by their id, which the line carries.
const FORENSICS: &str = concat!(
    "
WITH ",
    subscribed_and_expected!(),
    "
subjects AS (
    (SELECT 'never applied' AS what, e.perspective, e.global_position FROM expected e
     WHERE NOT EXISTS (SELECT 1 FROM soak_applied a
                       WHERE a.perspective = e.perspective AND a.global_position = e.global_position)
     ORDER BY e.global_position LIMIT 20)
    UNION ALL
    (SELECT 'cured, yet dead-lettered or dead-lettered after other than max + 1 claims',
            c.perspective, c.global_position FROM soak_cured c
     WHERE c.perspective IN (SELECT perspective FROM names)
       AND (EXISTS (SELECT 1 FROM wh_dead_letters d WHERE d.perspective_name = c.perspective
                    AND d.global_position = c.global_position AND d.status = 'exhausted')
            OR EXISTS (SELECT 1 FROM soak_requeued r WHERE r.perspective = c.perspective
                    AND r.global_position = c.global_position AND r.attempts_when_dlq <> $3))
     ORDER BY c.global_position LIMIT 20)
    UNION ALL
    (SELECT DISTINCT 'poison dead-lettered after other than max + 1 claims',
            d.perspective_name, d.global_position
     FROM wh_dead_letters d JOIN soak_produced p USING (global_position)
     WHERE d.perspective_name IN (SELECT perspective FROM names)
       AND p.poison = d.perspective_name AND d.attempts_when_dlq <> $3
     LIMIT 20))
SELECT x.what || ': ' || x.perspective || ' position ' || x.global_position
    || E'\n  produced ' || COALESCE((SELECT row_to_json(p)::text FROM soak_produced p
                                     WHERE p.global_position = x.global_position), 'none')
    || E'\n  event id ' || COALESCE((SELECT e.event_id::text FROM wh_event_store e
                                     WHERE e.global_position = x.global_position), 'none')
    || E'\n  work rows ' || COALESCE((SELECT json_agg(w)::text FROM wh_perspective_events w
                                      WHERE w.perspective_name = x.perspective
                                        AND w.global_position = x.global_position), 'none')
    || E'\n  dead letters ' || COALESCE((SELECT json_agg(json_build_object(
            'id', d.dead_letter_id, 'status', d.status, 'claims', d.attempts_when_dlq,
            'failures', d.failures_when_dlq, 'reason', d.failure_reason,
            'at', d.dead_lettered_at, 'by', d.dead_lettered_by, 'changed', d.status_changed_at,
            'history', (SELECT json_agg(json_build_object('kind', h.kind, 'at', h.at,
                                                          'actor', h.actor, 'detail', h.detail)
                                        ORDER BY h.history_id)
                        FROM wh_dead_letter_history h WHERE h.dead_letter_id = d.dead_letter_id))
            ORDER BY d.dead_lettered_at)::text
        FROM wh_dead_letters d
        WHERE d.perspective_name = x.perspective AND d.global_position = x.global_position), 'none')
    || E'\n  operator ' || json_build_object(
            'cured', EXISTS (SELECT 1 FROM soak_cured c WHERE c.perspective = x.perspective
                             AND c.global_position = x.global_position),
            'requeued_after_claims', (SELECT json_agg(r.attempts_when_dlq) FROM soak_requeued r
                                      WHERE r.perspective = x.perspective
                                        AND r.global_position = x.global_position))::text
    || E'\n  lane ' || COALESCE((SELECT row_to_json(l)::text FROM wh_perspective_lanes l
                                 JOIN soak_produced p ON p.stream_id = l.stream_id
                                 WHERE p.global_position = x.global_position
                                   AND l.perspective_name = x.perspective), 'none')
    || E'\n  read-model lane ' || COALESCE((SELECT row_to_json(l)::text FROM soak_lanes l
                                 JOIN soak_produced p ON p.stream_id = l.stream_id
                                 WHERE p.global_position = x.global_position
                                   AND l.perspective = x.perspective), 'none')
    || E'\n  neighbours ' || COALESCE((SELECT json_agg(json_build_object(
            'version', n.stream_version, 'position', n.global_position, 'type', n.event_type,
            'poison', n.poison, 'appended_at', n.appended_at, 'applied_at', a.applied_at,
            'applications', a.applications) ORDER BY n.stream_version)::text
        FROM soak_produced p
        JOIN soak_produced n ON n.stream_id = p.stream_id
                            AND n.stream_version BETWEEN p.stream_version - 3 AND p.stream_version + 3
        LEFT JOIN soak_applied a ON a.perspective = x.perspective
                                AND a.global_position = n.global_position
        WHERE p.global_position = x.global_position), 'none')
FROM subjects x"
);

impl SoakStore {
    /// Wraps a store whose schema is [`SOAK_SCHEMA`].
    pub fn new(store: Store) -> Self {
        SoakStore { store }
    }

    fn pool(&self) -> &sqlx::PgPool {
        self.store.pool()
    }

    /// Drops and recreates the soak schema, migrates it and creates the soak's tables.
    pub async fn recreate_schema(&self) -> Result<(), StoreError> {
        sqlx::query("DROP SCHEMA IF EXISTS vantage_soak CASCADE")
            .execute(self.pool())
            .await?;
        self.store.migrate().await?;
        sqlx::raw_sql(CREATE_TABLES).execute(self.pool()).await?;
        Ok(())
    }

    /// The server's `max_connections` and the sessions open now.
    pub async fn connection_room(&self) -> Result<(u64, u64), StoreError> {
        let row = sqlx::query(
            "SELECT current_setting('max_connections')::bigint, \
                    current_setting('superuser_reserved_connections')::bigint, \
                    (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')",
        )
        .fetch_one(self.pool())
        .await?;
        let max: i64 = row.get(0);
        let reserved: i64 = row.get(1);
        let open: i64 = row.get(2);
        Ok(((max - reserved).max(0) as u64, open.max(0) as u64))
    }

    /// Appends `batch` (one event per stream, distinct streams) and records it; returns how
    /// many were appended.
    pub async fn append(&self, batch: &[SoakEvent]) -> Result<u64, StoreError> {
        let streams: Vec<Uuid> = batch.iter().map(|e| e.stream_id).collect();
        let types: Vec<&str> = batch.iter().map(|e| e.event_type).collect();
        let poison: Vec<Option<&str>> = batch.iter().map(|e| e.poison.as_deref()).collect();
        let poison_streams: Vec<bool> = batch.iter().map(|e| e.poison_stream).collect();
        let done = sqlx::query(APPEND)
            .bind(&streams)
            .bind(&types)
            .bind(&poison)
            .bind(&poison_streams)
            .execute(self.pool())
            .await?;
        Ok(done.rows_affected())
    }

    /// Work rows left of `perspectives`, and the age of the oldest of a stream that never
    /// receives poison (the live lag, for progress lines), seconds.
    pub async fn backlog(&self, perspectives: &[String]) -> Result<(u64, f64), StoreError> {
        let row = sqlx::query(
            "SELECT count(*), COALESCE(extract(epoch FROM clock_timestamp() - \
                 min(p.appended_at) FILTER (WHERE NOT p.poison_stream)), 0)::float8 \
             FROM wh_perspective_events w JOIN soak_produced p USING (global_position) \
             WHERE w.perspective_name = ANY($1)",
        )
        .bind(perspectives)
        .fetch_one(self.pool())
        .await?;
        Ok((row.get::<i64, _>(0).max(0) as u64, row.get(1)))
    }

    /// Open (`exhausted`) dead letters of `perspective`, and how many.
    pub async fn open_dead_letters(&self, perspective: &str) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM wh_dead_letters WHERE perspective_name = $1 AND status = 'exhausted'",
        )
        .bind(perspective)
        .fetch_one(self.pool())
        .await?;
        Ok(n.max(0) as u64)
    }

    /// Before a requeue: records the claims after which each open dead letter of
    /// `perspective` was dead-lettered (a dead letter dead-lettered again overwrites them),
    /// and cures every other one (so its requeue must apply); returns how many were cured.
    pub async fn cure_half(&self, perspective: &str) -> Result<u64, StoreError> {
        sqlx::query(
            "INSERT INTO soak_requeued (perspective, global_position, attempts_when_dlq, dead_lettered_at) \
             SELECT perspective_name, global_position, attempts_when_dlq, dead_lettered_at FROM wh_dead_letters \
             WHERE perspective_name = $1 AND status = 'exhausted'",
        )
        .bind(perspective)
        .execute(self.pool())
        .await?;
        let done = sqlx::query(
            "INSERT INTO soak_cured (perspective, global_position) \
             SELECT perspective_name, global_position FROM ( \
                 SELECT perspective_name, global_position, \
                        row_number() OVER (ORDER BY global_position) AS n \
                 FROM wh_dead_letters WHERE perspective_name = $1 AND status = 'exhausted') d \
             WHERE n % 2 = 0 ON CONFLICT DO NOTHING",
        )
        .bind(perspective)
        .execute(self.pool())
        .await?;
        Ok(done.rows_affected())
    }

    /// Terminates every session of a daemon (`application_name` `vantage <instance id>`);
    /// returns how many were signalled.
    pub async fn terminate_daemon_backends(&self) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name ~ '^vantage [0-9a-f]{8}-[0-9a-f]{4}-' AND pid <> pg_backend_pid()",
        )
        .fetch_one(self.pool())
        .await?;
        Ok(n.max(0) as u64)
    }

    /// The instance registered by process `pid`, and its sessions.
    pub async fn instance_of(&self, pid: u32) -> Result<InstanceSessions, StoreError> {
        let row = sqlx::query(
            "SELECT i.instance_id, \
                    (SELECT count(*) FROM pg_stat_activity a \
                      WHERE a.application_name = 'vantage ' || i.instance_id::text) \
             FROM wh_service_instances i WHERE i.process_id = $1 \
             ORDER BY i.started_at DESC LIMIT 1",
        )
        .bind(pid as i32)
        .fetch_optional(self.pool())
        .await?;
        Ok(match row {
            Some(r) => InstanceSessions {
                instance_id: Some(r.get(0)),
                connections: r.get::<i64, _>(1).max(0) as u64,
            },
            None => InstanceSessions::default(),
        })
    }

    /// Lag of the sampled applies (every tenth position) of `perspectives`, on streams that
    /// never receive poison, of events appended in `[from, to)`.
    pub async fn lag(
        &self,
        perspectives: &[String],
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<Lag, StoreError> {
        let row = sqlx::query(
            "SELECT count(*), \
                    COALESCE(percentile_cont(0.5) WITHIN GROUP (ORDER BY l), 0)::float8, \
                    COALESCE(percentile_cont(0.99) WITHIN GROUP (ORDER BY l), 0)::float8, \
                    COALESCE(max(l), 0)::float8 \
             FROM (SELECT extract(epoch FROM a.applied_at - p.appended_at) AS l \
                   FROM soak_produced p JOIN soak_applied a USING (global_position) \
                   WHERE p.appended_at >= $2 AND p.appended_at < $3 AND NOT p.poison_stream \
                     AND p.global_position % 10 = 0 AND a.perspective = ANY($1)) s",
        )
        .bind(perspectives)
        .bind(from)
        .bind(to)
        .fetch_one(self.pool())
        .await?;
        Ok(Lag {
            samples: row.get::<i64, _>(0).max(0) as u64,
            p50: row.get(1),
            p99: row.get(2),
            max: row.get(3),
        })
    }

    /// Per second of append time in `[from, to)` (seconds since `from`): the 99th percentile
    /// of the sampled lag of the events appended in it (as [`lag`](Self::lag) samples them),
    /// in order; a second with no sample is left out.
    pub async fn lag_by_second(
        &self,
        perspectives: &[String],
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<Vec<(f64, f64)>, StoreError> {
        let rows = sqlx::query(
            "SELECT floor(extract(epoch FROM p.appended_at - $2))::float8 AS second, \
                    percentile_cont(0.99) WITHIN GROUP \
                        (ORDER BY extract(epoch FROM a.applied_at - p.appended_at))::float8 \
             FROM soak_produced p JOIN soak_applied a USING (global_position) \
             WHERE p.appended_at >= $2 AND p.appended_at < $3 AND NOT p.poison_stream \
               AND p.global_position % 10 = 0 AND a.perspective = ANY($1) \
             GROUP BY 1 ORDER BY 1",
        )
        .bind(perspectives)
        .bind(from)
        .bind(to)
        .fetch_all(self.pool())
        .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// The proof from the read model (see [`Accounting`]); `max_attempts` is
    /// `worker.max_perspective_event_attempts`.
    pub async fn account(
        &self,
        subscriptions: &[Subscription],
        max_attempts: u32,
        cuts: &[(DateTime<Utc>, DateTime<Utc>)],
    ) -> Result<Accounting, StoreError> {
        let cut_from: Vec<DateTime<Utc>> = cuts.iter().map(|c| c.0).collect();
        let cut_to: Vec<DateTime<Utc>> = cuts.iter().map(|c| c.1).collect();
        let mut perspectives = Vec::new();
        let mut types = Vec::new();
        for s in subscriptions {
            for t in &s.event_types {
                perspectives.push(s.perspective.clone());
                types.push(t.clone());
            }
        }
        let claims = max_attempts as i32 + 1;
        let row = sqlx::query(ACCOUNT)
            .bind(&perspectives)
            .bind(&types)
            .bind(claims)
            .bind(&cut_from)
            .bind(&cut_to)
            .fetch_one(self.pool())
            .await?;
        let n = |i: usize| row.get::<i64, _>(i).max(0) as u64;
        let poison_left = n(7);
        let cured = n(9);
        let names: Vec<String> = subscriptions
            .iter()
            .map(|s| s.perspective.clone())
            .collect();
        let examples = sqlx::query_scalar::<_, String>(EXAMPLES)
            .bind(&names)
            .bind(claims)
            .fetch_all(self.pool())
            .await?;
        let poison_wrong = poison_left - n(8).min(poison_left);
        let forensics = if n(2) > 0 || n(10) > 0 || poison_wrong > 0 {
            sqlx::query_scalar::<_, String>(FORENSICS)
                .bind(&perspectives)
                .bind(&types)
                .bind(claims)
                .fetch_all(self.pool())
                .await?
        } else {
            Vec::new()
        };
        Ok(Accounting {
            appended: n(0),
            expected_applies: n(1),
            lost: n(2),
            applied_twice: n(3),
            out_of_order: n(4),
            unexpected_applies: n(5),
            applied_past_poison: n(6),
            poison: poison_left + cured,
            poison_dead_lettered: n(8),
            poison_wrong,
            cured,
            cured_still_dead: n(10),
            healthy_dead_lettered: n(11),
            healthy_dead_lettered_without_failure: n(12),
            stranded: n(13),
            poison_cut: n(14),
            examples,
            forensics,
        })
    }
}

/// A session the soak holds open on purpose (an idle transaction, an old snapshot, an idle
/// connection), outside any pool so nothing recycles it.
pub struct HeldSession {
    conn: PgConnection,
}

impl HeldSession {
    /// Opens a session with `options` (the soak schema's connection options).
    pub async fn open(options: &PgConnectOptions) -> Result<HeldSession, StoreError> {
        let conn =
            tokio::time::timeout(Duration::from_secs(10), PgConnection::connect_with(options))
                .await
                .map_err(|_| StoreError::Timeout(Duration::from_secs(10)))??;
        Ok(HeldSession { conn })
    }

    /// Begins a transaction that holds a transaction id, and leaves it idle.
    pub async fn hold_xid(&mut self) -> Result<(), StoreError> {
        sqlx::raw_sql("BEGIN; SELECT txid_current()")
            .execute(&mut self.conn)
            .await?;
        Ok(())
    }

    /// Begins a REPEATABLE READ transaction and takes its snapshot, and leaves it idle.
    pub async fn hold_snapshot(&mut self) -> Result<(), StoreError> {
        sqlx::raw_sql(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM wh_service_instances",
        )
        .execute(&mut self.conn)
        .await?;
        Ok(())
    }

    /// Ends the session (a transaction left open is rolled back by the server).
    pub async fn close(self) {
        let _ = self.conn.close().await;
    }
}
