-- vantage baseline, part 1 of 9: the tables and their indexes.
--
-- The baseline replaces the fourteen migrations written before vantage was first released; a
-- database migrated by those is refused (exit 78) with a message saying what to do. From here
-- on a change is a new migration, never an edit of these files; tests/golden/schema.sql is the
-- live text of every object, so a change shows in one reviewed diff.
--
-- Every object is created unqualified: the migration runner sets search_path to the configured
-- schema (database.schema), so any schema name works.
--
-- The rule every part follows: vantage is the read side. A producer's append (its latency, its
-- locks, its outcome) never depends on what vantage does. Producers only ever INSERT new rows
-- (the event, its work rows, its lane wake-ups); no row a producer writes is ever written by
-- anyone else while the producer's transaction is open, and no row anyone else writes is ever
-- written by a producer. So a producer never waits for vantage, vantage never waits for a
-- producer, and a REPEATABLE READ or SERIALIZABLE producer never fails because of vantage.
--
-- The work table's indexes:
-- * No index mentions a lease column (instance_id, lease_expiry, scheduled_for, attempts), so
--   leasing, renewing and parking a row are HOT updates: no index churn, little WAL.
-- * The lane index (perspective_name, stream_id, stream_version) serves every read of a lane:
--   its head, its prefix, whether it is empty.

-- The event store. Producers write it (append_events or a plain INSERT); vantage only reads it.
CREATE TABLE wh_event_store (
    global_position bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id        uuid        NOT NULL DEFAULT gen_random_uuid(),
    stream_id       uuid        NOT NULL,
    stream_version  int         NOT NULL,
    event_type      text        NOT NULL,
    event_data      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    metadata        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT wh_event_store_event_id_key UNIQUE (event_id),
    CONSTRAINT wh_event_store_stream_version_key UNIQUE (stream_id, stream_version),
    CONSTRAINT wh_event_store_stream_version_positive CHECK (stream_version > 0)
);

-- The registry: which perspective subscribes to which event types ('*' = every type). The
-- fan-out reads it (without locking it); daemons upsert it; operators pause and resume.
CREATE TABLE wh_perspectives (
    perspective_name text        PRIMARY KEY,
    event_types      text[]      NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    -- Paused: claims skip it, nothing is charged (vantage perspectives pause / quarantine).
    paused_at        timestamptz,
    paused_reason    text,
    paused_by        text,
    -- When it was last resumed: only dead letters after it count toward a quarantine.
    resumed_at       timestamptz,
    -- A rebuild under way (or interrupted): its history is re-queued up to this position, in
    -- chunks that commit one by one. Claims skip the perspective until the rebuild has queued
    -- all of it and cleared this, so no lane is applied with a gap.
    rebuild_up_to    bigint,
    rebuild_started_at timestamptz
);

-- The work rows: one per event and subscribed perspective. A lane is (perspective, stream);
-- the rows of a lane are applied in stream_version order.
CREATE TABLE wh_perspective_events (
    event_work_id    uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    stream_id        uuid        NOT NULL,
    event_id         uuid        NOT NULL,
    global_position  bigint      NOT NULL,
    stream_version   int         NOT NULL,
    perspective_name text        NOT NULL,
    -- Claims that changed the holder (one-based); bumped by the claim only, never by Rust.
    attempts         int         NOT NULL DEFAULT 0,
    -- Apply failures recorded, and the last one's text (carried into the dead letter).
    failures         int         NOT NULL DEFAULT 0,
    last_error       text,
    -- The lease: NULL = unleased.
    instance_id      uuid,
    lease_expiry     timestamptz,
    -- Not claimable before this (a failed row's backoff).
    scheduled_for    timestamptz NOT NULL DEFAULT now(),
    created_at       timestamptz NOT NULL DEFAULT now(),
    -- Whether the current lease's claim bumped attempts: a give-back refunds exactly that.
    refundable       boolean     NOT NULL DEFAULT false,
    CONSTRAINT wh_perspective_events_perspective_event_key UNIQUE (perspective_name, event_id)
) WITH (
    -- Room on each page for HOT updates of the lease columns.
    fillfactor = 70,
    -- A queue table: vacuum early so dead tuples do not pile up at the head of the lane index.
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02
);

CREATE INDEX wh_perspective_events_lane_idx
    ON wh_perspective_events (perspective_name, stream_id, stream_version);

-- The lane index (part 3): one row per lane with work, and when its head can next be claimed.
-- Written by vantage only, never by a producer.
CREATE TABLE wh_perspective_lanes (
    stream_id        uuid        NOT NULL,
    perspective_name text        NOT NULL,
    -- No claim of this lane's head can succeed before due_at (a hint: never later than that).
    due_at           timestamptz NOT NULL DEFAULT now(),
    -- The instance whose lease due_at was last set from (woken when it is gone).
    holder           uuid,
    PRIMARY KEY (stream_id, perspective_name)
) WITH (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 500,
    autovacuum_analyze_scale_factor = 0.02
);

CREATE INDEX wh_perspective_lanes_due_idx ON wh_perspective_lanes (perspective_name, due_at);

-- Lane wake-ups (part 3): every insert of work rows adds one row per lane it touched, in the
-- inserting transaction; claims fold them into the lane index. Insert-only for everyone but the
-- fold, no unique key and no index, so an insert here never waits and never conflicts.
CREATE TABLE wh_lane_wakeups (
    stream_id        uuid        NOT NULL,
    perspective_name text        NOT NULL
) WITH (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 1000
);

-- Daemon processes: registered, heartbeating; a silent one is dead and its leases are taken over.
CREATE TABLE wh_service_instances (
    instance_id       uuid        PRIMARY KEY,
    service_name      text        NOT NULL,
    host_name         text        NOT NULL,
    process_id        int         NOT NULL,
    version           text        NOT NULL,
    started_at        timestamptz NOT NULL DEFAULT now(),
    last_heartbeat_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE wh_dead_letters (
    dead_letter_id    uuid        PRIMARY KEY,
    source_table      text        NOT NULL,
    source_id         uuid        NOT NULL,
    stream_id         uuid        NOT NULL,
    event_id          uuid        NOT NULL,
    global_position   bigint      NOT NULL,
    stream_version    int         NOT NULL,
    event_type        text,
    perspective_name  text        NOT NULL,
    failure_reason    text        NOT NULL,
    error_text        text,
    attempts_when_dlq int         NOT NULL,
    failures_when_dlq int         NOT NULL,
    dead_lettered_at  timestamptz NOT NULL DEFAULT now(),
    dead_lettered_by  uuid,
    status            text        NOT NULL DEFAULT 'exhausted',
    status_changed_at timestamptz NOT NULL DEFAULT now(),
    -- (perspective, event type, SQLSTATE, masked error text), part 8; filled by the move, or by
    -- a trigger for any other writer.
    error_fingerprint text,
    CONSTRAINT wh_dead_letters_status_check
        CHECK (status IN ('exhausted', 'resolved', 'purged', 'requeued'))
);

-- The retry budget belongs to the message: one dead letter per (source, perspective, event)
-- that is not purged, reopened if the event is exhausted again, never minted anew.
CREATE UNIQUE INDEX wh_dead_letters_unpurged_message_key
    ON wh_dead_letters (source_table, perspective_name, event_id)
    WHERE status <> 'purged';
CREATE INDEX wh_dead_letters_position_idx ON wh_dead_letters (global_position);
CREATE INDEX wh_dead_letters_open_idx ON wh_dead_letters (perspective_name, global_position)
    WHERE status = 'exhausted';
-- Open dead letters by group: `dlq groups` from the index alone, and a group's members in
-- position order for requeue/purge --group.
CREATE INDEX wh_dead_letters_open_fingerprint_idx
    ON wh_dead_letters (error_fingerprint, global_position)
    INCLUDE (perspective_name, dead_lettered_at)
    WHERE status = 'exhausted';
-- A perspective's recent dead letters (every status), for the quarantine count.
CREATE INDEX wh_dead_letters_recent_idx
    ON wh_dead_letters (perspective_name, dead_lettered_at);

-- Every transition of a dead letter; append-only (a trigger refuses UPDATE and DELETE, part 6).
CREATE TABLE wh_dead_letter_history (
    history_id     bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    dead_letter_id uuid        NOT NULL REFERENCES wh_dead_letters (dead_letter_id),
    kind           text        NOT NULL,
    at             timestamptz NOT NULL DEFAULT now(),
    actor          text        NOT NULL,
    detail         text,
    CONSTRAINT wh_dead_letter_history_kind_check
        CHECK (kind IN ('Exhausted', 'ReplaySucceeded', 'ReplayFailed', 'Purged', 'Requeued'))
);

CREATE INDEX wh_dead_letter_history_letter_idx ON wh_dead_letter_history (dead_letter_id, at);
