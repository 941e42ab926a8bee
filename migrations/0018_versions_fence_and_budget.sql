-- vantage 0018: versions never wait on a vacuum, and backfill batches are bounded in time
-- (switch_perspective_version and register_perspective_version, part 12, redefined;
-- backfill_perspective_version, 0016, recreated with p_budget_ms; wh_version_fence_key and
-- wh_create_version_apply, new; every registered version's apply functions created again with
-- the fence).
--
-- Found by `vantage bench --checks versions`: cutovers and rollbacks took 7 ms at the median
-- and up to 757 ms. A cutover locked the live version's tables IN EXCLUSIVE MODE so that the
-- live version applied nothing between its check ("the target has applied every event the live
-- one has") and its commit. Every mode that blocks writers also conflicts with SHARE UPDATE
-- EXCLUSIVE, which VACUUM and ANALYZE hold: right after a backfill, autovacuum works on exactly
-- those tables, and it gives way to a waiting lock only after deadlock_timeout (1 s by
-- default), or never for an anti-wraparound vacuum. Meanwhile the live version's own batches
-- queued behind the waiting cutover.
--
-- Now the only writer of a version's tables vantage knows, the version's apply function
-- (<schema>.vantage_apply, which every drain batch, careful pass and backfill batch of the
-- version goes through), first takes the version's fence, a shared transaction-level advisory
-- lock (key wh_version_fence_key(registry name), computed at creation and written into the
-- function as a constant: inside it the search path is the version's). A cutover or rollback
-- takes the live version's fence exclusively (under its 5 s lock_timeout) before its check:
-- it waits for the live version's applies in flight, holds back new ones until it commits,
-- and conflicts with nothing else (not vacuum, not readers, not producers, who never take it).
-- A second take of the fence in one transaction finds it in the backend's own lock table.
-- Invariant kept: between the check and the commit of a switch, the live version commits no
-- apply, so no reader sees the read model step back. Writes to a version's tables made
-- outside vantage are not fenced (they never were part of the check).
--
-- Backfill batches were bounded in events only (worker.backfill_batch_size), so one took as long
-- as its events' statements: 61 ms on average and up to 141 ms in the same bench run, and with
-- a slow statement a batch is as long as a thousand of them. A batch now also ends once it has
-- run for p_budget_ms (the daemon passes 50 ms), looking at the events in steps of 100.
--
-- Contract: switch_perspective_version and register_perspective_version keep their signatures
-- and results; backfill_perspective_version (not part of the contract) gains p_budget_ms.

-- The advisory-lock key of a version's fence, namespaced like wh_perspective_lock_key.
CREATE FUNCTION wh_version_fence_key(p_registry_name text)
 RETURNS bigint
 LANGUAGE sql
 STABLE PARALLEL SAFE
AS $$
    SELECT hashtextextended('vantage:version-fence:' || current_schema() || ':' || p_registry_name, 0);
$$;

-- Creates (or replaces) a version's apply functions in p_schema: vantage_apply runs one event's
-- statement after taking the version's fence; vantage_apply_many runs many in order (the
-- backfill's batch). Their search path is the version's schema, then the caller's path.
CREATE FUNCTION wh_create_version_apply(p_schema text, p_registry text, p_statements jsonb)
 RETURNS void
 LANGUAGE plpgsql
AS $$
DECLARE
    v_path  text := current_setting('search_path');
    v_fence bigint := wh_version_fence_key(p_registry);
    v_cases text := '';
    v_else  text;
BEGIN
    PERFORM set_config('search_path', format('%I, %s', p_schema, v_path), true);
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
                         'perspective "' || replace(p_registry, '%', '%%')
                         || '" has no statement for event type "%"', 'VT003');
    ELSIF wh_statement_is_plain_write(v_else) AND NOT wh_statement_mentions_extra_params(v_else) THEN
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
$$;

-- Registration as in part 12; the apply functions come from wh_create_version_apply.
CREATE OR REPLACE FUNCTION register_perspective_version(p_perspective_name text, p_version integer, p_read_schema text, p_tables text[], p_event_types text[], p_statements jsonb, p_setup text, p_actor text DEFAULT 'vantage'::text)
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
$$;

-- As in part 12, with the fence instead of table locks (see the header).
CREATE OR REPLACE FUNCTION switch_perspective_version(p_perspective_name text, p_kind text, p_version integer, p_actor text)
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
$$;

-- A backfill batch (0016's text, in steps): it looks at the events after its position 100 at a
-- time, and ends after p_max events or, with p_budget_ms, after the step that has used up the
-- budget (measured from the statement's start), so a slow statement or a busy server makes
-- batches smaller instead of longer. Each step diverts and applies its own events exactly as
-- 0016's whole batch did (the rule is per event and in position order, so a batch cut in
-- steps decides the same); the position recorded is the last event looked at.
DROP FUNCTION backfill_perspective_version(text, integer, integer, boolean);
CREATE FUNCTION backfill_perspective_version(p_perspective_name text, p_version integer, p_max integer DEFAULT 1000, p_divert boolean DEFAULT false, p_budget_ms integer DEFAULT NULL)
 RETURNS TABLE(outcome text, applied integer, backfill_position bigint, backfill_target bigint, diverted integer)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
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
$$;

-- The versions registered before this migration get the fence too.
DO $$
DECLARE
    v record;
BEGIN
    FOR v IN SELECT version_schema, registry_name, statements FROM wh_perspective_versions
             WHERE state <> 'retired' ORDER BY registry_name LOOP
        PERFORM wh_create_version_apply(v.version_schema, v.registry_name, v.statements);
    END LOOP;
END
$$;
