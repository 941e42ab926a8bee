-- vantage 0026: a statement that returns no rows is compiled into the session's dispatcher,
-- whatever its form (wh_statement_dispatcher and wh_create_version_apply, redefined;
-- wh_statement_returns_no_rows, new).
--
-- Found by `vantage soak` (RELIABILITY.md, sixteenth run): a profile of the throwaway server
-- (perf, 20 s of the steady phase) put a sixth of PostgreSQL's CPU time in parsing and planning
-- the perspectives' statements, once per event. The soak's statement, like many a read model's,
-- is a data-modifying WITH (count the application, then record it on its lane), and the
-- dispatcher inlined only a single plain INSERT/UPDATE/DELETE/MERGE: everything else ran through
-- EXECUTE, which parses and plans its text at every call.
--
-- PL/pgSQL runs any statement that returns no rows as it is, with its plan kept for the
-- session. So the dispatcher now inlines, besides a plain write, a WITH whose own statement
-- (after its list of named subqueries) is an INSERT, UPDATE, DELETE or MERGE without RETURNING:
-- RETURNING inside a subquery feeds the statement and returns nothing to the caller. The text is
-- read by a small lexer (literals, quoted identifiers, line comments, parentheses); anything it
-- cannot read for sure (a dollar-quoted or escape string, a block comment, a second statement,
-- unbalanced text) runs through EXECUTE as before. A statement inlined that returned rows would
-- fail every event it runs for ("query has no destination for result data"), so every doubt
-- means EXECUTE.
--
-- A versioned perspective's apply function (wh_create_version_apply, redefined) decides the same
-- way.
--
-- Contract: no signature, result or behaviour changes; a statement runs the same way, only
-- planned once per session instead of once per event.

CREATE FUNCTION wh_statement_returns_no_rows(p_statement text)
 RETURNS boolean
 LANGUAGE plpgsql
 IMMUTABLE
AS $$
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
$$;

CREATE OR REPLACE FUNCTION wh_statement_dispatcher(p_statements text[])
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
$$;

CREATE OR REPLACE FUNCTION wh_create_version_apply(p_schema text, p_registry text, p_statements jsonb)
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
$$;
