-- vantage baseline, part 7 of 9: applying SQL perspectives in the database.
--
-- A batch of one perspective's events runs through one call: apply_and_complete_perspective_events
-- executes each event's statement (parameters $1 data, $2 stream, $3 event id, $4 type,
-- $5 global position, $6 version, $7 metadata) and completes the work rows, in the caller's
-- transaction, so effects and completion commit together (exactly once). A session compiles
-- the batch's statements into a temporary dispatcher function once (at most 16 per session) and
-- reuses it; a statement that is not a plain write runs through EXECUTE. Parameters no
-- statement mentions are never assigned. The dry run of a replay reads a read-model row by its
-- primary key (wh_read_model_row) to show what would change.

-- A single INSERT/UPDATE/DELETE/MERGE without RETURNING: inlined into the dispatcher.
CREATE FUNCTION wh_statement_is_plain_write(p_statement text)
 RETURNS boolean
 LANGUAGE sql
 IMMUTABLE
AS $$
    SELECT p_statement ~* '^\s*(insert|update|delete|merge)\s'
       AND p_statement !~* 'returning'
       AND regexp_replace(p_statement, '[\s;]+$', '') !~ ';';
$$;

-- $8 and above are the dispatcher's own: such a statement runs through EXECUTE.
CREATE FUNCTION wh_statement_mentions_extra_params(p_statement text)
 RETURNS boolean
 LANGUAGE sql
 IMMUTABLE
AS $$
    SELECT p_statement ~ '\$0*([89]|[1-9][0-9])';
$$;

-- The session's dispatcher for a statement list (created once; NULL past the cap or without
-- the privilege to create temporary functions, and the caller falls back to EXECUTE).
CREATE FUNCTION wh_statement_dispatcher(p_statements text[])
 RETURNS text
 LANGUAGE plpgsql
AS $$
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
        IF wh_statement_is_plain_write(p_statements[i])
           AND NOT wh_statement_mentions_extra_params(p_statements[i]) THEN
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
$$;

-- Runs each event's statement, in order.
CREATE FUNCTION apply_perspective_statements(p_statements text[], p_statement integer[], p_data jsonb[], p_stream_id uuid[], p_event_id uuid[], p_event_type text[], p_global_position bigint[], p_stream_version integer[], p_metadata jsonb[])
 RETURNS integer
 LANGUAGE plpgsql
AS $$
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
$$;

-- The daemon's batch: statements, then the fenced completion, in one call.
CREATE FUNCTION apply_and_complete_perspective_events(p_instance_id uuid, p_event_work_ids uuid[], p_statements text[], p_statement integer[], p_data jsonb[], p_stream_id uuid[], p_event_id uuid[], p_event_type text[], p_global_position bigint[], p_stream_version integer[], p_metadata jsonb[])
 RETURNS integer
 LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM apply_perspective_statements(p_statements, p_statement, p_data, p_stream_id,
                                         p_event_id, p_event_type, p_global_position,
                                         p_stream_version, p_metadata);
    RETURN complete_perspective_events(p_instance_id, p_event_work_ids);
END
$$;

-- The primary key columns of a read-model table (for the dry run).
CREATE FUNCTION wh_primary_key(p_table regclass)
 RETURNS text[]
 LANGUAGE sql
 STABLE
AS $$
    SELECT array_agg(a.attname::text ORDER BY k.ord)
    FROM pg_index i
    CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
    WHERE i.indrelid = p_table AND i.indisprimary;
$$;

-- A read-model row, looked up by the primary key values in p_row (for the dry run).
CREATE FUNCTION wh_read_model_row(p_table regclass, p_row jsonb)
 RETURNS jsonb
 LANGUAGE plpgsql
 STABLE
AS $$
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
$$;
