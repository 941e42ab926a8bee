-- vantage 0012: versioned perspectives (docs/versions.md).
--
-- A versioned perspective ("order_summary", with read_schema "rm") has versions 1, 2, …, each
-- with its own schema ("order_summary_v2") holding the tables its setup creates, and its own
-- registry row ("order_summary@v2"), so ordering, attempts, dead letters and cooldown hold per
-- version exactly as for any perspective. Readers query read_schema, whose views point at the
-- live version; cutover and rollback re-point them in one transaction.
--
-- A version's definition (event types, statements, setup, tables) is stored here when it is
-- first registered, so any daemon keeps every version that is not retired current, whatever its
-- own configuration says. The statements run inside a function created in the version's
-- schema with the search path fixed to it: unqualified names resolve there, and the daemon
-- sends one statement per event like for any SQL perspective.
--
-- Backfill. A new version's registry row makes the fan-out write its work rows for events from
-- then on; history is read from the event store by global_position, in bounded batches that
-- each commit with the position reached (no work row per historical event, no long
-- transaction, resumable). Which events need it: those without a work row of the version. An
-- event lacks one only if its producer's fan-out read the registry before the registration
-- committed; so the backfill first waits until every transaction (and, where the role may see
-- them, every snapshot) older than the registration has ended (the horizon), and from then on
-- every event it has not seen either is visible or has a work row. Claims skip a version until
-- its backfill is done, so a lane's history is applied before its new events.
--
-- Producers are untouched: the fan-out and the registry read are as before.

CREATE TABLE wh_perspective_versions (
    perspective_name  text        NOT NULL,
    version           int         NOT NULL CHECK (version >= 1),
    -- Its row in wh_perspectives (perspective_name || '@v' || version).
    registry_name     text        NOT NULL UNIQUE,
    read_schema       text        NOT NULL,
    version_schema    text        NOT NULL UNIQUE,
    tables            text[]      NOT NULL,
    event_types       text[]      NOT NULL,
    -- event type → statement ('*' = the catch-all), as configured.
    statements        jsonb       NOT NULL,
    setup             text        NOT NULL,
    digest            text        NOT NULL,
    -- What the daemon runs for each event of this version ($1 … $7 as for any statement).
    apply_statement   text        NOT NULL,
    state             text        NOT NULL DEFAULT 'building'
                      CHECK (state IN ('building', 'ready', 'live', 'retired')),
    -- Backfill: events up to this position have been looked at.
    backfill_position bigint      NOT NULL DEFAULT 0,
    -- The event store's end when the backfill began (for progress only).
    backfill_target   bigint,
    -- Transactions before this one may have missed the fan-out (see above).
    backfill_horizon  xid8,
    backfill_applied  bigint      NOT NULL DEFAULT 0,
    backfill_started_at timestamptz,
    backfill_done_at  timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now(),
    live_since        timestamptz,
    retired_at        timestamptz,
    PRIMARY KEY (perspective_name, version)
);

CREATE UNIQUE INDEX wh_perspective_versions_one_live
    ON wh_perspective_versions (perspective_name) WHERE state = 'live';

-- Every transition, append-only: who made which version live, rolled back, retired.
CREATE TABLE wh_perspective_version_history (
    history_id       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    perspective_name text        NOT NULL,
    kind             text        NOT NULL
                     CHECK (kind IN ('Registered', 'Live', 'Cutover', 'Rollback', 'Retired')),
    from_version     int,
    to_version       int,
    at               timestamptz NOT NULL DEFAULT now(),
    actor            text        NOT NULL,
    detail           text
);

CREATE INDEX wh_perspective_version_history_name_idx
    ON wh_perspective_version_history (perspective_name, history_id);

-- An audit trail, append-only in the database (as the dead letters' history).
CREATE FUNCTION wh_perspective_version_history_append_only()
 RETURNS trigger
 LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'wh_perspective_version_history is append-only (% refused)', TG_OP
        USING ERRCODE = '55000';
END
$$;

CREATE TRIGGER wh_perspective_version_history_append_only
    BEFORE UPDATE OR DELETE ON wh_perspective_version_history
    FOR EACH ROW EXECUTE FUNCTION wh_perspective_version_history_append_only();

-- Claims skip a version whose backfill is not done (its new events wait behind its history).
CREATE OR REPLACE FUNCTION wh_claimable_perspectives(p_names text[])
 RETURNS text[]
 LANGUAGE sql
AS $$
    SELECT array_agg(p.perspective_name ORDER BY random())
    FROM wh_perspectives p
    WHERE (p_names IS NULL OR p.perspective_name = ANY (p_names))
      AND p.paused_at IS NULL
      AND p.rebuild_up_to IS NULL
      AND NOT EXISTS (SELECT 1 FROM wh_perspective_versions v
                      WHERE v.registry_name = p.perspective_name AND v.state = 'building')
      AND pg_try_advisory_xact_lock_shared(wh_perspective_lock_key(p.perspective_name));
$$;

-- Registrations and transitions of one perspective's versions are serialised by this lock.
CREATE FUNCTION wh_lock_perspective_versions(p_perspective_name text)
 RETURNS void
 LANGUAGE sql
AS $$
    SELECT pg_advisory_xact_lock(
        hashtextextended('vantage:versions:' || current_schema() || ':' || p_perspective_name, 0));
$$;

-- Registers a version (idempotent): on first registration creates its schema, runs its setup
-- there, checks that setup created every table, creates its apply functions and its registry
-- row. A version registered with another definition raises VT001 naming what differs; a
-- retired version raises VT002.
CREATE FUNCTION register_perspective_version(p_perspective_name text, p_version integer, p_read_schema text, p_tables text[], p_event_types text[], p_statements jsonb, p_setup text, p_actor text DEFAULT 'vantage'::text)
 RETURNS TABLE(registry_name text, version_schema text, apply_statement text, state text, created boolean)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
#variable_conflict use_column
DECLARE
    v_row      wh_perspective_versions;
    v_schema   text := p_perspective_name || '_v' || p_version;
    v_registry text := p_perspective_name || '@v' || p_version;
    v_digest   text;
    v_path     text := current_setting('search_path');
    v_cases    text := '';
    v_else     text;
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

    -- One event: its type's statement (inlined when it is a plain write, as the batch
    -- dispatcher does), else the catch-all, else an error (an event of a type the version does
    -- not handle is never completed silently).
    SELECT string_agg(
               CASE WHEN wh_statement_is_plain_write(s.value)
                         AND NOT wh_statement_mentions_extra_params(s.value)
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
                         'perspective "' || replace(v_registry, '%', '%%')
                         || '" has no statement for event type "%"', 'VT003');
    ELSIF wh_statement_is_plain_write(v_else) AND NOT wh_statement_mentions_extra_params(v_else) THEN
        v_else := regexp_replace(v_else, '[\s;]+$', '') || chr(10) || ';';
    ELSE
        v_else := format('    EXECUTE %L USING $1, $2, $3, $4, $5, $6, $7;', v_else);
    END IF;
    EXECUTE format(
        'CREATE FUNCTION %I.vantage_apply(jsonb, uuid, uuid, text, bigint, int, jsonb) '
        'RETURNS void LANGUAGE plpgsql SET search_path FROM CURRENT AS %L',
        v_schema,
        concat_ws(chr(10),
            '#variable_conflict use_column',
            'BEGIN',
            '  CASE $4',
            coalesce(v_cases, ''),
            '    ELSE',
            v_else,
            '  END CASE;',
            'END'));
    -- Many events, in order (the backfill's batch).
    EXECUTE format(
        'CREATE FUNCTION %I.vantage_apply_many(jsonb[], uuid[], uuid[], text[], bigint[], int[], jsonb[]) '
        'RETURNS int LANGUAGE plpgsql SET search_path FROM CURRENT AS %L',
        v_schema,
        format(concat_ws(chr(10),
            'BEGIN',
            '  FOR i IN 1 .. coalesce(cardinality($1), 0) LOOP',
            '    PERFORM %I.vantage_apply($1[i], $2[i], $3[i], $4[i], $5[i], $6[i], $7[i]);',
            '  END LOOP;',
            '  RETURN coalesce(cardinality($1), 0);',
            'END'), v_schema));
    PERFORM set_config('search_path', v_path, true);

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
$$;

-- An xid (32 bits, as backend_xmin shows it) as the xid8 it is now: xids are assigned in order,
-- so one at or below the next xid's low bits is of this epoch, one above it of the previous.
CREATE FUNCTION wh_xid8(p_xid xid)
 RETURNS xid8
 LANGUAGE sql
 STABLE
AS $$
    SELECT CASE WHEN p_xid IS NULL THEN NULL ELSE (
        SELECT (n - n % 4294967296 + x - CASE WHEN x > n % 4294967296 THEN 4294967296 ELSE 0 END)::text::xid8
        FROM (SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS n,
                     p_xid::text::bigint AS x) t) END;
$$;

-- Whether every transaction older than p_horizon has ended, and every snapshot older than it
-- that this role may see (pg_stat_activity shows other roles' backend_xmin only to members of
-- pg_read_all_stats): until then an event without a work row may still commit.
CREATE FUNCTION wh_horizon_passed(p_horizon xid8)
 RETURNS boolean
 LANGUAGE sql
 STABLE
AS $$
    SELECT pg_snapshot_xmin(pg_current_snapshot()) >= p_horizon
       AND NOT EXISTS (
           SELECT 1 FROM pg_stat_activity a
           WHERE a.pid <> pg_backend_pid()
             AND a.datname = current_database()
             AND a.backend_type = 'client backend'
             AND wh_xid8(a.backend_xmin) < p_horizon);
$$;

-- Makes p_version the live version: re-points every view of read_schema at its tables, in the
-- caller's transaction (readers see the old version or the new one, never a mix or an error).
CREATE FUNCTION wh_make_live(p_perspective_name text, p_version integer, p_kind text, p_actor text)
 RETURNS integer
 LANGUAGE plpgsql
AS $$
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
$$;

-- One backfill batch of a building version: looks at the next p_max events after its position
-- and applies, in order, those of its types that have no work row of the version (the others
-- are the drain's), then records the position, in the caller's transaction. Another backfiller
-- holding the version makes this a no-op ('busy'). Until the horizon has passed nothing is read
-- ('waiting'). At the visible end it is done: 'ready', or 'live' when no version is live yet.
CREATE FUNCTION backfill_perspective_version(p_perspective_name text, p_version integer, p_max integer DEFAULT 1000)
 RETURNS TABLE(outcome text, applied integer, backfill_position bigint, backfill_target bigint)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
#variable_conflict use_column
DECLARE
    v        wh_perspective_versions;
    v_last   bigint;
    v_n      int := 0;
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
        RETURN QUERY SELECT 'busy'::text, 0, NULL::bigint, NULL::bigint;
        RETURN;
    END IF;
    IF v.state <> 'building' THEN
        RETURN QUERY SELECT v.state, 0, v.backfill_position, v.backfill_target;
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
        RETURN QUERY SELECT 'waiting'::text, 0, v.backfill_position, v.backfill_target;
        RETURN;
    END IF;

    SELECT max(w.global_position) INTO v_last
    FROM (SELECT e.global_position FROM wh_event_store e
          WHERE e.global_position > v.backfill_position
          ORDER BY e.global_position LIMIT greatest(p_max, 1)) w;
    IF v_last IS NULL THEN
        -- The visible end: every later event has a work row of this version.
        UPDATE wh_perspective_versions x SET state = 'ready', backfill_done_at = now()
        WHERE x.perspective_name = p_perspective_name AND x.version = p_version;
        IF NOT EXISTS (SELECT 1 FROM wh_perspective_versions x
                       WHERE x.perspective_name = p_perspective_name AND x.state = 'live') THEN
            PERFORM wh_make_live(p_perspective_name, p_version, 'Live', 'vantage backfill');
            RETURN QUERY SELECT 'live'::text, 0, v.backfill_position, v.backfill_target;
            RETURN;
        END IF;
        RETURN QUERY SELECT 'ready'::text, 0, v.backfill_position, v.backfill_target;
        RETURN;
    END IF;

    SELECT array_agg(e.event_data ORDER BY e.global_position),
           array_agg(e.stream_id ORDER BY e.global_position),
           array_agg(e.event_id ORDER BY e.global_position),
           array_agg(e.event_type ORDER BY e.global_position),
           array_agg(e.global_position ORDER BY e.global_position),
           array_agg(e.stream_version ORDER BY e.global_position),
           array_agg(e.metadata ORDER BY e.global_position)
    INTO v_data, v_stream, v_id, v_type, v_pos, v_ver, v_meta
    FROM wh_event_store e
    WHERE e.global_position > v.backfill_position AND e.global_position <= v_last
      AND (e.event_type = ANY (v.event_types) OR '*' = ANY (v.event_types))
      AND NOT EXISTS (SELECT 1 FROM wh_perspective_events w
                      WHERE w.perspective_name = v.registry_name AND w.event_id = e.event_id);
    IF v_id IS NOT NULL THEN
        EXECUTE format('SELECT %I.vantage_apply_many($1, $2, $3, $4, $5, $6, $7)', v.version_schema)
            INTO v_n
            USING v_data, v_stream, v_id, v_type, v_pos, v_ver, v_meta;
    END IF;
    UPDATE wh_perspective_versions x
    SET backfill_position = v_last, backfill_applied = x.backfill_applied + v_n
    WHERE x.perspective_name = p_perspective_name AND x.version = p_version;
    RETURN QUERY SELECT 'applied'::text, v_n, v_last, v.backfill_target;
END
$$;

-- Events a version has not applied yet: its pending work rows, plus, while it backfills, the
-- events of its types after its backfill position.
CREATE FUNCTION wh_version_behind(p_perspective_name text, p_version integer)
 RETURNS bigint
 LANGUAGE sql
 STABLE
AS $$
    SELECT (SELECT count(*) FROM wh_perspective_events w WHERE w.perspective_name = v.registry_name)
         + CASE WHEN v.state = 'building' THEN
               (SELECT count(*) FROM wh_event_store e
                WHERE e.global_position > v.backfill_position
                  AND (e.event_type = ANY (v.event_types) OR '*' = ANY (v.event_types))
                  AND NOT EXISTS (SELECT 1 FROM wh_perspective_events w
                                  WHERE w.perspective_name = v.registry_name
                                    AND w.event_id = e.event_id))
           ELSE 0 END
    FROM wh_perspective_versions v
    WHERE v.perspective_name = p_perspective_name AND v.version = p_version;
$$;

-- Cutover (p_kind 'Cutover', to p_version or the newest version not retired) or rollback
-- (p_kind 'Rollback', to the version that was live before the current one). Refusals are
-- outcomes, not errors: 'unknown' (no such version or perspective), 'retired', 'live' (already
-- live), 'building' (behind = events it has yet to apply), 'no_previous' (nothing to roll back
-- to), 'behind_live' (it has not applied some events the live version has: behind = how many;
-- try again in a moment). The live version's tables are locked against writes (not reads) for
-- the check and the swap, so what readers saw of it is in what they see next.
CREATE FUNCTION switch_perspective_version(p_perspective_name text, p_kind text, p_version integer, p_actor text)
 RETURNS TABLE(outcome text, from_version integer, to_version integer, behind bigint)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
#variable_conflict use_column
DECLARE
    v_live wh_perspective_versions;
    v_to   wh_perspective_versions;
    v_target int := p_version;
    v_behind bigint;
    t text;
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
        FOREACH t IN ARRAY v_live.tables LOOP
            EXECUTE format('LOCK TABLE %I.%I IN EXCLUSIVE MODE', v_live.version_schema, t);
        END LOOP;
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
$$;

-- Retires a version that is not live: stops its fan-out (its registry row goes), deletes its
-- work rows and drops its schema. Outcomes: 'done', 'unknown', 'live' (refused), 'retired'
-- (already).
CREATE FUNCTION retire_perspective_version(p_perspective_name text, p_version integer, p_actor text)
 RETURNS TABLE(outcome text, dropped_rows bigint)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
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
$$;
