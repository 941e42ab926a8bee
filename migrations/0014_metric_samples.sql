-- vantage 0014: a bounded per-minute history of each perspective, for the console's charts
-- (docs/operations.md, "The metric history").
--
-- The console is a process of its own, so what it charts lives here. One row per (minute,
-- perspective): the events applied in that minute and the highest backlog and lag sampled in
-- it. Each daemon's sampler upserts its rows every gauge round (15 s) in one statement:
-- `applied` adds the daemon's own count since its last write (several daemons sum, never
-- double), `backlog` and `lag_seconds` keep the greatest value seen (every daemon reads the
-- same tables, so order does not matter). Dead letters per minute are not stored: they are
-- counted from wh_dead_letters.dead_lettered_at.
--
-- Bounded: the same round deletes every row older than 24 hours, so the table holds at most
-- 1 440 rows per perspective. Nothing here is read or locked by producers or the drain.

CREATE TABLE wh_metric_samples (
    -- The minute (date_trunc('minute', now()) of the write).
    minute           timestamptz NOT NULL,
    perspective_name text        NOT NULL,
    -- Events applied (and completed) in this minute, summed over daemons.
    applied          bigint      NOT NULL DEFAULT 0 CHECK (applied >= 0),
    -- Work rows (pending + leased + parked): the highest sampled in this minute.
    backlog          bigint      CHECK (backlog >= 0),
    -- Age in seconds of the oldest work row: the highest sampled in this minute (NULL: none).
    lag_seconds      double precision CHECK (lag_seconds >= 0),
    -- The trim and the charts read by minute first.
    PRIMARY KEY (minute, perspective_name)
);
