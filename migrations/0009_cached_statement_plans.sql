-- vantage schema, part 9: the batched apply of SQL perspectives keeps its statements' plans.
--
-- apply_perspective_statements (0005) ran each event's statement with EXECUTE, which parses and
-- plans it again for every event: about half of the apply's time for a one-line upsert. Now
-- each distinct statement that returns no rows becomes a PL/pgSQL function in the session's
-- temporary schema (its body is the statement, verbatim: $1 … $7 are the function's
-- parameters, exactly as they were EXECUTE's), whose plan PL/pgSQL caches for the session; and
-- each distinct list of statements gets a dispatcher, also temporary, that walks the events in
-- the order given and calls the right function, with no dynamic SQL per event. The semantics
-- are those of 0005: same parameters and types, same order, same transaction, the first error
-- fails the call.
--
-- What stays on EXECUTE, per event, as before: a statement that returns rows (a SELECT, or
-- RETURNING: PL/pgSQL refuses to run those without INTO), a session that may not create
-- temporary objects (TEMP revoked), and a session that already holds 16 dispatchers (many
-- different mixes of statements, e.g. a daemon with very many perspectives): the catalogue of a
-- long-lived pooled connection must not grow without bound.

-- Whether a statement is a plain write PL/pgSQL can run as it is: an INSERT, UPDATE, DELETE or
-- MERGE without RETURNING, with nothing after a semicolon but more semicolons and blanks
-- (stripped: PL/pgSQL has no empty statement). Conservative on purpose (a leading comment, a
-- WITH, a comment after the semicolon send it to EXECUTE): a false "no" only costs speed.
CREATE FUNCTION wh_statement_is_plain_write(p_statement text)
RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT p_statement ~* '^\s*(insert|update|delete|merge)\s'
       AND p_statement !~* 'returning'
       AND regexp_replace(p_statement, '[\s;]+$', '') !~ ';';
$$;

-- The name of this session's dispatcher for p_statements, created (with the functions of its
-- statements) on first use; NULL when the statements must go through EXECUTE (see above).
CREATE FUNCTION wh_statement_dispatcher(p_statements text[])
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_name  text := 'vantage_apply_' || md5(array_to_string(p_statements, E'\n;\n--vantage--\n'));
    v_count int := coalesce(nullif(current_setting('vantage.apply_dispatchers', true), '')::int, 0);
    v_fn    text;
    v_cases text := '';
BEGIN
    IF to_regprocedure(format('pg_temp.%I(int[], jsonb[], uuid[], uuid[], text[], bigint[], int[], jsonb[])',
                              v_name)) IS NOT NULL THEN
        RETURN v_name;
    END IF;
    IF v_count >= 16 THEN
        RETURN NULL;
    END IF;
    BEGIN
        FOR i IN 1 .. cardinality(p_statements) LOOP
            IF NOT wh_statement_is_plain_write(p_statements[i]) THEN
                v_cases := v_cases || format(
                    '      WHEN %s THEN EXECUTE %L USING p_data[i], p_stream_id[i], p_event_id[i], '
                    'p_event_type[i], p_global_position[i], p_stream_version[i], p_metadata[i];',
                    i, p_statements[i]) || chr(10);
                CONTINUE;
            END IF;
            v_fn := 'vantage_statement_' || md5(p_statements[i]);
            IF to_regprocedure(format('pg_temp.%I(jsonb, uuid, uuid, text, bigint, int, jsonb)',
                                      v_fn)) IS NULL THEN
                -- (a column named like a PL/pgSQL variable, e.g. "found", stays a column)
                EXECUTE format(
                    'CREATE FUNCTION pg_temp.%I(jsonb, uuid, uuid, text, bigint, int, jsonb) '
                    'RETURNS void LANGUAGE plpgsql AS %L',
                    v_fn, concat_ws(chr(10), '#variable_conflict use_column', 'BEGIN',
                                    regexp_replace(p_statements[i], '[\s;]+$', ''), ';', 'END'));
            END IF;
            v_cases := v_cases || format(
                '      WHEN %s THEN PERFORM pg_temp.%I(p_data[i], p_stream_id[i], p_event_id[i], '
                'p_event_type[i], p_global_position[i], p_stream_version[i], p_metadata[i]);',
                i, v_fn) || chr(10);
        END LOOP;
        EXECUTE format(
            'CREATE FUNCTION pg_temp.%I(p_statement int[], p_data jsonb[], p_stream_id uuid[], '
            'p_event_id uuid[], p_event_type text[], p_global_position bigint[], '
            'p_stream_version int[], p_metadata jsonb[]) RETURNS int LANGUAGE plpgsql AS %L',
            v_name,
            concat_ws(chr(10),
                'BEGIN',
                '  FOR i IN 1 .. coalesce(cardinality(p_statement), 0) LOOP',
                '    CASE p_statement[i]',
                v_cases || '    END CASE;',
                '  END LOOP;',
                '  RETURN coalesce(cardinality(p_statement), 0);',
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
        EXECUTE format('SELECT pg_temp.%I($1, $2, $3, $4, $5, $6, $7, $8)', v_dispatcher)
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

-- The optimistic pass's whole write in one call: the statements, then the completion of the
-- batch's rows (fenced, as complete_perspective_events). Returns how many rows were still ours:
-- fewer than given means a lease was lost and the caller must roll back.
CREATE FUNCTION apply_and_complete_perspective_events(
    p_instance_id uuid,
    p_event_work_ids uuid[],
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
BEGIN
    PERFORM apply_perspective_statements(p_statements, p_statement, p_data, p_stream_id,
                                         p_event_id, p_event_type, p_global_position,
                                         p_stream_version, p_metadata);
    RETURN complete_perspective_events(p_instance_id, p_event_work_ids);
END
$$;
