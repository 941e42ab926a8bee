-- vantage schema, part 1: tables and indexes.
--
-- Every object is created unqualified: the migration runner sets search_path to the configured
-- schema (database.schema), so any schema name works.
--
-- Design notes that shape the indexes of wh_perspective_events (the queue table):
-- * No index mentions a lease column (instance_id, lease_expiry, scheduled_for, attempts), so
--   leasing, renewing and parking a row are HOT updates: no index churn, little WAL.
-- * The lane index (perspective_name, stream_id, stream_version) serves every claim: heads of
--   lanes are found by a loose index scan, one probe per lane, never by aggregating the backlog.

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

CREATE TABLE wh_perspectives (
    perspective_name text        PRIMARY KEY,
    event_types      text[]      NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE wh_perspective_events (
    event_work_id    uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    stream_id        uuid        NOT NULL,
    event_id         uuid        NOT NULL,
    global_position  bigint      NOT NULL,
    stream_version   int         NOT NULL,
    perspective_name text        NOT NULL,
    attempts         int         NOT NULL DEFAULT 0,
    failures         int         NOT NULL DEFAULT 0,
    last_error       text,
    instance_id      uuid,
    lease_expiry     timestamptz,
    scheduled_for    timestamptz NOT NULL DEFAULT now(),
    created_at       timestamptz NOT NULL DEFAULT now(),
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

-- One lane = (perspective, stream); events of a lane are applied in stream_version order.
CREATE INDEX wh_perspective_events_lane_idx
    ON wh_perspective_events (perspective_name, stream_id, stream_version);

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
    CONSTRAINT wh_dead_letters_status_check
        CHECK (status IN ('exhausted', 'resolved', 'purged', 'requeued')),
    -- The retry budget belongs to the message: one dead letter per (source, perspective, event),
    -- reopened if the event is exhausted again, never minted anew.
    CONSTRAINT wh_dead_letters_message_key UNIQUE (source_table, perspective_name, event_id)
);

CREATE INDEX wh_dead_letters_position_idx ON wh_dead_letters (global_position);
CREATE INDEX wh_dead_letters_open_idx ON wh_dead_letters (perspective_name, global_position)
    WHERE status = 'exhausted';

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

-- The history is an audit trail: make it append-only in the database, not only by convention.
CREATE FUNCTION wh_dead_letter_history_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'wh_dead_letter_history is append-only (% refused)', TG_OP
        USING ERRCODE = '55000';
END
$$;

CREATE TRIGGER wh_dead_letter_history_append_only
    BEFORE UPDATE OR DELETE ON wh_dead_letter_history
    FOR EACH ROW EXECUTE FUNCTION wh_dead_letter_history_append_only();
