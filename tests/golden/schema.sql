-- table wh_dead_letter_history
CREATE TABLE wh_dead_letter_history (
    history_id bigint NOT NULL GENERATED ALWAYS AS IDENTITY,
    dead_letter_id uuid NOT NULL,
    kind text NOT NULL,
    at timestamp with time zone NOT NULL DEFAULT now(),
    actor text NOT NULL,
    detail text
);

-- table wh_dead_letters
CREATE TABLE wh_dead_letters (
    dead_letter_id uuid NOT NULL,
    source_table text NOT NULL,
    source_id uuid NOT NULL,
    stream_id uuid NOT NULL,
    event_id uuid NOT NULL,
    global_position bigint NOT NULL,
    stream_version integer NOT NULL,
    event_type text,
    perspective_name text NOT NULL,
    failure_reason text NOT NULL,
    error_text text,
    attempts_when_dlq integer NOT NULL,
    failures_when_dlq integer NOT NULL,
    dead_lettered_at timestamp with time zone NOT NULL DEFAULT now(),
    dead_lettered_by uuid,
    status text NOT NULL DEFAULT 'exhausted'::text,
    status_changed_at timestamp with time zone NOT NULL DEFAULT now(),
    error_fingerprint text
);

-- table wh_event_store
CREATE TABLE wh_event_store (
    global_position bigint NOT NULL GENERATED ALWAYS AS IDENTITY,
    event_id uuid NOT NULL DEFAULT gen_random_uuid(),
    stream_id uuid NOT NULL,
    stream_version integer NOT NULL,
    event_type text NOT NULL,
    event_data jsonb NOT NULL DEFAULT '{}'::jsonb,
    metadata jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at timestamp with time zone NOT NULL DEFAULT now()
);

-- table wh_lane_wakeups WITH (autovacuum_vacuum_scale_factor=0, autovacuum_vacuum_threshold=1000, autovacuum_vacuum_insert_scale_factor=0, autovacuum_vacuum_insert_threshold=1000, vacuum_truncate=false)
CREATE TABLE wh_lane_wakeups (
    stream_id uuid NOT NULL,
    perspective_name text NOT NULL,
    min_version integer
);

-- table wh_metric_samples
CREATE TABLE wh_metric_samples (
    minute timestamp with time zone NOT NULL,
    perspective_name text NOT NULL,
    applied bigint NOT NULL DEFAULT 0,
    backlog bigint,
    lag_seconds double precision
);

-- table wh_perspective_events WITH (fillfactor=70, autovacuum_vacuum_scale_factor=0.01, autovacuum_vacuum_threshold=1000, autovacuum_vacuum_insert_scale_factor=0.05, autovacuum_analyze_scale_factor=0.02, vacuum_truncate=false)
CREATE TABLE wh_perspective_events (
    event_work_id uuid NOT NULL DEFAULT gen_random_uuid(),
    stream_id uuid NOT NULL,
    event_id uuid NOT NULL,
    global_position bigint NOT NULL,
    stream_version integer NOT NULL,
    perspective_name text NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    failures integer NOT NULL DEFAULT 0,
    last_error text,
    instance_id uuid,
    lease_expiry timestamp with time zone,
    scheduled_for timestamp with time zone NOT NULL DEFAULT now(),
    created_at timestamp with time zone NOT NULL DEFAULT now(),
    refundable boolean NOT NULL DEFAULT false,
    replay boolean NOT NULL DEFAULT false
);

-- table wh_perspective_lanes WITH (fillfactor=50, autovacuum_vacuum_scale_factor=0.01, autovacuum_vacuum_threshold=500, autovacuum_analyze_scale_factor=0.02, vacuum_truncate=false)
CREATE TABLE wh_perspective_lanes (
    stream_id uuid NOT NULL,
    perspective_name text NOT NULL,
    due_at timestamp with time zone NOT NULL DEFAULT now(),
    holder uuid
);

-- table wh_perspective_version_history
CREATE TABLE wh_perspective_version_history (
    history_id bigint NOT NULL GENERATED ALWAYS AS IDENTITY,
    perspective_name text NOT NULL,
    kind text NOT NULL,
    from_version integer,
    to_version integer,
    at timestamp with time zone NOT NULL DEFAULT now(),
    actor text NOT NULL,
    detail text
);

-- table wh_perspective_versions
CREATE TABLE wh_perspective_versions (
    perspective_name text NOT NULL,
    version integer NOT NULL,
    registry_name text NOT NULL,
    read_schema text NOT NULL,
    version_schema text NOT NULL,
    tables text[] NOT NULL,
    event_types text[] NOT NULL,
    statements jsonb NOT NULL,
    setup text NOT NULL,
    digest text NOT NULL,
    apply_statement text NOT NULL,
    state text NOT NULL DEFAULT 'building'::text,
    backfill_position bigint NOT NULL DEFAULT 0,
    backfill_target bigint,
    backfill_horizon xid8,
    backfill_applied bigint NOT NULL DEFAULT 0,
    backfill_started_at timestamp with time zone,
    backfill_done_at timestamp with time zone,
    created_at timestamp with time zone NOT NULL DEFAULT now(),
    live_since timestamp with time zone,
    retired_at timestamp with time zone
);

-- table wh_perspectives
CREATE TABLE wh_perspectives (
    perspective_name text NOT NULL,
    event_types text[] NOT NULL,
    created_at timestamp with time zone NOT NULL DEFAULT now(),
    updated_at timestamp with time zone NOT NULL DEFAULT now(),
    paused_at timestamp with time zone,
    paused_reason text,
    paused_by text,
    resumed_at timestamp with time zone,
    rebuild_up_to bigint,
    rebuild_started_at timestamp with time zone
);

-- table wh_service_instances
CREATE TABLE wh_service_instances (
    instance_id uuid NOT NULL,
    service_name text NOT NULL,
    host_name text NOT NULL,
    process_id integer NOT NULL,
    version text NOT NULL,
    started_at timestamp with time zone NOT NULL DEFAULT now(),
    last_heartbeat_at timestamp with time zone NOT NULL DEFAULT now()
);

-- constraint wh_dead_letter_history.wh_dead_letter_history_dead_letter_id_fkey
ALTER TABLE wh_dead_letter_history ADD CONSTRAINT wh_dead_letter_history_dead_letter_id_fkey FOREIGN KEY (dead_letter_id) REFERENCES wh_dead_letters(dead_letter_id);

-- constraint wh_dead_letter_history.wh_dead_letter_history_kind_check
ALTER TABLE wh_dead_letter_history ADD CONSTRAINT wh_dead_letter_history_kind_check CHECK ((kind = ANY (ARRAY['Exhausted'::text, 'ReplaySucceeded'::text, 'ReplayFailed'::text, 'Purged'::text, 'Requeued'::text])));

-- constraint wh_dead_letter_history.wh_dead_letter_history_pkey
ALTER TABLE wh_dead_letter_history ADD CONSTRAINT wh_dead_letter_history_pkey PRIMARY KEY (history_id);

-- constraint wh_dead_letters.wh_dead_letters_pkey
ALTER TABLE wh_dead_letters ADD CONSTRAINT wh_dead_letters_pkey PRIMARY KEY (dead_letter_id);

-- constraint wh_dead_letters.wh_dead_letters_status_check
ALTER TABLE wh_dead_letters ADD CONSTRAINT wh_dead_letters_status_check CHECK ((status = ANY (ARRAY['exhausted'::text, 'resolved'::text, 'purged'::text, 'requeued'::text])));

-- constraint wh_event_store.wh_event_store_event_id_key
ALTER TABLE wh_event_store ADD CONSTRAINT wh_event_store_event_id_key UNIQUE (event_id);

-- constraint wh_event_store.wh_event_store_pkey
ALTER TABLE wh_event_store ADD CONSTRAINT wh_event_store_pkey PRIMARY KEY (global_position);

-- constraint wh_event_store.wh_event_store_stream_version_key
ALTER TABLE wh_event_store ADD CONSTRAINT wh_event_store_stream_version_key UNIQUE (stream_id, stream_version);

-- constraint wh_event_store.wh_event_store_stream_version_positive
ALTER TABLE wh_event_store ADD CONSTRAINT wh_event_store_stream_version_positive CHECK ((stream_version > 0));

-- constraint wh_metric_samples.wh_metric_samples_applied_check
ALTER TABLE wh_metric_samples ADD CONSTRAINT wh_metric_samples_applied_check CHECK ((applied >= 0));

-- constraint wh_metric_samples.wh_metric_samples_backlog_check
ALTER TABLE wh_metric_samples ADD CONSTRAINT wh_metric_samples_backlog_check CHECK ((backlog >= 0));

-- constraint wh_metric_samples.wh_metric_samples_lag_seconds_check
ALTER TABLE wh_metric_samples ADD CONSTRAINT wh_metric_samples_lag_seconds_check CHECK ((lag_seconds >= (0)::double precision));

-- constraint wh_metric_samples.wh_metric_samples_pkey
ALTER TABLE wh_metric_samples ADD CONSTRAINT wh_metric_samples_pkey PRIMARY KEY (minute, perspective_name);

-- constraint wh_perspective_events.wh_perspective_events_perspective_event_key
ALTER TABLE wh_perspective_events ADD CONSTRAINT wh_perspective_events_perspective_event_key UNIQUE (perspective_name, event_id);

-- constraint wh_perspective_events.wh_perspective_events_pkey
ALTER TABLE wh_perspective_events ADD CONSTRAINT wh_perspective_events_pkey PRIMARY KEY (event_work_id);

-- constraint wh_perspective_lanes.wh_perspective_lanes_pkey
ALTER TABLE wh_perspective_lanes ADD CONSTRAINT wh_perspective_lanes_pkey PRIMARY KEY (stream_id, perspective_name);

-- constraint wh_perspective_version_history.wh_perspective_version_history_kind_check
ALTER TABLE wh_perspective_version_history ADD CONSTRAINT wh_perspective_version_history_kind_check CHECK ((kind = ANY (ARRAY['Registered'::text, 'Live'::text, 'Cutover'::text, 'Rollback'::text, 'Retired'::text])));

-- constraint wh_perspective_version_history.wh_perspective_version_history_pkey
ALTER TABLE wh_perspective_version_history ADD CONSTRAINT wh_perspective_version_history_pkey PRIMARY KEY (history_id);

-- constraint wh_perspective_versions.wh_perspective_versions_pkey
ALTER TABLE wh_perspective_versions ADD CONSTRAINT wh_perspective_versions_pkey PRIMARY KEY (perspective_name, version);

-- constraint wh_perspective_versions.wh_perspective_versions_registry_name_key
ALTER TABLE wh_perspective_versions ADD CONSTRAINT wh_perspective_versions_registry_name_key UNIQUE (registry_name);

-- constraint wh_perspective_versions.wh_perspective_versions_state_check
ALTER TABLE wh_perspective_versions ADD CONSTRAINT wh_perspective_versions_state_check CHECK ((state = ANY (ARRAY['building'::text, 'ready'::text, 'live'::text, 'retired'::text])));

-- constraint wh_perspective_versions.wh_perspective_versions_version_check
ALTER TABLE wh_perspective_versions ADD CONSTRAINT wh_perspective_versions_version_check CHECK ((version >= 1));

-- constraint wh_perspective_versions.wh_perspective_versions_version_schema_key
ALTER TABLE wh_perspective_versions ADD CONSTRAINT wh_perspective_versions_version_schema_key UNIQUE (version_schema);

-- constraint wh_perspectives.wh_perspectives_pkey
ALTER TABLE wh_perspectives ADD CONSTRAINT wh_perspectives_pkey PRIMARY KEY (perspective_name);

-- constraint wh_service_instances.wh_service_instances_pkey
ALTER TABLE wh_service_instances ADD CONSTRAINT wh_service_instances_pkey PRIMARY KEY (instance_id);

-- index wh_dead_letter_history_letter_idx
CREATE INDEX wh_dead_letter_history_letter_idx ON vantage.wh_dead_letter_history USING btree (dead_letter_id, at);

-- index wh_dead_letters_open_fingerprint_idx
CREATE INDEX wh_dead_letters_open_fingerprint_idx ON vantage.wh_dead_letters USING btree (error_fingerprint, global_position) INCLUDE (perspective_name, dead_lettered_at) WHERE (status = 'exhausted'::text);

-- index wh_dead_letters_open_idx
CREATE INDEX wh_dead_letters_open_idx ON vantage.wh_dead_letters USING btree (perspective_name, global_position) WHERE (status = 'exhausted'::text);

-- index wh_dead_letters_position_idx
CREATE INDEX wh_dead_letters_position_idx ON vantage.wh_dead_letters USING btree (global_position);

-- index wh_dead_letters_recent_idx
CREATE INDEX wh_dead_letters_recent_idx ON vantage.wh_dead_letters USING btree (perspective_name, dead_lettered_at);

-- index wh_dead_letters_unpurged_message_key
CREATE UNIQUE INDEX wh_dead_letters_unpurged_message_key ON vantage.wh_dead_letters USING btree (source_table, perspective_name, event_id) WHERE (status <> 'purged'::text);

-- index wh_lane_wakeups_lane_idx
CREATE INDEX wh_lane_wakeups_lane_idx ON vantage.wh_lane_wakeups USING btree (stream_id, perspective_name);

-- index wh_perspective_events_lane_idx
CREATE INDEX wh_perspective_events_lane_idx ON vantage.wh_perspective_events USING btree (perspective_name, stream_id, stream_version);

-- index wh_perspective_lanes_due_idx
CREATE INDEX wh_perspective_lanes_due_idx ON vantage.wh_perspective_lanes USING btree (perspective_name, due_at);

-- index wh_perspective_version_history_name_idx
CREATE INDEX wh_perspective_version_history_name_idx ON vantage.wh_perspective_version_history USING btree (perspective_name, history_id);

-- index wh_perspective_versions_one_live
CREATE UNIQUE INDEX wh_perspective_versions_one_live ON vantage.wh_perspective_versions USING btree (perspective_name) WHERE (state = 'live'::text);

-- function append_events(uuid,integer,jsonb)
CREATE OR REPLACE FUNCTION vantage.append_events(p_stream_id uuid, p_expected_version integer, p_events jsonb)
 RETURNS TABLE(global_position bigint, event_id uuid, stream_version integer)
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_current int;
BEGIN
    IF p_stream_id IS NULL THEN
        RAISE EXCEPTION 'append_events: stream id is required' USING ERRCODE = '22004';
    END IF;
    IF p_events IS NULL OR jsonb_typeof(p_events) <> 'array' THEN
        RAISE EXCEPTION 'append_events: events must be a JSON array' USING ERRCODE = '22023';
    END IF;
    IF EXISTS (SELECT 1 FROM jsonb_array_elements(p_events) e
               WHERE jsonb_typeof(e) <> 'object'
                  OR jsonb_typeof(e -> 'event_type') IS DISTINCT FROM 'string'
                  OR e ->> 'event_type' = '') THEN
        RAISE EXCEPTION 'append_events: every event needs a non-empty string event_type'
            USING ERRCODE = '22023';
    END IF;

    -- Serialise appenders of one stream; other streams are not blocked.
    PERFORM pg_advisory_xact_lock(
        ('x' || substr(md5('vantage:stream:' || p_stream_id::text), 1, 16))::bit(64)::bigint);

    SELECT coalesce(max(s.stream_version), 0) INTO v_current
    FROM wh_event_store s WHERE s.stream_id = p_stream_id;

    IF p_expected_version IS NOT NULL AND p_expected_version <> v_current THEN
        RAISE EXCEPTION 'stream % is at version %, expected version %',
            p_stream_id, v_current, p_expected_version
            USING ERRCODE = '40001';
    END IF;

    RETURN QUERY
    INSERT INTO wh_event_store (event_id, stream_id, stream_version, event_type, event_data, metadata)
    SELECT coalesce((e.value ->> 'event_id')::uuid, gen_random_uuid()),
           p_stream_id,
           v_current + e.ordinality::int,
           e.value ->> 'event_type',
           coalesce(e.value -> 'data', '{}'::jsonb),
           coalesce(e.value -> 'metadata', '{}'::jsonb)
    FROM jsonb_array_elements(p_events) WITH ORDINALITY AS e(value, ordinality)
    ORDER BY e.ordinality
    RETURNING global_position, event_id, stream_version;
END
$function$
;

-- function apply_and_complete_perspective_events(uuid,uuid[],text[],integer[],jsonb[],uuid[],uuid[],text[],bigint[],integer[],jsonb[])
CREATE OR REPLACE FUNCTION vantage.apply_and_complete_perspective_events(p_instance_id uuid, p_event_work_ids uuid[], p_statements text[], p_statement integer[], p_data jsonb[], p_stream_id uuid[], p_event_id uuid[], p_event_type text[], p_global_position bigint[], p_stream_version integer[], p_metadata jsonb[])
 RETURNS integer
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
BEGIN
    PERFORM apply_perspective_statements(p_statements, p_statement, p_data, p_stream_id,
                                         p_event_id, p_event_type, p_global_position,
                                         p_stream_version, p_metadata);
    RETURN complete_perspective_events(p_instance_id, p_event_work_ids);
END
$function$
;

-- function apply_perspective_statements(text[],integer[],jsonb[],uuid[],uuid[],text[],bigint[],integer[],jsonb[])
CREATE OR REPLACE FUNCTION vantage.apply_perspective_statements(p_statements text[], p_statement integer[], p_data jsonb[], p_stream_id uuid[], p_event_id uuid[], p_event_type text[], p_global_position bigint[], p_stream_version integer[], p_metadata jsonb[])
 RETURNS integer
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_n          int := coalesce(cardinality(p_statement), 0);
    v_dispatcher text;
BEGIN
    IF v_n = 0 THEN
        RETURN 0;
    END IF;
    v_dispatcher := wh_statement_dispatcher(p_statements);
    IF v_dispatcher IS NOT NULL THEN
        EXECUTE format('SELECT pg_temp.%I(NULL, NULL, NULL, NULL, NULL, NULL, NULL, '
                       '$1, $2, $3, $4, $5, $6, $7, $8)', v_dispatcher)
            INTO v_n
            USING p_statement, p_data, p_stream_id, p_event_id, p_event_type,
                  p_global_position, p_stream_version, p_metadata;
        RETURN v_n;
    END IF;
    FOR i IN 1 .. v_n LOOP
        EXECUTE p_statements[p_statement[i]]
            USING p_data[i], p_stream_id[i], p_event_id[i], p_event_type[i],
                  p_global_position[i], p_stream_version[i], p_metadata[i];
    END LOOP;
    RETURN v_n;
END
$function$
;

-- function backfill_perspective_version(text,integer,integer,boolean,integer)
CREATE OR REPLACE FUNCTION vantage.backfill_perspective_version(p_perspective_name text, p_version integer, p_max integer DEFAULT 1000, p_divert boolean DEFAULT false, p_budget_ms integer DEFAULT NULL::integer)
 RETURNS TABLE(outcome text, applied integer, backfill_position bigint, backfill_target bigint, diverted integer)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v        wh_perspective_versions;
    v_from   bigint;
    v_last   bigint;
    v_looked int := 0;
    v_step   int;
    v_k      int;
    v_rows   int;
    v_n      int := 0;
    v_moved  int := 0;
    v_apply  text;
    v_data   jsonb[];
    v_stream uuid[];
    v_id     uuid[];
    v_type   text[];
    v_pos    bigint[];
    v_ver    int[];
    v_meta   jsonb[];
BEGIN
    SELECT * INTO v FROM wh_perspective_versions x
    WHERE x.perspective_name = p_perspective_name AND x.version = p_version
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'busy'::text, 0, NULL::bigint, NULL::bigint, 0;
        RETURN;
    END IF;
    IF v.state <> 'building' THEN
        RETURN QUERY SELECT v.state, 0, v.backfill_position, v.backfill_target, 0;
        RETURN;
    END IF;
    IF v.backfill_horizon IS NULL THEN
        -- (taken after the registration committed: later transactions see the registry row)
        v.backfill_horizon := pg_snapshot_xmax(pg_current_snapshot());
        v.backfill_target := (SELECT coalesce(max(e.global_position), 0) FROM wh_event_store e);
        UPDATE wh_perspective_versions x
        SET backfill_horizon = v.backfill_horizon, backfill_target = v.backfill_target,
            backfill_started_at = now()
        WHERE x.perspective_name = p_perspective_name AND x.version = p_version;
    END IF;
    IF NOT wh_horizon_passed(v.backfill_horizon) THEN
        RETURN QUERY SELECT 'waiting'::text, 0, v.backfill_position, v.backfill_target, 0;
        RETURN;
    END IF;

    v_from := v.backfill_position;
    v_apply := format('SELECT %I.vantage_apply_many($1, $2, $3, $4, $5, $6, $7)', v.version_schema);
    LOOP
        v_step := least(greatest(p_max, 1) - v_looked, 100);
        SELECT max(w.global_position), count(*) INTO v_last, v_k
        FROM (SELECT e.global_position FROM wh_event_store e
              WHERE e.global_position > v_from
              ORDER BY e.global_position LIMIT v_step) w;
        EXIT WHEN v_last IS NULL;

        -- The step's events of this version's types that have no work row of it yet; those to
        -- divert become work rows first (in position order, as the fan-out writes them).
        INSERT INTO wh_perspective_events
            (stream_id, event_id, global_position, stream_version, perspective_name, replay)
        SELECT e.stream_id, e.event_id, e.global_position, e.stream_version, v.registry_name, true
        FROM wh_event_store e
        WHERE e.global_position > v_from AND e.global_position <= v_last
          AND (e.event_type = ANY (v.event_types) OR '*' = ANY (v.event_types))
          AND NOT EXISTS (SELECT 1 FROM wh_perspective_events w
                          WHERE w.perspective_name = v.registry_name AND w.event_id = e.event_id)
          AND (p_divert
               OR EXISTS (SELECT 1 FROM wh_perspective_events w
                          WHERE w.perspective_name = v.registry_name AND w.stream_id = e.stream_id
                            AND w.stream_version < e.stream_version))
        ORDER BY e.global_position;
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        v_moved := v_moved + v_rows;

        IF NOT p_divert THEN
            SELECT array_agg(e.event_data ORDER BY e.global_position),
                   array_agg(e.stream_id ORDER BY e.global_position),
                   array_agg(e.event_id ORDER BY e.global_position),
                   array_agg(e.event_type ORDER BY e.global_position),
                   array_agg(e.global_position ORDER BY e.global_position),
                   array_agg(e.stream_version ORDER BY e.global_position),
                   array_agg(e.metadata ORDER BY e.global_position)
            INTO v_data, v_stream, v_id, v_type, v_pos, v_ver, v_meta
            FROM wh_event_store e
            WHERE e.global_position > v_from AND e.global_position <= v_last
              AND (e.event_type = ANY (v.event_types) OR '*' = ANY (v.event_types))
              AND NOT EXISTS (SELECT 1 FROM wh_perspective_events w
                              WHERE w.perspective_name = v.registry_name AND w.event_id = e.event_id);
            IF v_id IS NOT NULL THEN
                EXECUTE v_apply INTO v_rows USING v_data, v_stream, v_id, v_type, v_pos, v_ver, v_meta;
                v_n := v_n + v_rows;
            END IF;
        END IF;
        v_from := v_last;
        v_looked := v_looked + v_k;
        EXIT WHEN v_looked >= greatest(p_max, 1)
               OR clock_timestamp() - statement_timestamp() >= p_budget_ms * interval '1 millisecond';
    END LOOP;

    IF v_from = v.backfill_position THEN
        -- The visible end: every later event has a work row of this version.
        UPDATE wh_perspective_versions x SET state = 'ready', backfill_done_at = now()
        WHERE x.perspective_name = p_perspective_name AND x.version = p_version;
        IF NOT EXISTS (SELECT 1 FROM wh_perspective_versions x
                       WHERE x.perspective_name = p_perspective_name AND x.state = 'live') THEN
            PERFORM wh_make_live(p_perspective_name, p_version, 'Live', 'vantage backfill');
            RETURN QUERY SELECT 'live'::text, 0, v.backfill_position, v.backfill_target, 0;
            RETURN;
        END IF;
        RETURN QUERY SELECT 'ready'::text, 0, v.backfill_position, v.backfill_target, 0;
        RETURN;
    END IF;
    UPDATE wh_perspective_versions x
    SET backfill_position = v_from, backfill_applied = x.backfill_applied + v_n
    WHERE x.perspective_name = p_perspective_name AND x.version = p_version;
    RETURN QUERY SELECT 'applied'::text, v_n, v_from, v.backfill_target, v_moved;
END
$function$
;

-- function claim_and_fetch_pending_perspective_events(uuid,text,uuid,integer,integer)
CREATE OR REPLACE FUNCTION vantage.claim_and_fetch_pending_perspective_events(p_stream_id uuid, p_perspective_name text, p_instance_id uuid, p_lease_seconds integer, p_max_rows integer DEFAULT NULL::integer)
 RETURNS TABLE(event_work_id uuid, event_id uuid, stream_version integer, attempts integer)
 LANGUAGE sql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT g.event_work_id, g.event_id, g.stream_version, g.attempts
    FROM get_stream_events(p_instance_id, ARRAY[p_stream_id], p_lease_seconds,
                           ARRAY[p_perspective_name], p_max_rows) g
    ORDER BY g.stream_version;
$function$
;

-- function claim_orphaned_perspective_events(uuid,integer,integer,integer,text[])
CREATE OR REPLACE FUNCTION vantage.claim_orphaned_perspective_events(p_instance_id uuid, p_lease_seconds integer, p_max_streams integer, p_max_rows integer, p_perspective_names text[] DEFAULT NULL::text[])
 RETURNS TABLE(event_work_id uuid, stream_id uuid, perspective_name text)
 LANGUAGE sql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT c.event_work_id, c.stream_id, c.perspective_name
    FROM get_stream_events(p_instance_id, NULL, p_lease_seconds,
                           p_perspective_names,
                           greatest(coalesce(p_max_rows, p_max_streams), 0),
                           least(greatest(p_max_streams, 0), greatest(coalesce(p_max_rows, p_max_streams), 0)),
                           1) c;
$function$
;

-- function cleanup_dead_instances(double precision)
CREATE OR REPLACE FUNCTION vantage.cleanup_dead_instances(p_stale_seconds double precision)
 RETURNS SETOF uuid
 LANGUAGE sql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    DELETE FROM wh_service_instances si
    WHERE si.last_heartbeat_at < now() - make_interval(secs => p_stale_seconds)
    RETURNING si.instance_id;
$function$
;

-- function complete_perspective_events(uuid,uuid[])
CREATE OR REPLACE FUNCTION vantage.complete_perspective_events(p_instance_id uuid, p_event_work_ids uuid[])
 RETURNS integer
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_done int;
BEGIN
    WITH done AS (
        DELETE FROM wh_perspective_events pe
        WHERE pe.event_work_id = ANY (p_event_work_ids)
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT count(*)::int INTO v_done FROM done;
    RETURN v_done;
END
$function$
;

-- function deregister_instance(uuid)
CREATE OR REPLACE FUNCTION vantage.deregister_instance(p_instance_id uuid)
 RETURNS integer
 LANGUAGE plpgsql
 SET lock_timeout TO '2s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_released int;
BEGIN
    DELETE FROM wh_service_instances si WHERE si.instance_id = p_instance_id;
    WITH mine AS (
        SELECT pe.event_work_id
        FROM wh_perspective_events pe
        WHERE pe.instance_id = p_instance_id
        ORDER BY pe.event_work_id
        FOR UPDATE SKIP LOCKED),
    released AS (
        UPDATE wh_perspective_events pe
        SET instance_id  = NULL,
            lease_expiry = NULL,
            attempts     = greatest(pe.attempts - CASE WHEN pe.refundable THEN 1 ELSE 0 END, 0),
            refundable   = false
        FROM mine
        WHERE pe.event_work_id = mine.event_work_id
        RETURNING 1)
    SELECT count(*)::int INTO v_released FROM released;
    RETURN v_released;
END
$function$
;

-- function get_stream_events(uuid,uuid[],integer,text[],integer,integer,integer)
CREATE OR REPLACE FUNCTION vantage.get_stream_events(p_instance_id uuid, p_stream_ids uuid[], p_lease_seconds integer, p_perspective_names text[] DEFAULT NULL::text[], p_max_rows integer DEFAULT NULL::integer, p_max_lanes integer DEFAULT NULL::integer, p_per_lane integer DEFAULT NULL::integer)
 RETURNS TABLE(event_work_id uuid, stream_id uuid, event_id uuid, perspective_name text, global_position bigint, stream_version integer, event_type text, event_data jsonb, metadata jsonb, attempts integer, failures integer, queued_at timestamp with time zone, replay boolean)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_names      text[];
    v_name       text;
    v_names_left int;
    v_lanes_left int := greatest(coalesce(p_max_lanes, p_max_rows, 100), 0);
    v_rows_left  int := greatest(coalesce(p_max_rows, p_max_lanes, 100), 0);
    v_rows       int;
    -- Per perspective, by its place in v_names: rows leased so far, rows per lane seen,
    -- whether it has no more due lanes for us, its rows and lanes for this round.
    v_n          int;
    v_i          int;
    v_p_got      int[];
    v_p_est      numeric[];
    v_p_dry      boolean[];
    v_p_left     int[];
    v_p_want     int[];
    v_p_lanes    int[];
    v_p_cap      int[];
    v_active     int;
    v_spare      int;
    v_lanes_free int;
    v_holders    uuid[];
    v_alive      uuid[];
    v_quota      int;
    v_round_s    uuid[];
    v_round_p    text[];
    v_got_s      uuid[];
    v_got_p      text[];
    v_c_id       uuid[];
    v_c_s        uuid[];
    v_c_p        text[];
    v_c_v        int[];
    v_c_tid      tid[];
    v_u_id       uuid[];
    v_u_event    uuid[];
    v_u_gp       bigint[];
    v_u_attempts int[];
    v_u_failures int[];
    v_u_s        uuid[];
    v_u_p        text[];
    v_u_v        int[];
    v_u_q        timestamptz[];
    v_u_r        boolean[];
    v_l_s        uuid[];
    v_l_p        text[];
    v_gap        uuid[];
    v_lock_timeout text;
    v_take       uuid[];
    v_taken      int;
    v_all        uuid[] := '{}';
    v_all_event  uuid[] := '{}';
    v_all_gp     bigint[] := '{}';
    v_all_attempts int[] := '{}';
    v_all_failures int[] := '{}';
    v_all_s      uuid[] := '{}';
    v_all_p      text[] := '{}';
    v_all_v      int[] := '{}';
    v_all_q      timestamptz[] := '{}';
    v_all_r      boolean[] := '{}';
    v_rounds     int := 0;
    v_pass       int;
BEGIN
    -- Named streams: the contract's form for one caller's own streams (operators, tests).
    IF p_stream_ids IS NOT NULL THEN
        RETURN QUERY SELECT * FROM wh_get_named_stream_events(
            p_instance_id, p_stream_ids, p_lease_seconds, p_perspective_names, p_max_rows);
        RETURN;
    END IF;

    v_names := wh_claimable_perspectives(p_perspective_names);
    -- Only a registered instance claims, and it holds its row (KEY SHARE) until the claim
    -- commits, so deregister_instance (which deletes that row first) waits for a claim under way
    -- and no claim can lease anything for an instance that has deregistered. A row being
    -- deleted right now (a deregistration, or a cleanup that found this instance silent) is
    -- skipped, not waited for: such an instance claims nothing until it is registered again.
    PERFORM 1 FROM wh_service_instances si WHERE si.instance_id = p_instance_id
    FOR KEY SHARE SKIP LOCKED;
    IF NOT FOUND OR v_names IS NULL THEN
        RETURN;
    END IF;

    -- 0. New lanes and re-woken ones: what producers, requeues and rebuilds added (part 3).
    PERFORM wh_fold_lane_wakeups(greatest(1000, v_lanes_left));

    v_rows := v_rows_left;
    v_n := cardinality(v_names);
    v_p_got := array_fill(0, ARRAY[v_n]);
    v_p_est := array_fill(coalesce(p_per_lane, 50)::numeric, ARRAY[v_n]);
    v_p_dry := array_fill(false, ARRAY[v_n]);

    WHILE v_lanes_left > 0 AND v_rows_left > 0 AND v_rounds < 4 LOOP
        v_rounds := v_rounds + 1;

        -- 1. Each perspective's share of the claim's rows: the rows are split evenly between
        --    the perspectives that still have due lanes (one that ran out keeps what it got and
        --    leaves the rest to the others), so a perspective whose lanes are deep (a rebuild, a
        --    backlog) takes at most its share while others have work. Each asks for as many lanes
        --    as its share needs at the rows per lane its lanes gave so far; the lanes are dealt
        --    out evenly between those that ask, and what one does not need goes to the others.
        v_active := 0;
        v_spare := v_rows;
        FOR v_i IN 1..v_n LOOP
            IF v_p_dry[v_i] THEN
                v_spare := v_spare - v_p_got[v_i];
            ELSE
                v_active := v_active + 1;
            END IF;
        END LOOP;
        EXIT WHEN v_active = 0;
        v_p_left := array_fill(0, ARRAY[v_n]);
        v_p_want := array_fill(0, ARRAY[v_n]);
        v_p_lanes := array_fill(0, ARRAY[v_n]);
        FOR v_i IN 1..v_n LOOP
            CONTINUE WHEN v_p_dry[v_i];
            -- (an even split of v_spare, the remainder to the first ones: the shares add up to
            --  the rows left)
            v_p_left[v_i] := greatest(v_spare / v_active
                                      + CASE WHEN v_spare % v_active > 0 THEN 1 ELSE 0 END
                                      - v_p_got[v_i], 0);
            v_spare := v_spare - v_spare / v_active
                       - CASE WHEN v_spare % v_active > 0 THEN 1 ELSE 0 END;
            v_active := v_active - 1;
            v_p_left[v_i] := least(v_p_left[v_i], v_rows_left);
            v_p_want[v_i] := ceil(v_p_left[v_i] / greatest(v_p_est[v_i], 1))::int;
        END LOOP;

        v_round_s := '{}';
        v_round_p := '{}';
        v_lanes_free := v_lanes_left;
        FOR v_pass IN 1..3 LOOP
            v_names_left := 0;
            FOR v_i IN 1..v_n LOOP
                IF NOT v_p_dry[v_i] AND v_p_lanes[v_i] < v_p_want[v_i] THEN
                    v_names_left := v_names_left + 1;
                END IF;
            END LOOP;
            EXIT WHEN v_names_left = 0 OR v_lanes_free <= 0;
            FOR v_i IN 1..v_n LOOP
                CONTINUE WHEN v_p_dry[v_i] OR v_p_lanes[v_i] >= v_p_want[v_i];
                v_quota := least(v_p_want[v_i] - v_p_lanes[v_i],
                                 ceil(v_lanes_free::numeric / v_names_left)::int);
                v_names_left := v_names_left - 1;
                CONTINUE WHEN v_quota <= 0;
                v_name := v_names[v_i];
                SELECT array_agg(d.stream_id), array_agg(d.perspective_name)
                INTO v_got_s, v_got_p
                FROM (
                    SELECT l.stream_id, l.perspective_name
                    FROM wh_perspective_lanes l
                    WHERE l.perspective_name = v_name AND l.due_at <= now()
                      -- (our own locks are not skipped: leave out what we already hold)
                      AND NOT (l.stream_id = ANY (v_round_s) AND l.perspective_name = ANY (v_round_p))
                    ORDER BY l.due_at
                    LIMIT v_quota
                    FOR UPDATE SKIP LOCKED
                ) d;
                IF coalesce(cardinality(v_got_s), 0) < v_quota THEN
                    v_p_dry[v_i] := true;   -- no more due lanes (that we can lock) for it
                END IF;
                IF v_got_s IS NOT NULL THEN
                    v_round_s := v_round_s || v_got_s;
                    v_round_p := v_round_p || v_got_p;
                    v_p_lanes[v_i] := v_p_lanes[v_i] + cardinality(v_got_s);
                    v_lanes_free := v_lanes_free - cardinality(v_got_s);
                END IF;
            END LOOP;
        END LOOP;
        EXIT WHEN cardinality(v_round_s) = 0;
        v_lanes_left := v_lanes_left - cardinality(v_round_s);

        -- 2. Candidates: per lane, the leading rows that are claimable (bool_and over the lane
        --    keeps only the prefix before the first blocked row), an even share of its
        --    perspective's rows per lane, ranked round-robin across the lanes (every lane's first
        --    row before any lane's second) and cut at the perspective's share (what is left is
        --    taken in the next round).
        v_p_cap := array_fill(1, ARRAY[v_n]);
        FOR v_i IN 1..v_n LOOP
            IF v_p_lanes[v_i] > 0 THEN
                v_p_cap[v_i] := coalesce(p_per_lane,
                                         ceil(v_p_left[v_i]::numeric / v_p_lanes[v_i])::int);
            END IF;
        END LOOP;
        SELECT array_agg(c.event_work_id), array_agg(c.sid), array_agg(c.pname),
               array_agg(c.stream_version), array_agg(c.row_tid)
        INTO v_c_id, v_c_s, v_c_p, v_c_v, v_c_tid
        FROM (
            SELECT s.event_work_id, s.sid, s.pname, s.stream_version, s.row_tid, s.rn
            FROM (
                SELECT r.event_work_id, r.sid, r.pname, r.stream_version, r.row_tid, r.rn,
                       r.quota_rows,
                       row_number() OVER (PARTITION BY r.pname ORDER BY r.rn, r.sid) AS prn
                FROM (
                    SELECT w.event_work_id, k.sid, k.pname, w.stream_version, w.row_tid,
                           q.quota_rows,
                           row_number() OVER lane AS rn,
                           bool_and(w.ok) OVER lane AS prefix_ok,
                           first_value(w.failures) OVER lane AS head_failures
                    FROM unnest(v_round_s, v_round_p) AS k(sid, pname)
                    JOIN unnest(v_names, v_p_left, v_p_cap) AS q(pname, quota_rows, per_lane)
                      ON q.pname = k.pname
                    CROSS JOIN LATERAL (
                        SELECT pe.event_work_id, pe.stream_version, pe.ctid AS row_tid,
                               pe.failures,
                               CASE
                                   WHEN pe.instance_id IS NULL THEN pe.scheduled_for <= now()
                                   WHEN pe.lease_expiry < now() THEN true
                                   ELSE NOT EXISTS (SELECT 1 FROM wh_service_instances si
                                                    WHERE si.instance_id = pe.instance_id)
                               END AS ok
                        FROM wh_perspective_events pe
                        WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid
                        ORDER BY pe.stream_version
                        LIMIT q.per_lane) w
                    WINDOW lane AS (PARTITION BY k.sid, k.pname ORDER BY w.stream_version)
                ) r
                -- (a head that failed before comes alone: it usually fails again, and each row
                --  leased behind it would be given back at every retry; migration 0025)
                WHERE r.prefix_ok AND (r.rn = 1 OR r.head_failures = 0)
            ) s
            WHERE s.prn <= s.quota_rows
            ORDER BY s.rn, s.sid, s.pname
            LIMIT v_rows_left
        ) c;

        v_u_id := NULL;
        IF v_c_id IS NOT NULL THEN
            -- 3. Lease them, re-checked on the live rows (an old holder may have renewed,
            --    completed or released one since our snapshot); attempts + 1 on takeover only.
            --    Claimers never touch a lane without its lock, so the only rows that can be
            --    locked here are an old holder's, briefly: wait for them a moment, and if that
            --    is not enough (the holder may be waiting for the lane lock we hold), lock what
            --    can be locked without waiting instead.
            v_lock_timeout := current_setting('lock_timeout');
            PERFORM set_config('lock_timeout', '50ms', true);
            BEGIN
                WITH leased AS (
                    UPDATE wh_perspective_events pe
                    SET instance_id  = p_instance_id,
                        lease_expiry = clock_timestamp() + make_interval(secs => p_lease_seconds),
                        attempts     = pe.attempts + CASE WHEN pe.instance_id IS DISTINCT FROM p_instance_id
                                                          THEN 1 ELSE 0 END,
                        refundable   = pe.instance_id IS DISTINCT FROM p_instance_id
                    -- (by the versions we read: a row changed since is not found, see step 4)
                    WHERE pe.ctid = ANY (v_c_tid)
                      AND CASE
                            WHEN pe.instance_id IS NULL THEN pe.scheduled_for <= now()
                            WHEN pe.lease_expiry < now() THEN true
                            ELSE NOT EXISTS (SELECT 1 FROM wh_service_instances si
                                             WHERE si.instance_id = pe.instance_id)
                          END
                    RETURNING pe.event_work_id, pe.event_id, pe.global_position, pe.attempts,
                              pe.failures, pe.stream_id, pe.perspective_name, pe.stream_version,
                              pe.created_at, pe.replay)
                SELECT array_agg(l.event_work_id), array_agg(l.event_id),
                       array_agg(l.global_position), array_agg(l.attempts), array_agg(l.failures),
                       array_agg(l.stream_id), array_agg(l.perspective_name),
                       array_agg(l.stream_version), array_agg(l.created_at), array_agg(l.replay)
                INTO v_u_id, v_u_event, v_u_gp, v_u_attempts, v_u_failures, v_u_s, v_u_p, v_u_v,
                     v_u_q, v_u_r
                FROM leased l;
            EXCEPTION WHEN lock_not_available THEN
                WITH locked AS (
                    SELECT pe.event_work_id
                    FROM wh_perspective_events pe
                    -- (by the versions we read: a row changed since is not found, see step 4)
                    WHERE pe.ctid = ANY (v_c_tid)
                      AND CASE
                            WHEN pe.instance_id IS NULL THEN pe.scheduled_for <= now()
                            WHEN pe.lease_expiry < now() THEN true
                            ELSE NOT EXISTS (SELECT 1 FROM wh_service_instances si
                                             WHERE si.instance_id = pe.instance_id)
                          END
                    ORDER BY pe.event_work_id
                    FOR UPDATE OF pe SKIP LOCKED),
                leased AS (
                    UPDATE wh_perspective_events pe
                    SET instance_id  = p_instance_id,
                        lease_expiry = clock_timestamp() + make_interval(secs => p_lease_seconds),
                        attempts     = pe.attempts + CASE WHEN pe.instance_id IS DISTINCT FROM p_instance_id
                                                          THEN 1 ELSE 0 END,
                        refundable   = pe.instance_id IS DISTINCT FROM p_instance_id
                    FROM locked
                    WHERE pe.event_work_id = locked.event_work_id
                    RETURNING pe.event_work_id, pe.event_id, pe.global_position, pe.attempts,
                              pe.failures, pe.stream_id, pe.perspective_name, pe.stream_version,
                              pe.created_at, pe.replay)
                SELECT array_agg(l.event_work_id), array_agg(l.event_id),
                       array_agg(l.global_position), array_agg(l.attempts), array_agg(l.failures),
                       array_agg(l.stream_id), array_agg(l.perspective_name),
                       array_agg(l.stream_version), array_agg(l.created_at), array_agg(l.replay)
                INTO v_u_id, v_u_event, v_u_gp, v_u_attempts, v_u_failures, v_u_s, v_u_p, v_u_v,
                     v_u_q, v_u_r
                FROM leased l;
            END;
            PERFORM set_config('lock_timeout', v_lock_timeout, true);

            -- 4. Leases stay a prefix of the lane, so nobody can ever hold a row ahead of ours:
            --    a candidate the re-check or a lock left out ends its lane's share, and what we
            --    leased behind it goes back at once, its bump refunded (rare: a race with the
            --    lane's old holder).
            IF coalesce(cardinality(v_u_id), 0) < cardinality(v_c_id) THEN
                SELECT array_agg(g.id) INTO v_gap
                FROM (
                    SELECT c.id, u.id IS NOT NULL AS leased,
                           bool_and(u.id IS NOT NULL) OVER (
                               PARTITION BY c.sid, c.pname ORDER BY c.v) AS contiguous
                    FROM unnest(v_c_id, v_c_s, v_c_p, v_c_v) AS c(id, sid, pname, v)
                    LEFT JOIN unnest(v_u_id) AS u(id) ON u.id = c.id
                ) g
                WHERE g.leased AND NOT g.contiguous;
                IF v_gap IS NOT NULL THEN
                    UPDATE wh_perspective_events pe
                    SET instance_id  = NULL,
                        lease_expiry = NULL,
                        attempts     = greatest(pe.attempts - CASE WHEN pe.refundable THEN 1 ELSE 0 END, 0),
                        refundable   = false
                    WHERE pe.event_work_id = ANY (v_gap);
                    SELECT array_agg(u.id), array_agg(u.ev), array_agg(u.gp), array_agg(u.att),
                           array_agg(u.fail), array_agg(u.sid), array_agg(u.pname), array_agg(u.v),
                           array_agg(u.q), array_agg(u.rp)
                    INTO v_u_id, v_u_event, v_u_gp, v_u_attempts, v_u_failures, v_u_s, v_u_p, v_u_v,
                         v_u_q, v_u_r
                    FROM unnest(v_u_id, v_u_event, v_u_gp, v_u_attempts, v_u_failures, v_u_s,
                                v_u_p, v_u_v, v_u_q, v_u_r)
                         AS u(id, ev, gp, att, fail, sid, pname, v, q, rp)
                    WHERE NOT u.id = ANY (v_gap);
                END IF;
            END IF;
        END IF;
        v_take := v_u_id;
        v_taken := coalesce(cardinality(v_take), 0);
        v_l_s := '{}';
        v_l_p := '{}';
        IF v_taken > 0 THEN
            v_all := v_all || v_u_id;
            v_all_event := v_all_event || v_u_event;
            v_all_gp := v_all_gp || v_u_gp;
            v_all_attempts := v_all_attempts || v_u_attempts;
            v_all_failures := v_all_failures || v_u_failures;
            v_all_s := v_all_s || v_u_s;
            v_all_p := v_all_p || v_u_p;
            v_all_v := v_all_v || v_u_v;
            v_all_q := v_all_q || v_u_q;
            v_all_r := v_all_r || v_u_r;
            -- The lanes we leased from, once (steps 5 and 6 join on them).
            SELECT array_agg(l.sid), array_agg(l.pname) INTO v_l_s, v_l_p
            FROM (SELECT DISTINCT u.sid, u.pname FROM unnest(v_u_s, v_u_p) AS u(sid, pname)) l;
        END IF;

        -- 5. The lanes' hints. A lane we leased from is due when our lease expires; any other
        --    lane of the round is due when its head is (a parked head's scheduled_for, another
        --    live holder's expiry; a head locked by someone else, in a second), and an empty
        --    lane goes. These statements started after we took the lanes' locks (L1, L2); the
        --    holders named are locked FOR KEY SHARE first, so a cleanup removing one waits for
        --    this claim and then wakes the lane (one being removed right now counts as gone).
        -- (lanes we leased from are due at our own expiry: no holder to look up)
        SELECT array_agg(DISTINCT h.instance_id) INTO v_holders
        FROM (SELECT k.sid, k.pname FROM unnest(v_round_s, v_round_p) AS k(sid, pname)
              EXCEPT
              SELECT l.sid, l.pname FROM unnest(v_l_s, v_l_p) AS l(sid, pname)) k
        CROSS JOIN LATERAL (
            SELECT pe.instance_id
            FROM wh_perspective_events pe
            WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid
            ORDER BY pe.stream_version
            LIMIT 1) h
        WHERE h.instance_id IS NOT NULL AND h.instance_id <> p_instance_id;
        v_alive := '{}';
        IF v_holders IS NOT NULL THEN
            SELECT coalesce(array_agg(a.instance_id), '{}') INTO v_alive
            FROM (SELECT si.instance_id
                  FROM wh_service_instances si
                  WHERE si.instance_id = ANY (v_holders)
                  ORDER BY si.instance_id
                  FOR KEY SHARE SKIP LOCKED) a;
        END IF;

        WITH leased AS (
            SELECT l.sid, l.pname FROM unnest(v_l_s, v_l_p) AS l(sid, pname)),
        round AS (
            SELECT k.sid, k.pname, (t.sid IS NOT NULL) AS leased
            FROM unnest(v_round_s, v_round_p) AS k(sid, pname)
            LEFT JOIN leased t ON t.sid = k.sid AND t.pname = k.pname),
        heads AS (
            SELECT r.sid, r.pname, r.leased, h.event_work_id AS head, h.instance_id,
                   h.lease_expiry, h.scheduled_for
            FROM round r
            LEFT JOIN LATERAL (
                SELECT pe.event_work_id, pe.instance_id, pe.lease_expiry, pe.scheduled_for
                FROM wh_perspective_events pe
                WHERE pe.perspective_name = r.pname AND pe.stream_id = r.sid
                ORDER BY pe.stream_version
                LIMIT 1) h ON NOT r.leased),
        gone AS (
            DELETE FROM wh_perspective_lanes l
            USING heads h
            WHERE l.stream_id = h.sid AND l.perspective_name = h.pname
              AND NOT h.leased AND h.head IS NULL
            RETURNING 1)
        UPDATE wh_perspective_lanes l
        SET due_at = CASE
                WHEN h.leased THEN clock_timestamp() + make_interval(secs => p_lease_seconds)
                WHEN h.instance_id IS NULL AND h.scheduled_for > now() THEN h.scheduled_for
                WHEN h.instance_id IS NOT NULL AND h.lease_expiry >= now()
                     AND h.instance_id = ANY (v_alive) THEN h.lease_expiry
                ELSE now() + interval '1 second'
            END,
            holder = CASE WHEN h.leased THEN p_instance_id ELSE h.instance_id END
        FROM heads h
        WHERE l.stream_id = h.sid AND l.perspective_name = h.pname
          AND (h.leased OR h.head IS NOT NULL);

        v_rows_left := v_rows_left - v_taken;
        -- Size each perspective's next round from what its lanes gave in this one.
        FOR v_i IN 1..v_n LOOP
            CONTINUE WHEN v_p_lanes[v_i] = 0;
            v_taken := (SELECT count(*) FROM unnest(v_u_p) AS u(pname)
                        WHERE u.pname = v_names[v_i]);
            v_p_got[v_i] := v_p_got[v_i] + v_taken;
            v_p_est[v_i] := greatest(v_taken::numeric / v_p_lanes[v_i], 1);
        END LOOP;
    END LOOP;

    IF cardinality(v_all) = 0 THEN
        RETURN;
    END IF;

    -- 6. The rows leased, with their raw events (what the lease returned; no second read of
    --    the work rows).
    RETURN QUERY
    SELECT r.id, r.sid, r.ev, r.pname, r.gp, r.v, e.event_type, e.event_data, e.metadata,
           r.att, r.fail, r.q, r.rp
    FROM unnest(v_all, v_all_event, v_all_gp, v_all_attempts, v_all_failures, v_all_s, v_all_p,
                v_all_v, v_all_q, v_all_r)
         AS r(id, ev, gp, att, fail, sid, pname, v, q, rp)
    -- (the events in one index scan by the positions, not one scan per row)
    LEFT JOIN (SELECT e.global_position, e.event_id, e.event_type, e.event_data, e.metadata
               FROM wh_event_store e
               WHERE e.global_position = ANY (v_all_gp)) e
      ON e.global_position = r.gp AND e.event_id = r.ev
    ORDER BY r.sid, r.pname, r.v;
END
$function$
;

-- function heartbeat(uuid,text,text,integer,text)
CREATE OR REPLACE FUNCTION vantage.heartbeat(p_instance_id uuid, p_service_name text DEFAULT 'vantage'::text, p_host_name text DEFAULT ''::text, p_process_id integer DEFAULT 0, p_version text DEFAULT ''::text)
 RETURNS boolean
 LANGUAGE sql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    INSERT INTO wh_service_instances AS si
        (instance_id, service_name, host_name, process_id, version)
    VALUES (p_instance_id, p_service_name, p_host_name, p_process_id, p_version)
    ON CONFLICT (instance_id) DO UPDATE SET last_heartbeat_at = now()
    RETURNING (xmax <> 0);
$function$
;

-- function move_many_to_dead_letters(uuid,uuid[],text,text[])
CREATE OR REPLACE FUNCTION vantage.move_many_to_dead_letters(p_instance_id uuid, p_source_ids uuid[], p_failure_reason text, p_error_texts text[])
 RETURNS TABLE(source_id uuid, dead_letter_id uuid)
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'move_many_to_dead_letters: an instance is required' USING ERRCODE = '22004';
    END IF;
    RETURN QUERY
    SELECT m.source_id, m.dead_letter_id
    FROM wh_move_to_dead_letters(p_instance_id, p_source_ids,
                                 array_fill(NULL::uuid, ARRAY[cardinality(p_source_ids)]),
                                 p_failure_reason, p_error_texts) m;
END
$function$
;

-- function move_to_dead_letters(uuid,text,uuid,text,text,uuid)
CREATE OR REPLACE FUNCTION vantage.move_to_dead_letters(p_dead_letter_id uuid, p_source_table text, p_source_id uuid, p_failure_reason text, p_error_text text, p_instance_id uuid)
 RETURNS uuid
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
BEGIN
    IF p_source_table IS DISTINCT FROM 'wh_perspective_events' THEN
        RAISE EXCEPTION 'move_to_dead_letters: unknown source table %', coalesce(p_source_table, 'NULL')
            USING ERRCODE = '22023';
    END IF;
    RETURN (SELECT m.dead_letter_id
            FROM wh_move_to_dead_letters(p_instance_id, ARRAY[p_source_id],
                                         ARRAY[p_dead_letter_id], p_failure_reason,
                                         ARRAY[p_error_text]) m);
END
$function$
;

-- function note_perspective_event_error(uuid,uuid,text)
CREATE OR REPLACE FUNCTION vantage.note_perspective_event_error(p_instance_id uuid, p_event_work_id uuid, p_error text)
 RETURNS boolean
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_noted boolean;
BEGIN
    WITH noted AS (
        UPDATE wh_perspective_events pe
        SET last_error = p_error
        WHERE pe.event_work_id = p_event_work_id
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT EXISTS (SELECT 1 FROM noted) INTO v_noted;
    RETURN v_noted;
END
$function$
;

-- function purge_dead_letter(uuid,text,text)
CREATE OR REPLACE FUNCTION vantage.purge_dead_letter(p_dead_letter_id uuid, p_actor text, p_detail text DEFAULT NULL::text)
 RETURNS boolean
 LANGUAGE sql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    WITH dl AS (
        UPDATE wh_dead_letters d
        SET status = 'purged', status_changed_at = now()
        WHERE d.dead_letter_id = p_dead_letter_id AND d.status = 'exhausted'
        RETURNING d.dead_letter_id),
    hist AS (
        INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
        SELECT dl.dead_letter_id, 'Purged', p_actor, p_detail FROM dl)
    SELECT EXISTS (SELECT 1 FROM dl);
$function$
;

-- function record_dead_letter_replay_failure(uuid,text,text)
CREATE OR REPLACE FUNCTION vantage.record_dead_letter_replay_failure(p_dead_letter_id uuid, p_actor text, p_error text)
 RETURNS boolean
 LANGUAGE sql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    WITH dl AS (
        UPDATE wh_dead_letters d
        SET status_changed_at = d.status_changed_at
        WHERE d.dead_letter_id = p_dead_letter_id AND d.status = 'exhausted'
        RETURNING d.dead_letter_id),
    hist AS (
        INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
        SELECT dl.dead_letter_id, 'ReplayFailed', p_actor, p_error FROM dl)
    SELECT EXISTS (SELECT 1 FROM dl);
$function$
;

-- function record_perspective_event_failure(uuid,uuid,text,integer,interval)
CREATE OR REPLACE FUNCTION vantage.record_perspective_event_failure(p_instance_id uuid, p_event_work_id uuid, p_error text, p_retry_after_seconds integer, p_retry_after interval DEFAULT NULL::interval)
 RETURNS boolean
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_failed boolean;
BEGIN
    WITH failed AS (
        UPDATE wh_perspective_events pe
        SET failures      = pe.failures + 1,
            last_error    = p_error,
            instance_id   = NULL,
            lease_expiry  = NULL,
            refundable    = false,
            scheduled_for = clock_timestamp()
                            + coalesce(p_retry_after,
                                       make_interval(secs => greatest(p_retry_after_seconds, 0)))
        WHERE pe.event_work_id = p_event_work_id
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT EXISTS (SELECT 1 FROM failed) INTO v_failed;
    RETURN v_failed;
END
$function$
;

-- function register_perspective(text,text[])
CREATE OR REPLACE FUNCTION vantage.register_perspective(p_perspective_name text, p_event_types text[])
 RETURNS void
 LANGUAGE sql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    INSERT INTO wh_perspectives (perspective_name, event_types)
    VALUES (p_perspective_name, p_event_types)
    ON CONFLICT (perspective_name) DO UPDATE
        SET event_types = EXCLUDED.event_types,
            updated_at = now()
        WHERE wh_perspectives.event_types IS DISTINCT FROM EXCLUDED.event_types;
$function$
;

-- function register_perspective_version(text,integer,text,text[],text[],jsonb,text,text)
CREATE OR REPLACE FUNCTION vantage.register_perspective_version(p_perspective_name text, p_version integer, p_read_schema text, p_tables text[], p_event_types text[], p_statements jsonb, p_setup text, p_actor text DEFAULT 'vantage'::text)
 RETURNS TABLE(registry_name text, version_schema text, apply_statement text, state text, created boolean)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_row      wh_perspective_versions;
    v_schema   text := p_perspective_name || '_v' || p_version;
    v_registry text := p_perspective_name || '@v' || p_version;
    v_digest   text;
    v_path     text := current_setting('search_path');
    v_apply    text;
    v_missing  text;
BEGIN
    v_digest := md5(jsonb_build_object(
        'read_schema', p_read_schema, 'tables', to_jsonb(p_tables),
        'event_types', to_jsonb(p_event_types), 'statements', p_statements,
        'setup', p_setup)::text);
    PERFORM wh_lock_perspective_versions(p_perspective_name);
    SELECT * INTO v_row FROM wh_perspective_versions v
    WHERE v.perspective_name = p_perspective_name AND v.version = p_version;
    IF FOUND THEN
        IF v_row.state = 'retired' THEN
            RAISE EXCEPTION 'perspective "%" version % was retired; a new definition needs a new version',
                p_perspective_name, p_version
                USING ERRCODE = 'VT002';
        END IF;
        IF v_row.digest <> v_digest THEN
            RAISE EXCEPTION 'perspective "%" version % is registered with another %; a changed definition needs a new version',
                p_perspective_name, p_version,
                concat_ws(', ',
                    CASE WHEN v_row.event_types <> p_event_types THEN 'event list' END,
                    CASE WHEN v_row.statements <> p_statements THEN 'statement set' END,
                    CASE WHEN v_row.setup <> p_setup THEN 'setup' END,
                    CASE WHEN v_row.tables <> p_tables THEN 'table list' END,
                    CASE WHEN v_row.read_schema <> p_read_schema THEN 'read_schema' END)
                USING ERRCODE = 'VT001';
        END IF;
        RETURN QUERY SELECT v_row.registry_name, v_row.version_schema, v_row.apply_statement,
                            v_row.state, false;
        RETURN;
    END IF;

    IF octet_length(v_schema) > 63 THEN
        RAISE EXCEPTION 'perspective "%": the schema name "%" is longer than 63 bytes',
            p_perspective_name, v_schema USING ERRCODE = '42622';
    END IF;
    IF to_regnamespace(quote_ident(v_schema)) IS NOT NULL THEN
        RAISE EXCEPTION 'perspective "%" version %: schema "%" already exists and is not vantage''s',
            p_perspective_name, p_version, v_schema USING ERRCODE = '42P06';
    END IF;
    EXECUTE format('CREATE SCHEMA %I', v_schema);
    IF to_regnamespace(quote_ident(p_read_schema)) IS NULL THEN
        EXECUTE format('CREATE SCHEMA %I', p_read_schema);
    END IF;

    -- The setup and the functions see the version's schema first.
    PERFORM set_config('search_path', format('%I, %s', v_schema, v_path), true);
    EXECUTE p_setup;
    SELECT string_agg(t, ', ') INTO v_missing
    FROM unnest(p_tables) AS t
    WHERE to_regclass(format('%I.%I', v_schema, t)) IS NULL;
    IF v_missing IS NOT NULL THEN
        RAISE EXCEPTION 'perspective "%" version %: setup did not create %',
            p_perspective_name, p_version, v_missing USING ERRCODE = '42P01';
    END IF;

    PERFORM set_config('search_path', v_path, true);
    PERFORM wh_create_version_apply(v_schema, v_registry, p_statements);

    v_apply := format('SELECT %I.vantage_apply($1, $2, $3, $4, $5, $6, $7)', v_schema);
    INSERT INTO wh_perspectives (perspective_name, event_types)
    VALUES (v_registry, p_event_types)
    ON CONFLICT (perspective_name) DO UPDATE SET event_types = EXCLUDED.event_types, updated_at = now();
    INSERT INTO wh_perspective_versions
        (perspective_name, version, registry_name, read_schema, version_schema, tables,
         event_types, statements, setup, digest, apply_statement)
    VALUES (p_perspective_name, p_version, v_registry, p_read_schema, v_schema, p_tables,
            p_event_types, p_statements, p_setup, v_digest, v_apply);
    INSERT INTO wh_perspective_version_history (perspective_name, kind, to_version, actor)
    VALUES (p_perspective_name, 'Registered', p_version, p_actor);
    RETURN QUERY SELECT v_registry, v_schema, v_apply, 'building'::text, true;
END
$function$
;

-- function release_started_leases(uuid,uuid[])
CREATE OR REPLACE FUNCTION vantage.release_started_leases(p_instance_id uuid, p_event_work_ids uuid[])
 RETURNS integer
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_released int;
BEGIN
    WITH released AS (
        UPDATE wh_perspective_events pe
        SET instance_id  = NULL,
            lease_expiry = NULL,
            refundable   = false
        WHERE pe.event_work_id = ANY (p_event_work_ids)
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT count(*)::int INTO v_released FROM released;
    RETURN v_released;
END
$function$
;

-- function release_unstarted_leases(uuid,uuid[])
CREATE OR REPLACE FUNCTION vantage.release_unstarted_leases(p_instance_id uuid, p_event_work_ids uuid[])
 RETURNS integer
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_released int;
BEGIN
    WITH released AS (
        UPDATE wh_perspective_events pe
        SET instance_id  = NULL,
            lease_expiry = NULL,
            attempts     = greatest(pe.attempts - CASE WHEN pe.refundable THEN 1 ELSE 0 END, 0),
            refundable   = false
        WHERE pe.event_work_id = ANY (p_event_work_ids)
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT count(*)::int INTO v_released FROM released;
    RETURN v_released;
END
$function$
;

-- function renew_leases(uuid,uuid[],integer)
CREATE OR REPLACE FUNCTION vantage.renew_leases(p_instance_id uuid, p_event_work_ids uuid[], p_lease_seconds integer)
 RETURNS integer
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_renewed int;
BEGIN
    WITH mine AS (
        SELECT pe.event_work_id
        FROM wh_perspective_events pe
        WHERE pe.event_work_id = ANY (p_event_work_ids)
          AND pe.instance_id = p_instance_id
        ORDER BY pe.event_work_id
        FOR UPDATE SKIP LOCKED),
    renewed AS (
        UPDATE wh_perspective_events pe
        SET lease_expiry = clock_timestamp() + make_interval(secs => p_lease_seconds)
        FROM mine
        WHERE pe.event_work_id = mine.event_work_id
        RETURNING 1)
    SELECT count(*)::int INTO v_renewed FROM renewed;
    RETURN v_renewed;
END
$function$
;

-- function requeue_dead_letter(uuid,text)
CREATE OR REPLACE FUNCTION vantage.requeue_dead_letter(p_dead_letter_id uuid, p_actor text)
 RETURNS boolean
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_dl       wh_dead_letters%ROWTYPE;
    v_inserted bigint;
BEGIN
    SELECT d.* INTO v_dl FROM wh_dead_letters d WHERE d.dead_letter_id = p_dead_letter_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM wh_lock_perspective_shared(v_dl.perspective_name);

    UPDATE wh_dead_letters d
    SET status = 'requeued', status_changed_at = now()
    WHERE d.dead_letter_id = p_dead_letter_id AND d.status = 'exhausted';
    IF NOT FOUND THEN
        RETURN false;
    END IF;

    INSERT INTO wh_perspective_events
        (event_work_id, stream_id, event_id, global_position, stream_version, perspective_name,
         attempts, failures, scheduled_for)
    VALUES (v_dl.source_id, v_dl.stream_id, v_dl.event_id, v_dl.global_position,
            v_dl.stream_version, v_dl.perspective_name, 0, 0, now())
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS v_inserted = ROW_COUNT;
    IF v_inserted = 0 THEN
        -- Undoes the compare-and-set above with the rest of the statement.
        RAISE EXCEPTION 'dead letter % is already queued: perspective "%" has a work row for event % (position %); requeuing it would apply it twice',
            p_dead_letter_id, v_dl.perspective_name, v_dl.event_id, v_dl.global_position
            USING ERRCODE = '23505';
    END IF;

    INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
    VALUES (p_dead_letter_id, 'Requeued', p_actor, NULL);
    PERFORM pg_notify('vantage_work', '');
    RETURN true;
END
$function$
;

-- function resolve_dead_letter(uuid,text,text)
CREATE OR REPLACE FUNCTION vantage.resolve_dead_letter(p_dead_letter_id uuid, p_actor text, p_detail text DEFAULT NULL::text)
 RETURNS boolean
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_perspective text;
    v_done        boolean;
BEGIN
    SELECT d.perspective_name INTO v_perspective
    FROM wh_dead_letters d
    WHERE d.dead_letter_id = p_dead_letter_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM wh_lock_perspective_shared(v_perspective);

    WITH dl AS (
        UPDATE wh_dead_letters d
        SET status = 'resolved', status_changed_at = now()
        WHERE d.dead_letter_id = p_dead_letter_id AND d.status = 'exhausted'
        RETURNING d.dead_letter_id),
    hist AS (
        INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
        SELECT dl.dead_letter_id, 'ReplaySucceeded', p_actor, p_detail FROM dl)
    SELECT EXISTS (SELECT 1 FROM dl) INTO v_done;
    RETURN v_done;
END
$function$
;

-- function retire_perspective_version(text,integer,text)
CREATE OR REPLACE FUNCTION vantage.retire_perspective_version(p_perspective_name text, p_version integer, p_actor text)
 RETURNS TABLE(outcome text, dropped_rows bigint)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v   wh_perspective_versions;
    v_n bigint;
BEGIN
    PERFORM wh_lock_perspective_versions(p_perspective_name);
    SELECT * INTO v FROM wh_perspective_versions x
    WHERE x.perspective_name = p_perspective_name AND x.version = p_version FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'unknown'::text, 0::bigint;
        RETURN;
    ELSIF v.state IN ('live', 'retired') THEN
        RETURN QUERY SELECT v.state, 0::bigint;
        RETURN;
    END IF;
    DELETE FROM wh_perspectives p WHERE p.perspective_name = v.registry_name;
    DELETE FROM wh_perspective_events w WHERE w.perspective_name = v.registry_name;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    EXECUTE format('DROP SCHEMA %I CASCADE', v.version_schema);
    UPDATE wh_perspective_versions x SET state = 'retired', retired_at = now()
    WHERE x.perspective_name = p_perspective_name AND x.version = p_version;
    INSERT INTO wh_perspective_version_history (perspective_name, kind, from_version, actor)
    VALUES (p_perspective_name, 'Retired', p_version, p_actor);
    RETURN QUERY SELECT 'done'::text, v_n;
END
$function$
;

-- function switch_perspective_version(text,text,integer,text)
CREATE OR REPLACE FUNCTION vantage.switch_perspective_version(p_perspective_name text, p_kind text, p_version integer, p_actor text)
 RETURNS TABLE(outcome text, from_version integer, to_version integer, behind bigint)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_live wh_perspective_versions;
    v_to   wh_perspective_versions;
    v_target int := p_version;
    v_behind bigint;
BEGIN
    IF p_kind NOT IN ('Cutover', 'Rollback') THEN
        RAISE EXCEPTION 'switch_perspective_version: kind must be Cutover or Rollback'
            USING ERRCODE = '22023';
    END IF;
    PERFORM wh_lock_perspective_versions(p_perspective_name);
    SELECT * INTO v_live FROM wh_perspective_versions v
    WHERE v.perspective_name = p_perspective_name AND v.state = 'live';
    IF p_kind = 'Rollback' THEN
        SELECT h.from_version INTO v_target
        FROM wh_perspective_version_history h
        WHERE h.perspective_name = p_perspective_name AND h.kind IN ('Cutover', 'Rollback')
          AND h.to_version = v_live.version
        ORDER BY h.history_id DESC LIMIT 1;
        IF v_target IS NULL THEN
            RETURN QUERY SELECT 'no_previous'::text, v_live.version, NULL::int, NULL::bigint;
            RETURN;
        END IF;
    ELSIF v_target IS NULL THEN
        SELECT max(v.version) INTO v_target FROM wh_perspective_versions v
        WHERE v.perspective_name = p_perspective_name AND v.state <> 'retired';
    END IF;
    SELECT * INTO v_to FROM wh_perspective_versions v
    WHERE v.perspective_name = p_perspective_name AND v.version = v_target;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'unknown'::text, v_live.version, v_target, NULL::bigint;
        RETURN;
    END IF;
    IF v_to.state = 'retired' THEN
        RETURN QUERY SELECT 'retired'::text, v_live.version, v_target, NULL::bigint;
        RETURN;
    ELSIF v_to.state = 'live' THEN
        RETURN QUERY SELECT 'live'::text, v_live.version, v_target, 0::bigint;
        RETURN;
    ELSIF v_to.state = 'building' THEN
        RETURN QUERY SELECT 'building'::text, v_live.version, v_target,
                            wh_version_behind(p_perspective_name, v_target);
        RETURN;
    END IF;
    IF v_live.version IS NOT NULL THEN
        -- The fence: waits for the live version's applies in flight and holds back new ones
        -- until this transaction ends (see the header).
        PERFORM pg_advisory_xact_lock(wh_version_fence_key(v_live.registry_name));
        -- Events of the live version's types it has applied (no work row left) that the target
        -- has not.
        SELECT count(*) INTO v_behind
        FROM wh_perspective_events w
        JOIN wh_event_store e ON e.event_id = w.event_id
        WHERE w.perspective_name = v_to.registry_name
          AND (e.event_type = ANY (v_live.event_types) OR '*' = ANY (v_live.event_types))
          AND NOT EXISTS (SELECT 1 FROM wh_perspective_events l
                          WHERE l.perspective_name = v_live.registry_name
                            AND l.event_id = w.event_id);
        IF v_behind > 0 THEN
            RETURN QUERY SELECT 'behind_live'::text, v_live.version, v_target, v_behind;
            RETURN;
        END IF;
    END IF;
    PERFORM wh_make_live(p_perspective_name, v_target, p_kind, p_actor);
    RETURN QUERY SELECT 'done'::text, v_live.version, v_target, 0::bigint;
END
$function$
;

-- function wh_apply_and_complete_perspective_events_all_or_nothing(uuid,uuid[],text[],integer[],jsonb[],uuid[],uuid[],text[],bigint[],integer[],jsonb[])
CREATE OR REPLACE FUNCTION vantage.wh_apply_and_complete_perspective_events_all_or_nothing(p_instance_id uuid, p_event_work_ids uuid[], p_statements text[], p_statement integer[], p_data jsonb[], p_stream_id uuid[], p_event_id uuid[], p_event_type text[], p_global_position bigint[], p_stream_version integer[], p_metadata jsonb[])
 RETURNS integer
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_want int := coalesce(cardinality(p_event_work_ids), 0);
    v_done int;
BEGIN
    v_done := apply_and_complete_perspective_events(p_instance_id, p_event_work_ids, p_statements,
                                                    p_statement, p_data, p_stream_id, p_event_id,
                                                    p_event_type, p_global_position,
                                                    p_stream_version, p_metadata);
    IF v_done < v_want THEN
        RAISE EXCEPTION 'wh_apply_and_complete_perspective_events_all_or_nothing: % of % rows are no longer leased to instance %; the batch was rolled back',
            v_want - v_done, v_want, p_instance_id
            USING ERRCODE = 'VL001';
    END IF;
    RETURN v_done;
END
$function$
;

-- function wh_claimable_perspectives(text[])
CREATE OR REPLACE FUNCTION vantage.wh_claimable_perspectives(p_names text[])
 RETURNS text[]
 LANGUAGE sql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT array_agg(p.perspective_name ORDER BY random())
    FROM wh_perspectives p
    WHERE (p_names IS NULL OR p.perspective_name = ANY (p_names))
      AND p.paused_at IS NULL
      AND p.rebuild_up_to IS NULL
      AND NOT EXISTS (SELECT 1 FROM wh_perspective_versions v
                      WHERE v.registry_name = p.perspective_name AND v.state = 'building')
      AND pg_try_advisory_xact_lock_shared(wh_perspective_lock_key(p.perspective_name));
$function$
;

-- function wh_create_version_apply(text,text,jsonb)
CREATE OR REPLACE FUNCTION vantage.wh_create_version_apply(p_schema text, p_registry text, p_statements jsonb)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_path  text := current_setting('search_path');
    v_fence bigint := wh_version_fence_key(p_registry);
    v_cases text := '';
    v_else  text;
BEGIN
    PERFORM set_config('search_path', format('%I, %s', p_schema, v_path), true);
    -- One event: its type's statement (inlined when it returns no rows, as the batch
    -- dispatcher does), else the catch-all, else an error (an event of a type the version does
    -- not handle is never completed silently).
    SELECT string_agg(
               CASE WHEN wh_statement_returns_no_rows(s.value)
                    THEN format('    WHEN %L THEN', s.key) || chr(10)
                         || regexp_replace(s.value, '[\s;]+$', '') || chr(10) || ';' || chr(10)
                    ELSE format('    WHEN %L THEN EXECUTE %L USING $1, $2, $3, $4, $5, $6, $7;',
                                s.key, s.value) || chr(10)
               END, '' ORDER BY s.key)
    INTO v_cases
    FROM jsonb_each_text(p_statements) s
    WHERE s.key <> '*';
    v_else := p_statements ->> '*';
    IF v_else IS NULL THEN
        v_else := format('    RAISE EXCEPTION %L, $4 USING ERRCODE = %L;',
                         'perspective "' || replace(p_registry, '%', '%%')
                         || '" has no statement for event type "%"', 'VT003');
    ELSIF wh_statement_returns_no_rows(v_else) THEN
        v_else := regexp_replace(v_else, '[\s;]+$', '') || chr(10) || ';';
    ELSE
        v_else := format('    EXECUTE %L USING $1, $2, $3, $4, $5, $6, $7;', v_else);
    END IF;
    EXECUTE format(
        'CREATE OR REPLACE FUNCTION %I.vantage_apply(jsonb, uuid, uuid, text, bigint, int, jsonb) '
        'RETURNS void LANGUAGE plpgsql SET search_path FROM CURRENT AS %L',
        p_schema,
        concat_ws(chr(10),
            '#variable_conflict use_column',
            'BEGIN',
            format('  PERFORM pg_advisory_xact_lock_shared(%s);', v_fence),
            '  CASE $4',
            coalesce(v_cases, ''),
            '    ELSE',
            v_else,
            '  END CASE;',
            'END'));
    -- Many events, in order (the backfill's batch).
    EXECUTE format(
        'CREATE OR REPLACE FUNCTION %I.vantage_apply_many(jsonb[], uuid[], uuid[], text[], bigint[], int[], jsonb[]) '
        'RETURNS int LANGUAGE plpgsql SET search_path FROM CURRENT AS %L',
        p_schema,
        format(concat_ws(chr(10),
            'BEGIN',
            '  FOR i IN 1 .. coalesce(cardinality($1), 0) LOOP',
            '    PERFORM %I.vantage_apply($1[i], $2[i], $3[i], $4[i], $5[i], $6[i], $7[i]);',
            '  END LOOP;',
            '  RETURN coalesce(cardinality($1), 0);',
            'END'), p_schema));
    PERFORM set_config('search_path', v_path, true);
END
$function$
;

-- function wh_dead_letter_history_append_only()
CREATE OR REPLACE FUNCTION vantage.wh_dead_letter_history_append_only()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
BEGIN
    RAISE EXCEPTION 'wh_dead_letter_history is append-only (% refused)', TG_OP
        USING ERRCODE = '55000';
END
$function$
;

-- function wh_dead_letters_fingerprint()
CREATE OR REPLACE FUNCTION vantage.wh_dead_letters_fingerprint()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
BEGIN
    IF NEW.error_fingerprint IS NULL
       OR (TG_OP = 'UPDATE'
           AND NEW.error_fingerprint IS NOT DISTINCT FROM OLD.error_fingerprint
           AND (NEW.perspective_name, NEW.event_type, NEW.error_text)
               IS DISTINCT FROM (OLD.perspective_name, OLD.event_type, OLD.error_text)) THEN
        NEW.error_fingerprint :=
            wh_error_fingerprint(NEW.perspective_name, NEW.event_type, NEW.error_text);
    END IF;
    RETURN NEW;
END
$function$
;

-- function wh_error_cause(text)
CREATE OR REPLACE FUNCTION vantage.wh_error_cause(p_error text)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT CASE WHEN strpos(p_error, 'last error: ') > 0
                THEN substring(p_error from '.*last error: (.*)$')
                ELSE p_error END;
$function$
;

-- function wh_error_fingerprint(text,text,text)
CREATE OR REPLACE FUNCTION vantage.wh_error_fingerprint(p_perspective text, p_event_type text, p_error text)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT left(md5(concat_ws(chr(31), p_perspective, coalesce(p_event_type, ''),
                              coalesce(wh_error_sqlstate(p_error), ''),
                              coalesce(wh_error_mask(p_error), ''))), 12);
$function$
;

-- function wh_error_mask(text)
CREATE OR REPLACE FUNCTION vantage.wh_error_mask(p_error text)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT left(btrim(translate(regexp_replace(
        regexp_replace(
          regexp_replace(regexp_replace(
            regexp_replace(
              regexp_replace(regexp_replace(
                regexp_replace(
                  regexp_replace(regexp_replace(wh_error_cause(p_error),
                      '\s*\(SQLSTATE [0-9A-Z]{5}\)', '', 'g'),
                    '\)=\([^)]*\)', ')=(?)', 'g'),
                  '(\m(?:relation|column|constraint|table|function|type|schema|index|sequence|view|trigger|domain|database|role|operator|extension)) "([^"]*)"',
                  '\1 ' || chr(1) || '\2' || chr(2), 'gi'),
                '"[^"]*"', '"?"', 'g'),
              '''[^'']*''', '''?''', 'g'),
            '[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}',
            '<uuid>', 'g'),
            '\m0x[0-9a-fA-F]+\M', '<hex>', 'g'),
          '\m(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*[0-9])[0-9a-fA-F]{8,}\M', '<hex>', 'g'),
        '\m[0-9]+(\.[0-9]+)?\M', '<n>', 'g'),
      '\s+', ' ', 'g'), chr(1) || chr(2), '""')), 500);
$function$
;

-- function wh_error_sqlstate(text)
CREATE OR REPLACE FUNCTION vantage.wh_error_sqlstate(p_error text)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT substring(wh_error_cause(p_error) from '\(SQLSTATE ([0-9A-Z]{5})\)');
$function$
;

-- function wh_event_store_fan_out()
CREATE OR REPLACE FUNCTION vantage.wh_event_store_fan_out()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_rows bigint;
BEGIN
    INSERT INTO wh_perspective_events
        (stream_id, event_id, global_position, stream_version, perspective_name)
    SELECT e.stream_id, e.event_id, e.global_position, e.stream_version, p.perspective_name
    FROM new_events e
    JOIN wh_perspectives p
      ON e.event_type = ANY (p.event_types) OR '*' = ANY (p.event_types)
    ORDER BY e.global_position, p.perspective_name;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    IF v_rows > 0 THEN
        PERFORM pg_notify('vantage_work', '');
    END IF;
    RETURN NULL;
END
$function$
;

-- function wh_fold_lane_wakeups(integer)
CREATE OR REPLACE FUNCTION vantage.wh_fold_lane_wakeups(p_max integer DEFAULT 1000)
 RETURNS integer
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_first_s uuid[];
    v_first_p text[];
    v_held_s  uuid[];
    v_held_p  text[];
    v_mine_s  uuid[] := '{}';
    v_mine_p  text[] := '{}';
    v_tid     tid[];
    v_low_s   uuid[];
    v_low_p   text[];
    v_low_v   int[];
    v_gone    int;
BEGIN
    -- 1. The lanes of the first p_max free wake-ups.
    SELECT array_agg(f.stream_id), array_agg(f.perspective_name)
    INTO v_first_s, v_first_p
    FROM (SELECT DISTINCT w.stream_id, w.perspective_name
          FROM (SELECT w.stream_id, w.perspective_name
                FROM wh_lane_wakeups w
                LIMIT greatest(p_max, 0)
                FOR UPDATE SKIP LOCKED) w) f;
    IF v_first_s IS NULL THEN
        RETURN 0;
    END IF;

    -- 2. Existing lanes among them, locked without waiting (one lookup of the lane key each).
    SELECT array_agg(h.stream_id), array_agg(h.perspective_name)
    INTO v_held_s, v_held_p
    FROM (SELECT l.stream_id, l.perspective_name
          FROM unnest(v_first_s, v_first_p) AS k(sid, pname)
          JOIN wh_perspective_lanes l ON l.stream_id = k.sid AND l.perspective_name = k.pname
          ORDER BY l.stream_id, l.perspective_name
          FOR UPDATE OF l SKIP LOCKED) h;
    IF v_held_s IS NOT NULL THEN
        v_mine_s := v_held_s;
        v_mine_p := v_held_p;
    END IF;

    -- 3. Missing lanes, inserted only into buckets nobody else is inserting into (0017: an
    --    insert then meets no row or a committed one, and never waits). A conflict means another
    --    fold inserted the lane after our snapshot: its wake-ups stay for the next fold.
    WITH missing AS MATERIALIZED (
        SELECT k.sid, k.pname, wh_lane_bucket_key(k.sid, k.pname) AS bucket
        FROM unnest(v_first_s, v_first_p) AS k(sid, pname)
        WHERE NOT EXISTS (SELECT 1 FROM wh_perspective_lanes l
                          WHERE l.stream_id = k.sid AND l.perspective_name = k.pname)),
    buckets AS MATERIALIZED (
        SELECT b.bucket
        FROM (SELECT DISTINCT m.bucket FROM missing m) b
        WHERE pg_try_advisory_xact_lock(b.bucket)),
    added AS (
        INSERT INTO wh_perspective_lanes AS l (stream_id, perspective_name, due_at)
        SELECT m.sid, m.pname, now()
        FROM missing m
        JOIN buckets b ON b.bucket = m.bucket
        ORDER BY m.sid, m.pname
        ON CONFLICT (stream_id, perspective_name) DO NOTHING
        RETURNING l.stream_id, l.perspective_name)
    SELECT v_mine_s || coalesce(array_agg(a.stream_id), '{}'),
           v_mine_p || coalesce(array_agg(a.perspective_name), '{}')
    INTO v_mine_s, v_mine_p
    FROM added a;
    IF cardinality(v_mine_s) = 0 THEN
        RETURN 0;
    END IF;

    -- 4. Every free wake-up of the lanes we now hold (ours included: SKIP LOCKED does not skip
    --    our own locks), at most 100 per lane taken on average, by the lane key; and per lane
    --    the lowest version they name (a wake-up without one, from before 0011, counts as a new
    --    head).
    WITH taken AS MATERIALIZED (
        SELECT k.sid, k.pname, w.row_tid, w.min_version
        FROM unnest(v_mine_s, v_mine_p) AS k(sid, pname)
        CROSS JOIN LATERAL (
            SELECT w.ctid AS row_tid, w.min_version
            FROM wh_lane_wakeups w
            WHERE w.stream_id = k.sid AND w.perspective_name = k.pname
            FOR UPDATE SKIP LOCKED) w
        LIMIT greatest(p_max, 0)::bigint * 100),
    lanes AS (
        SELECT t.sid, t.pname,
               CASE WHEN bool_or(t.min_version IS NULL) THEN NULL ELSE min(t.min_version) END AS v
        FROM taken t
        GROUP BY t.sid, t.pname)
    SELECT (SELECT array_agg(t.row_tid) FROM taken t),
           array_agg(l.sid), array_agg(l.pname), array_agg(l.v)
    INTO v_tid, v_low_s, v_low_p, v_low_v
    FROM lanes l;
    IF v_tid IS NULL THEN
        RETURN 0;
    END IF;

    -- 5. Due now only if the new rows may be the head: rows appended behind an existing one
    --    change nothing about when the lane can next be claimed (its head's own writers keep
    --    that hint, L2). (Lanes inserted in step 3 are due now already.)
    UPDATE wh_perspective_lanes l
    SET due_at = now()
    FROM unnest(v_low_s, v_low_p, v_low_v) AS h(sid, pname, min_version)
    WHERE l.stream_id = h.sid AND l.perspective_name = h.pname
      AND l.due_at > now()
      AND (h.min_version IS NULL
           OR NOT EXISTS (SELECT 1 FROM wh_perspective_events pe
                          WHERE pe.perspective_name = h.pname
                            AND pe.stream_id = h.sid
                            AND pe.stream_version < h.min_version));

    -- 6. Every wake-up taken is folded: gone, by its row address.
    WITH gone AS (
        DELETE FROM wh_lane_wakeups w
        WHERE w.ctid = ANY (v_tid)
        RETURNING 1)
    SELECT count(*)::int INTO v_gone FROM gone;
    RETURN v_gone;
END
$function$
;

-- function wh_get_named_stream_events(uuid,uuid[],integer,text[],integer)
CREATE OR REPLACE FUNCTION vantage.wh_get_named_stream_events(p_instance_id uuid, p_stream_ids uuid[], p_lease_seconds integer, p_perspective_names text[] DEFAULT NULL::text[], p_max_rows integer DEFAULT NULL::integer)
 RETURNS TABLE(event_work_id uuid, stream_id uuid, event_id uuid, perspective_name text, global_position bigint, stream_version integer, event_type text, event_data jsonb, metadata jsonb, attempts integer, failures integer, queued_at timestamp with time zone, replay boolean)
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_names    text[];
    v_limit    int := coalesce(p_max_rows, 2147483647);
    v_per_lane int;
    v_chosen   uuid[];
    v_locked   uuid[];
    v_take     uuid[];
    v_own      uuid[];
BEGIN
    -- Skip a perspective being rebuilt or paused (wh_claimable_perspectives says which).
    v_names := wh_claimable_perspectives(p_perspective_names);
    -- Only a registered instance claims, and it holds its row (KEY SHARE) until the claim
    -- commits, so deregister_instance (which deletes that row first) waits for a claim under way
    -- and no claim can lease anything for an instance that has deregistered. A row being
    -- deleted right now (a deregistration, or a cleanup that found this instance silent) is
    -- skipped, not waited for: such an instance claims nothing until it is registered again.
    PERFORM 1 FROM wh_service_instances si WHERE si.instance_id = p_instance_id
    FOR KEY SHARE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_names IS NULL OR coalesce(cardinality(p_stream_ids), 0) = 0 OR v_limit <= 0 THEN
        RETURN;
    END IF;
    -- Read only a window of each lane: its fair share of the budget, with slack for short lanes.
    -- (numeric arithmetic: with no p_max_rows the budget is int's maximum.)
    v_per_lane := least(v_limit::numeric,
        greatest(8, 2 * ceil(v_limit::numeric / (cardinality(p_stream_ids) * cardinality(v_names)))))::int;

    -- 1. Candidates: per lane, the leading rows that are ours or claimable (bool_and over the
    --    window keeps only the prefix before the first blocked row), ranked round-robin.
    SELECT array_agg(c.event_work_id) INTO v_chosen
    FROM (
        SELECT r.event_work_id
        FROM (
            SELECT w.event_work_id, w.stream_id, w.perspective_name,
                   row_number() OVER lane AS rn,
                   bool_and(w.ok) OVER lane AS prefix_ok
            FROM unnest(p_stream_ids) AS s(sid)
            CROSS JOIN unnest(v_names) AS n(pname)
            CROSS JOIN LATERAL (
                SELECT pe.event_work_id, pe.stream_id, pe.perspective_name, pe.stream_version,
                       CASE
                           WHEN pe.instance_id = p_instance_id THEN true
                           WHEN pe.instance_id IS NULL THEN pe.scheduled_for <= now()
                           WHEN pe.lease_expiry < now() THEN true
                           ELSE NOT EXISTS (SELECT 1 FROM wh_service_instances si
                                            WHERE si.instance_id = pe.instance_id)
                       END AS ok
                FROM wh_perspective_events pe
                WHERE pe.perspective_name = n.pname AND pe.stream_id = s.sid
                ORDER BY pe.stream_version
                LIMIT v_per_lane) w
            WINDOW lane AS (PARTITION BY w.stream_id, w.perspective_name ORDER BY w.stream_version)
        ) r
        WHERE r.prefix_ok
        ORDER BY r.rn, r.stream_id, r.perspective_name
        LIMIT v_limit
    ) c;
    IF v_chosen IS NULL THEN
        RETURN;
    END IF;

    -- 2. Rows validly leased to us need no lock: nobody else may change them while the lease is
    --    valid, and another claimer's stale FOR UPDATE SKIP LOCKED may hold their tuple lock (it
    --    locks the latest version before its re-check rejects the row), which must not make us
    --    drop our own lane. Lock the others without waiting, re-checking them on the live rows.
    SELECT array_agg(pe.event_work_id) INTO v_own
    FROM wh_perspective_events pe
    WHERE pe.event_work_id = ANY (v_chosen)
      AND pe.instance_id = p_instance_id
      AND pe.lease_expiry > now();

    SELECT coalesce(v_own, '{}') || coalesce(array_agg(l.event_work_id), '{}') INTO v_locked
    FROM (
        SELECT pe.event_work_id
        FROM wh_perspective_events pe
        WHERE pe.event_work_id = ANY (v_chosen)
          AND NOT pe.event_work_id = ANY (coalesce(v_own, '{}'))
          AND CASE
                WHEN pe.instance_id = p_instance_id THEN true
                WHEN pe.instance_id IS NULL THEN pe.scheduled_for <= now()
                WHEN pe.lease_expiry < now() THEN true
                ELSE NOT EXISTS (SELECT 1 FROM wh_service_instances si
                                 WHERE si.instance_id = pe.instance_id)
              END
        ORDER BY pe.event_work_id
        FOR UPDATE OF pe SKIP LOCKED
    ) l;
    IF cardinality(v_locked) = 0 THEN
        RETURN;
    END IF;

    -- 3. Keep, per lane, only the rows before the first one we could not lock: leases stay a
    --    prefix of the lane, so nobody else can ever hold a row ahead of ours.
    SELECT array_agg(k.event_work_id) INTO v_take
    FROM (
        SELECT pe.event_work_id,
               bool_and(pe.event_work_id = ANY (v_locked)) OVER (
                   PARTITION BY pe.stream_id, pe.perspective_name
                   ORDER BY pe.stream_version) AS contiguous
        FROM wh_perspective_events pe
        WHERE pe.event_work_id = ANY (v_chosen)
    ) k
    WHERE k.contiguous;
    IF v_take IS NULL THEN
        RETURN;
    END IF;

    -- 4. Lease what is not already validly ours; bump attempts only on takeover.
    UPDATE wh_perspective_events pe
    SET instance_id  = p_instance_id,
        lease_expiry = clock_timestamp() + make_interval(secs => p_lease_seconds),
        attempts     = pe.attempts + CASE WHEN pe.instance_id IS DISTINCT FROM p_instance_id
                                          THEN 1 ELSE 0 END,
        -- (remember whether this claim bumped, so a give-back refunds exactly that)
        refundable   = pe.instance_id IS DISTINCT FROM p_instance_id
    WHERE pe.event_work_id = ANY (v_take)
      AND (pe.instance_id IS DISTINCT FROM p_instance_id OR pe.lease_expiry <= now());

    -- 5. Everything of the window now validly leased to the caller, with the raw event.
    RETURN QUERY
    SELECT pe.event_work_id, pe.stream_id, pe.event_id, pe.perspective_name,
           pe.global_position, pe.stream_version, ev.event_type, ev.event_data,
           ev.metadata, pe.attempts, pe.failures, pe.created_at, pe.replay
    FROM wh_perspective_events pe
    LEFT JOIN wh_event_store ev ON ev.global_position = pe.global_position
                               AND ev.event_id = pe.event_id
    WHERE pe.event_work_id = ANY (v_take)
      AND pe.instance_id = p_instance_id
      AND pe.lease_expiry > now()
    ORDER BY pe.stream_id, pe.perspective_name, pe.stream_version;
END
$function$
;

-- function wh_horizon_passed(xid8)
CREATE OR REPLACE FUNCTION vantage.wh_horizon_passed(p_horizon xid8)
 RETURNS boolean
 LANGUAGE sql
 STABLE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT pg_snapshot_xmin(pg_current_snapshot()) >= p_horizon
       AND NOT EXISTS (
           SELECT 1 FROM pg_stat_activity a
           WHERE a.pid <> pg_backend_pid()
             AND a.datname = current_database()
             AND a.backend_type = 'client backend'
             AND wh_xid8(a.backend_xmin) < p_horizon);
$function$
;

-- function wh_lane_bucket_key(uuid,text)
CREATE OR REPLACE FUNCTION vantage.wh_lane_bucket_key(p_stream_id uuid, p_perspective_name text)
 RETURNS bigint
 LANGUAGE sql
 STABLE PARALLEL SAFE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT hashtextextended('vantage:lane-bucket:' || current_schema() || ':'
                            || (hashtext(p_perspective_name || ':' || p_stream_id::text) & 63)::text,
                            0);
$function$
;

-- function wh_lock_perspective_shared(text)
CREATE OR REPLACE FUNCTION vantage.wh_lock_perspective_shared(p_perspective_name text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(wh_perspective_lock_key(p_perspective_name)) THEN
        RAISE EXCEPTION 'perspective "%" is being rebuilt; try again when the rebuild has finished',
            p_perspective_name
            USING ERRCODE = '55P03',
                  HINT = 'vantage perspectives rebuild holds the perspective''s lock while it resets and re-queues.';
    END IF;
END
$function$
;

-- function wh_lock_perspective_versions(text)
CREATE OR REPLACE FUNCTION vantage.wh_lock_perspective_versions(p_perspective_name text)
 RETURNS void
 LANGUAGE sql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT pg_advisory_xact_lock(
        hashtextextended('vantage:versions:' || current_schema() || ':' || p_perspective_name, 0));
$function$
;

-- function wh_make_live(text,integer,text,text)
CREATE OR REPLACE FUNCTION vantage.wh_make_live(p_perspective_name text, p_version integer, p_kind text, p_actor text)
 RETURNS integer
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_to   wh_perspective_versions;
    v_from int;
    t      text;
BEGIN
    SELECT * INTO v_to FROM wh_perspective_versions v
    WHERE v.perspective_name = p_perspective_name AND v.version = p_version;
    SELECT v.version INTO v_from FROM wh_perspective_versions v
    WHERE v.perspective_name = p_perspective_name AND v.state = 'live';
    UPDATE wh_perspective_versions v SET state = 'ready'
    WHERE v.perspective_name = p_perspective_name AND v.state = 'live';
    FOREACH t IN ARRAY v_to.tables LOOP
        IF to_regclass(format('%I.%I', v_to.read_schema, t)) IS NOT NULL THEN
            EXECUTE format('DROP VIEW %I.%I', v_to.read_schema, t);
        END IF;
        EXECUTE format('CREATE VIEW %I.%I AS SELECT * FROM %I.%I',
                       v_to.read_schema, t, v_to.version_schema, t);
    END LOOP;
    UPDATE wh_perspective_versions v SET state = 'live', live_since = now()
    WHERE v.perspective_name = p_perspective_name AND v.version = p_version;
    INSERT INTO wh_perspective_version_history (perspective_name, kind, from_version, to_version, actor)
    VALUES (p_perspective_name, p_kind, v_from, p_version, p_actor);
    RETURN v_from;
END
$function$
;

-- function wh_move_to_dead_letters(uuid,uuid[],uuid[],text,text[])
CREATE OR REPLACE FUNCTION vantage.wh_move_to_dead_letters(p_instance_id uuid, p_source_ids uuid[], p_dead_letter_ids uuid[], p_failure_reason text, p_error_texts text[])
 RETURNS TABLE(source_id uuid, dead_letter_id uuid)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_perspective text;
BEGIN
    FOR v_perspective IN
        SELECT DISTINCT pe.perspective_name
        FROM wh_perspective_events pe
        WHERE pe.event_work_id = ANY (p_source_ids)
        ORDER BY 1
    LOOP
        PERFORM wh_lock_perspective_shared(v_perspective);
    END LOOP;

    RETURN QUERY
    WITH given AS (
        SELECT g.id, g.dead_letter_id, g.error_text
        FROM unnest(p_source_ids, p_dead_letter_ids, p_error_texts)
             AS g(id, dead_letter_id, error_text)),
    src AS (
        -- (by the primary key: a join to the ids can be planned as a scan of the queue)
        DELETE FROM wh_perspective_events pe
        WHERE pe.event_work_id = ANY (p_source_ids)
          AND (p_instance_id IS NULL OR pe.instance_id = p_instance_id)
        RETURNING pe.*),
    moved AS (
        SELECT coalesce(given.dead_letter_id, gen_random_uuid()) AS new_id, src.event_work_id,
               src.stream_id, src.event_id, src.global_position, src.stream_version,
               ev.event_type, src.perspective_name,
               nullif(concat_ws(E'\n', given.error_text,
                                CASE WHEN src.last_error IS NOT NULL
                                     THEN 'last error: ' || src.last_error END), '') AS error_text,
               src.attempts, src.failures
        FROM src
        JOIN given ON given.id = src.event_work_id
        LEFT JOIN wh_event_store ev ON ev.global_position = src.global_position),
    -- (a NULL type or text fingerprints as ''; error_text is never '', so the join keys below
    -- only ever join rows whose fingerprints are equal. MATERIALIZED: inlined, the planner
    -- would evaluate the fingerprint once per joined row again.)
    fp AS MATERIALIZED (
        SELECT d.perspective_name, d.event_type, d.error_text,
               wh_error_fingerprint(d.perspective_name, d.event_type, d.error_text) AS fingerprint
        FROM (SELECT DISTINCT m.perspective_name, coalesce(m.event_type, '') AS event_type,
                     coalesce(m.error_text, '') AS error_text
              FROM moved m) d),
    dl AS (
        INSERT INTO wh_dead_letters AS d
            (dead_letter_id, source_table, source_id, stream_id, event_id, global_position,
             stream_version, event_type, perspective_name, failure_reason, error_text,
             attempts_when_dlq, failures_when_dlq, dead_lettered_at, dead_lettered_by,
             status, status_changed_at, error_fingerprint)
        SELECT m.new_id, 'wh_perspective_events', m.event_work_id, m.stream_id, m.event_id,
               m.global_position, m.stream_version, m.event_type, m.perspective_name,
               p_failure_reason, m.error_text, m.attempts, m.failures, now(), p_instance_id,
               'exhausted', now(), fp.fingerprint
        FROM moved m
        JOIN fp ON fp.perspective_name = m.perspective_name
               AND fp.event_type = coalesce(m.event_type, '')
               AND fp.error_text = coalesce(m.error_text, '')
        ON CONFLICT (source_table, perspective_name, event_id) WHERE status <> 'purged' DO UPDATE
            SET source_id = EXCLUDED.source_id,
                failure_reason = EXCLUDED.failure_reason,
                error_text = EXCLUDED.error_text,
                error_fingerprint = EXCLUDED.error_fingerprint,
                attempts_when_dlq = EXCLUDED.attempts_when_dlq,
                failures_when_dlq = EXCLUDED.failures_when_dlq,
                dead_lettered_at = EXCLUDED.dead_lettered_at,
                dead_lettered_by = EXCLUDED.dead_lettered_by,
                status = 'exhausted',
                status_changed_at = now()
        RETURNING d.source_id, d.dead_letter_id, d.error_text),
    hist AS (
        INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
        SELECT dl.dead_letter_id, 'Exhausted',
               coalesce('instance ' || p_instance_id::text, 'vantage'),
               p_failure_reason || coalesce(': ' || dl.error_text, '')
        FROM dl)
    SELECT dl.source_id, dl.dead_letter_id FROM dl;
END
$function$
;

-- function wh_perspective_events_wake_lanes()
CREATE OR REPLACE FUNCTION vantage.wh_perspective_events_wake_lanes()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
BEGIN
    INSERT INTO wh_lane_wakeups (stream_id, perspective_name, min_version)
    SELECT n.stream_id, n.perspective_name, min(n.stream_version)
    FROM new_rows n
    GROUP BY n.stream_id, n.perspective_name;
    RETURN NULL;
END
$function$
;

-- function wh_perspective_is_rebuilding(text)
CREATE OR REPLACE FUNCTION vantage.wh_perspective_is_rebuilding(p_perspective_name text)
 RETURNS boolean
 LANGUAGE sql
 STABLE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT EXISTS (
        SELECT 1
        FROM pg_locks l, (SELECT wh_perspective_lock_key(p_perspective_name) AS k) key
        WHERE l.locktype = 'advisory'
          AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
          AND l.classid = ((key.k >> 32) & 4294967295)::oid
          AND l.objid = (key.k & 4294967295)::oid
          AND l.objsubid = 1
          AND l.mode = 'ExclusiveLock'
          AND l.granted);
$function$
;

-- function wh_perspective_lanes_after_delete()
CREATE OR REPLACE FUNCTION vantage.wh_perspective_lanes_after_delete()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_streams uuid[];
    v_names   text[];
    v_last    int[];
BEGIN
    SELECT array_agg(l.stream_id), array_agg(l.perspective_name), array_agg(l.last_version)
    INTO v_streams, v_names, v_last
    FROM (
        SELECT l.stream_id, l.perspective_name, o.last_version
        FROM wh_perspective_lanes l
        JOIN (SELECT o.stream_id, o.perspective_name, max(o.stream_version) AS last_version
              FROM old_rows o
              GROUP BY o.stream_id, o.perspective_name) o
          ON o.stream_id = l.stream_id AND o.perspective_name = l.perspective_name
        ORDER BY l.stream_id, l.perspective_name
        FOR UPDATE OF l
    ) l;
    IF v_streams IS NULL THEN
        RETURN NULL;
    END IF;

    -- (a row behind the last one deleted means not empty, without reading the prefix again)
    DELETE FROM wh_perspective_lanes l
    USING unnest(v_streams, v_names, v_last) AS k(sid, pname, last_version)
    WHERE l.stream_id = k.sid AND l.perspective_name = k.pname
      AND CASE
            WHEN EXISTS (SELECT 1 FROM wh_perspective_events pe
                         WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid
                           AND pe.stream_version > k.last_version)
            THEN false
            ELSE NOT EXISTS (SELECT 1 FROM wh_perspective_events pe
                             WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid)
          END;

    UPDATE wh_perspective_lanes l
    SET due_at = now()
    FROM unnest(v_streams, v_names) AS k(sid, pname)
    WHERE l.stream_id = k.sid AND l.perspective_name = k.pname
      AND l.due_at > now();
    RETURN NULL;
END
$function$
;

-- function wh_perspective_lanes_after_instance_gone()
CREATE OR REPLACE FUNCTION vantage.wh_perspective_lanes_after_instance_gone()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
BEGIN
    UPDATE wh_perspective_lanes l
    SET due_at = now()
    WHERE l.holder IN (SELECT g.instance_id FROM gone g)
      AND l.due_at > now();
    RETURN NULL;
END
$function$
;

-- function wh_perspective_lanes_after_release()
CREATE OR REPLACE FUNCTION vantage.wh_perspective_lanes_after_release()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_due timestamptz := CASE WHEN NEW.instance_id IS NULL THEN NEW.scheduled_for
                              ELSE NEW.lease_expiry END;
BEGIN
    IF EXISTS (SELECT 1 FROM wh_perspective_events e
               WHERE e.perspective_name = NEW.perspective_name AND e.stream_id = NEW.stream_id
                 AND e.stream_version < NEW.stream_version) THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM wh_perspective_lanes l
    WHERE l.stream_id = NEW.stream_id AND l.perspective_name = NEW.perspective_name
    FOR UPDATE;
    UPDATE wh_perspective_lanes l
    SET due_at = v_due
    WHERE l.stream_id = NEW.stream_id AND l.perspective_name = NEW.perspective_name
      AND l.due_at > v_due;
    RETURN NULL;
END
$function$
;

-- function wh_perspective_lock_key(text)
CREATE OR REPLACE FUNCTION vantage.wh_perspective_lock_key(p_perspective_name text)
 RETURNS bigint
 LANGUAGE sql
 STABLE PARALLEL SAFE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT hashtextextended('vantage:perspective:' || current_schema() || ':' || p_perspective_name, 0);
$function$
;

-- function wh_perspective_version_history_append_only()
CREATE OR REPLACE FUNCTION vantage.wh_perspective_version_history_append_only()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
BEGIN
    RAISE EXCEPTION 'wh_perspective_version_history is append-only (% refused)', TG_OP
        USING ERRCODE = '55000';
END
$function$
;

-- function wh_primary_key(regclass)
CREATE OR REPLACE FUNCTION vantage.wh_primary_key(p_table regclass)
 RETURNS text[]
 LANGUAGE sql
 STABLE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT array_agg(a.attname::text ORDER BY k.ord)
    FROM pg_index i
    CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
    WHERE i.indrelid = p_table AND i.indisprimary;
$function$
;

-- function wh_read_model_row(regclass,jsonb)
CREATE OR REPLACE FUNCTION vantage.wh_read_model_row(p_table regclass, p_row jsonb)
 RETURNS jsonb
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_cols  text[] := wh_primary_key(p_table);
    v_where text;
    v_out   jsonb;
BEGIN
    IF v_cols IS NULL THEN
        RETURN NULL;
    END IF;
    SELECT string_agg(format('t.%1$I IS NOT DISTINCT FROM k.%1$I', c), ' AND ') INTO v_where
    FROM unnest(v_cols) AS c;
    EXECUTE format('SELECT to_jsonb(t) FROM %s t, jsonb_populate_record(NULL::%s, $1) k WHERE %s',
                   p_table, p_table, v_where)
        INTO v_out USING p_row;
    RETURN v_out;
END
$function$
;

-- function wh_reconcile_lanes(text,uuid,integer)
CREATE OR REPLACE FUNCTION vantage.wh_reconcile_lanes(p_after_perspective text, p_after_stream uuid, p_max integer)
 RETURNS TABLE(repaired_stream uuid, repaired_perspective text, next_perspective text, next_stream uuid)
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
#variable_conflict use_column
DECLARE
    v_s    uuid[];
    v_p    text[];
    v_last_p text;
    v_last_s uuid;
BEGIN
    WITH RECURSIVE walk AS (
        (SELECT pe.perspective_name, pe.stream_id, 1 AS n
         FROM wh_perspective_events pe
         WHERE p_after_perspective IS NULL
            OR (pe.perspective_name, pe.stream_id) > (p_after_perspective, p_after_stream)
         ORDER BY pe.perspective_name, pe.stream_id
         LIMIT 1)
        UNION ALL
        SELECT nx.perspective_name, nx.stream_id, w.n + 1
        FROM walk w
        CROSS JOIN LATERAL (
            SELECT pe.perspective_name, pe.stream_id
            FROM wh_perspective_events pe
            WHERE (pe.perspective_name, pe.stream_id) > (w.perspective_name, w.stream_id)
            ORDER BY pe.perspective_name, pe.stream_id
            LIMIT 1) nx
        WHERE w.n < greatest(p_max, 1))
    SELECT array_agg(w.stream_id ORDER BY w.n), array_agg(w.perspective_name ORDER BY w.n)
    INTO v_s, v_p
    FROM walk w;
    IF v_s IS NULL THEN
        RETURN QUERY SELECT NULL::uuid, NULL::text, NULL::text, NULL::uuid;
        RETURN;
    END IF;
    IF cardinality(v_s) >= greatest(p_max, 1) THEN
        v_last_p := v_p[cardinality(v_p)];
        v_last_s := v_s[cardinality(v_s)];
    END IF;

    RETURN QUERY
    WITH missing AS MATERIALIZED (
        -- Work, no lane row, no wake-up: all three read in this statement's snapshot. (The walk
        -- above read the work in an earlier one; a lane drained since, its lane row deleted
        -- with its last row, is not missing anything.) Each by a lookup of the lane key.
        SELECT k.sid, k.pname, wh_lane_bucket_key(k.sid, k.pname) AS bucket
        FROM unnest(v_s, v_p) AS k(sid, pname)
        WHERE EXISTS (SELECT 1 FROM wh_perspective_events pe
                      WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid)
          AND NOT EXISTS (SELECT 1 FROM wh_perspective_lanes l
                          WHERE l.stream_id = k.sid AND l.perspective_name = k.pname)
          AND NOT EXISTS (SELECT 1 FROM wh_lane_wakeups w
                          WHERE w.stream_id = k.sid AND w.perspective_name = k.pname)),
    buckets AS MATERIALIZED (
        SELECT b.bucket
        FROM (SELECT DISTINCT m.bucket FROM missing m) b
        WHERE pg_try_advisory_xact_lock(b.bucket)),
    added AS (
        INSERT INTO wh_perspective_lanes AS l (stream_id, perspective_name, due_at)
        SELECT m.sid, m.pname, now()
        FROM missing m
        JOIN buckets b ON b.bucket = m.bucket
        ORDER BY m.sid, m.pname
        ON CONFLICT (stream_id, perspective_name) DO NOTHING
        RETURNING l.stream_id, l.perspective_name)
    SELECT a.stream_id, a.perspective_name, v_last_p, v_last_s FROM added a
    UNION ALL
    SELECT NULL::uuid, NULL::text, v_last_p, v_last_s;
END
$function$
;

-- function wh_statement_dispatcher(text[])
CREATE OR REPLACE FUNCTION vantage.wh_statement_dispatcher(p_statements text[])
 RETURNS text
 LANGUAGE plpgsql
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    v_name  text := 'vantage_apply_inline_' || md5(array_to_string(p_statements, E'\n;\n--vantage--\n'));
    v_count int := coalesce(nullif(current_setting('vantage.apply_dispatchers', true), '')::int, 0);
    v_cases text := '';
    v_assign text := '';
BEGIN
    IF to_regprocedure(format('pg_temp.%I(jsonb, uuid, uuid, text, bigint, int, jsonb, '
                              'int[], jsonb[], uuid[], uuid[], text[], bigint[], int[], jsonb[])',
                              v_name)) IS NOT NULL THEN
        RETURN v_name;
    END IF;
    IF v_count >= 16 THEN
        RETURN NULL;
    END IF;
    FOR i IN 1 .. cardinality(p_statements) LOOP
        IF wh_statement_returns_no_rows(p_statements[i]) THEN
            -- (the statement on lines of its own: a trailing "--" comment ends with its line)
            v_cases := v_cases || format('      WHEN %s THEN', i) || chr(10)
                || regexp_replace(p_statements[i], '[\s;]+$', '') || chr(10) || ';' || chr(10);
        ELSE
            v_cases := v_cases || format(
                '      WHEN %s THEN EXECUTE %L USING $1, $2, $3, $4, $5, $6, $7;', i, p_statements[i])
                || chr(10);
        END IF;
    END LOOP;
    -- Only the parameters some statement mentions are assigned (any $n, $0n … anywhere in its
    -- text, as the daemon decides what to send); the others stay NULL, unread.
    FOR n IN 1 .. 7 LOOP
        IF EXISTS (SELECT 1 FROM unnest(p_statements) AS s(statement)
                   WHERE s.statement ~ ('\$0*' || n || '([^0-9]|$)')) THEN
            v_assign := v_assign || format('    $%s := $%s[vantage$event];', n, n + 8) || chr(10);
        END IF;
    END LOOP;
    BEGIN
        -- $1 … $7: the statements' parameters; $8: which statement each event runs (1-based
        -- into p_statements); $9 … $15: the events' values, one array per parameter.
        -- (a column named like a PL/pgSQL variable, e.g. "found", stays a column)
        EXECUTE format(
            'CREATE FUNCTION pg_temp.%I(jsonb, uuid, uuid, text, bigint, int, jsonb, '
            'int[], jsonb[], uuid[], uuid[], text[], bigint[], int[], jsonb[]) '
            'RETURNS int LANGUAGE plpgsql AS %L',
            v_name,
            concat_ws(chr(10),
                '#variable_conflict use_column',
                'BEGIN',
                '  FOR vantage$event IN 1 .. coalesce(cardinality($8), 0) LOOP',
                v_assign || '    CASE $8[vantage$event]',
                v_cases || '    END CASE;',
                '  END LOOP;',
                '  RETURN coalesce(cardinality($8), 0);',
                'END'));
    EXCEPTION WHEN insufficient_privilege THEN
        RETURN NULL;
    END;
    PERFORM set_config('vantage.apply_dispatchers', (v_count + 1)::text, false);
    RETURN v_name;
END
$function$
;

-- function wh_statement_is_plain_write(text)
CREATE OR REPLACE FUNCTION vantage.wh_statement_is_plain_write(p_statement text)
 RETURNS boolean
 LANGUAGE sql
 IMMUTABLE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT p_statement ~* '^\s*(insert|update|delete|merge)\s'
       AND p_statement !~* 'returning'
       AND regexp_replace(p_statement, '[\s;]+$', '') !~ ';';
$function$
;

-- function wh_statement_mentions_extra_params(text)
CREATE OR REPLACE FUNCTION vantage.wh_statement_mentions_extra_params(p_statement text)
 RETURNS boolean
 LANGUAGE sql
 IMMUTABLE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT p_statement ~ '\$0*([89]|[1-9][0-9])';
$function$
;

-- function wh_statement_returns_no_rows(text)
CREATE OR REPLACE FUNCTION vantage.wh_statement_returns_no_rows(p_statement text)
 RETURNS boolean
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
DECLARE
    -- One element per character: reading the text by position (substr) would walk it from
    -- its start at every step in a multibyte encoding, quadratic in its length.
    v_ch    text[] := string_to_array(regexp_replace(p_statement, '[\s;]+$', ''), NULL);
    v_len   int := coalesce(cardinality(v_ch), 0);
    v_i     int := 1;
    v_j     int;
    v_c     text;
    v_depth int := 0;
    -- The statement at depth 0: literals and quoted identifiers as x, comments as a space,
    -- every parenthesised part as a space (gathered as pieces: appending to a text copies it).
    v_parts text[] := '{}';
    v_n     int := 0;
    v_top   text;
BEGIN
    IF wh_statement_mentions_extra_params(p_statement) THEN
        RETURN false;
    END IF;
    IF wh_statement_is_plain_write(p_statement) THEN
        RETURN true;
    END IF;
    WHILE v_i <= v_len LOOP
        v_c := v_ch[v_i];
        IF v_c = '''' OR v_c = '"' THEN
            -- E'...', U&'...', B'...', X'...' read backslashes or are not text: not ours to read.
            IF v_i > 1 AND v_ch[v_i - 1] ~ '[[:alnum:]_&$]' THEN
                RETURN false;
            END IF;
            v_j := v_i + 1;
            LOOP
                IF v_j > v_len THEN
                    RETURN false;   -- unterminated
                END IF;
                IF v_ch[v_j] = v_c THEN
                    EXIT WHEN coalesce(v_ch[v_j + 1], '') <> v_c;
                    v_j := v_j + 1;  -- a doubled quote stands for itself
                END IF;
                v_j := v_j + 1;
            END LOOP;
            IF v_depth = 0 THEN
                v_n := v_n + 1;
                v_parts[v_n] := ' x ';
            END IF;
            v_i := v_j + 1;
            CONTINUE;
        ELSIF v_c = '-' AND v_ch[v_i + 1] = '-' THEN
            v_j := v_i + 2;
            WHILE v_j <= v_len AND v_ch[v_j] <> chr(10) LOOP
                v_j := v_j + 1;
            END LOOP;
            EXIT WHEN v_j > v_len;  -- a comment to the end
            v_n := v_n + 1;
            v_parts[v_n] := ' ';
            v_i := v_j + 1;
            CONTINUE;
        ELSIF v_c = '/' AND v_ch[v_i + 1] = '*' THEN
            RETURN false;
        ELSIF v_c = '$' AND coalesce(v_ch[v_i + 1], '') !~ '[0-9]' THEN
            RETURN false;           -- a dollar-quoted string
        ELSIF v_c = ';' THEN
            RETURN false;           -- more than one statement
        ELSIF v_c = '(' THEN
            IF v_depth = 0 THEN
                v_n := v_n + 1;
                v_parts[v_n] := ' ';
            END IF;
            v_depth := v_depth + 1;
        ELSIF v_c = ')' THEN
            v_depth := v_depth - 1;
            IF v_depth < 0 THEN
                RETURN false;
            END IF;
        ELSIF v_depth = 0 THEN
            v_n := v_n + 1;
            v_parts[v_n] := v_c;
        END IF;
        v_i := v_i + 1;
    END LOOP;
    IF v_depth <> 0 THEN
        RETURN false;
    END IF;
    v_top := lower(array_to_string(v_parts, ''));
    -- WITH [RECURSIVE] name AS [[NOT] MATERIALIZED] (...) [, ...], then a write, and no
    -- RETURNING of its own.
    RETURN v_top ~ ('^\s*with\s+(recursive\s+)?'
                    || '([a-z_][a-z0-9_$]*|x)\s*as\s+((not\s+)?materialized\s+)?'
                    || '(,\s*([a-z_][a-z0-9_$]*|x)\s*as\s+((not\s+)?materialized\s+)?)*'
                    || '(insert|update|delete|merge)\s')
       AND v_top !~ '\mreturning\M';
END
$function$
;

-- function wh_version_behind(text,integer)
CREATE OR REPLACE FUNCTION vantage.wh_version_behind(p_perspective_name text, p_version integer)
 RETURNS bigint
 LANGUAGE sql
 STABLE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT (SELECT count(*) FROM wh_perspective_events w WHERE w.perspective_name = v.registry_name)
         + CASE WHEN v.state = 'building' THEN
               greatest(coalesce(v.backfill_target,
                                 (SELECT max(e.global_position) FROM wh_event_store e), 0)
                        - v.backfill_position, 0)
           ELSE 0 END
    FROM wh_perspective_versions v
    WHERE v.perspective_name = p_perspective_name AND v.version = p_version;
$function$
;

-- function wh_version_fence_key(text)
CREATE OR REPLACE FUNCTION vantage.wh_version_fence_key(p_registry_name text)
 RETURNS bigint
 LANGUAGE sql
 STABLE PARALLEL SAFE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT hashtextextended('vantage:version-fence:' || current_schema() || ':' || p_registry_name, 0);
$function$
;

-- function wh_xid8(xid)
CREATE OR REPLACE FUNCTION vantage.wh_xid8(p_xid xid)
 RETURNS xid8
 LANGUAGE sql
 STABLE
 SET search_path TO 'vantage', 'pg_temp'
AS $function$
    SELECT CASE WHEN p_xid IS NULL THEN NULL ELSE (
        SELECT (n - n % 4294967296 + x - CASE WHEN x > n % 4294967296 THEN 4294967296 ELSE 0 END)::text::xid8
        FROM (SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS n,
                     p_xid::text::bigint AS x) t) END;
$function$
;

-- trigger wh_dead_letter_history_append_only
CREATE TRIGGER wh_dead_letter_history_append_only BEFORE DELETE OR UPDATE ON vantage.wh_dead_letter_history FOR EACH ROW EXECUTE FUNCTION wh_dead_letter_history_append_only();

-- trigger wh_dead_letters_fingerprint
CREATE TRIGGER wh_dead_letters_fingerprint BEFORE INSERT OR UPDATE ON vantage.wh_dead_letters FOR EACH ROW EXECUTE FUNCTION wh_dead_letters_fingerprint();

-- trigger wh_event_store_fan_out
CREATE TRIGGER wh_event_store_fan_out AFTER INSERT ON vantage.wh_event_store REFERENCING NEW TABLE AS new_events FOR EACH STATEMENT EXECUTE FUNCTION wh_event_store_fan_out();

-- trigger wh_perspective_events_wake_lanes
CREATE TRIGGER wh_perspective_events_wake_lanes AFTER INSERT ON vantage.wh_perspective_events REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION wh_perspective_events_wake_lanes();

-- trigger wh_perspective_lanes_after_delete
CREATE TRIGGER wh_perspective_lanes_after_delete AFTER DELETE ON vantage.wh_perspective_events REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION wh_perspective_lanes_after_delete();

-- trigger wh_perspective_lanes_after_instance_gone
CREATE TRIGGER wh_perspective_lanes_after_instance_gone AFTER DELETE ON vantage.wh_service_instances REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION wh_perspective_lanes_after_instance_gone();

-- trigger wh_perspective_lanes_after_release
CREATE TRIGGER wh_perspective_lanes_after_release AFTER UPDATE ON vantage.wh_perspective_events FOR EACH ROW WHEN ((((new.instance_id IS NULL) AND ((old.instance_id IS NOT NULL) OR (new.scheduled_for < old.scheduled_for))) OR (new.lease_expiry < old.lease_expiry))) EXECUTE FUNCTION wh_perspective_lanes_after_release();

-- trigger wh_perspective_version_history_append_only
CREATE TRIGGER wh_perspective_version_history_append_only BEFORE DELETE OR UPDATE ON vantage.wh_perspective_version_history FOR EACH ROW EXECUTE FUNCTION wh_perspective_version_history_append_only();
