-- vantage schema, part 12: the batched apply runs each statement inside the dispatcher itself.
--
-- Since 0009 each distinct plain-write statement was a PL/pgSQL function of its own, and the
-- dispatcher called it once per event (PERFORM pg_temp.vantage_statement_…(…)): one more
-- executor start and end and one more PL/pgSQL call frame per event, about a third of the
-- apply's server time for a one-line upsert (issue 9; BENCHMARKS.md run 7). Now the dispatcher
-- holds the statements themselves, verbatim, one per CASE branch, and its first seven
-- parameters are the statements' $1 … $7 (unnamed, typed as before: jsonb, uuid, uuid, text,
-- bigint, int, jsonb); for each event it assigns those the statements mention from the arrays
-- and runs the event's statement, whose plan PL/pgSQL caches for the session as before. The
-- semantics are those of 0005 and 0009: same parameters and types, same order, same
-- transaction, each statement sees the effects of the ones before it, the first error fails the
-- call.
--
-- What stays on EXECUTE (per event, with the same seven parameters) is what was there before:
-- statements that return rows, sessions that may not create temporary objects, sessions that
-- already hold 16 dispatchers; and also a plain write that mentions a parameter beyond $7
-- (it fails on EXECUTE as it failed before, instead of reading the dispatcher's arrays).
-- Parameters the batch's statements never mention may be sent as NULL arrays (the daemon does
-- that: payloads no statement reads are not sent at all); their elements are then NULL.

-- Whether a statement mentions a parameter beyond $7 ($8, $10, $007 …: any $ followed by digits
-- whose value is more than 7). Conservative: a "$8" inside a string literal counts too, which
-- only costs speed (EXECUTE).
CREATE FUNCTION wh_statement_mentions_extra_params(p_statement text)
RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT p_statement ~ '\$0*([89]|[1-9][0-9])';
$$;

-- The name of this session's dispatcher for p_statements, created on first use; NULL when the
-- statements must go through EXECUTE one by one (see 0009). Dispatchers of 0009 (named
-- vantage_apply_…) a session created before this migration are no longer used.
CREATE OR REPLACE FUNCTION wh_statement_dispatcher(p_statements text[])
RETURNS text
LANGUAGE plpgsql AS $$
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

CREATE OR REPLACE FUNCTION apply_perspective_statements(
    p_statements text[],
    p_statement int[],
    p_data jsonb[],
    p_stream_id uuid[],
    p_event_id uuid[],
    p_event_type text[],
    p_global_position bigint[],
    p_stream_version int[],
    p_metadata jsonb[])
RETURNS int
LANGUAGE plpgsql AS $$
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

