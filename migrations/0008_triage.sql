-- vantage schema, part 8: triage at scale.
--
-- * Error fingerprints. Every dead letter carries error_fingerprint, a stored generated column:
--   its perspective, event type, SQLSTATE (when the error text names one, as the daemon writes
--   it: "… (SQLSTATE 22P02)") and its error text with the variable parts masked (numbers, uuids,
--   quoted values, hex, the values of a unique violation's key). `vantage dlq groups` groups open
--   dead letters by it in the database, through a partial index, so millions of dead letters
--   are never loaded anywhere. The same functions give a failing work row its fingerprint
--   (from its last_error), so a parked head and the dead letter it becomes share one.
-- * Pausing a perspective: paused_at / paused_reason / paused_by on wh_perspectives. Claims skip
--   a paused perspective (wh_claimable_perspectives, and get_stream_events' own filter); work
--   already leased finishes, nothing is charged.

------------------------------------------------------------------------------------------------
-- Fingerprints
------------------------------------------------------------------------------------------------

-- The error that caused it: a dead letter's text is "<why it was moved>\nlast error: <the
-- handler's error>"; the handler's error is what groups.
CREATE FUNCTION wh_error_cause(p_error text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN strpos(p_error, 'last error: ') > 0
                THEN substring(p_error from '.*last error: (.*)$')
                ELSE p_error END;
$$;

-- The SQLSTATE the daemon recorded with the error ("… (SQLSTATE 23505)"), NULL when none.
CREATE FUNCTION wh_error_sqlstate(p_error text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT substring(wh_error_cause(p_error) from '\(SQLSTATE ([0-9A-Z]{5})\)');
$$;

-- The cause with its variable parts masked, whitespace collapsed, at most 500 characters.
-- In this order (inner first):
--   1. the SQLSTATE suffix goes (it is a component of its own); a key's values "=(…)" → "=(?)";
--   2. an identifier named as such (relation "x", column "x", constraint "x", …) is protected,
--      so the message still says which table or constraint;
--   3. other double-quoted and single-quoted values → "?" and '?';
--   4. uuids → <uuid>; 5. 0x… and runs of 8+ hex digits with a digit in them → <hex>;
--   6. numbers (whole words: "v2" and "order_2024" stay) → <n>; then the protection is undone.
CREATE FUNCTION wh_error_mask(p_error text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
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
$$;

-- The fingerprint: 12 hex digits of md5 over (perspective, event type, SQLSTATE, masked text).
CREATE FUNCTION wh_error_fingerprint(p_perspective text, p_event_type text, p_error text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT left(md5(concat_ws(chr(31), p_perspective, coalesce(p_event_type, ''),
                              coalesce(wh_error_sqlstate(p_error), ''),
                              coalesce(wh_error_mask(p_error), ''))), 12);
$$;

-- Stored, so grouping and acting by group read an index instead of masking every row again
-- (the table is rewritten once, here).
ALTER TABLE wh_dead_letters
    ADD COLUMN error_fingerprint text
    GENERATED ALWAYS AS (wh_error_fingerprint(perspective_name, event_type, error_text)) STORED;

-- Open dead letters by group: `dlq groups` (count, first and last seen, sample) from the index
-- alone, and a group's members in position order for requeue/purge --group.
CREATE INDEX wh_dead_letters_open_fingerprint_idx
    ON wh_dead_letters (error_fingerprint, global_position)
    INCLUDE (perspective_name, dead_lettered_at)
    WHERE status = 'exhausted';

------------------------------------------------------------------------------------------------
-- Pause / resume
------------------------------------------------------------------------------------------------

ALTER TABLE wh_perspectives
    ADD COLUMN paused_at     timestamptz,
    ADD COLUMN paused_reason text,
    ADD COLUMN paused_by     text;

-- As in 0007, and a paused perspective is not claimed either.
CREATE OR REPLACE FUNCTION wh_claimable_perspectives(p_names text[])
RETURNS text[]
LANGUAGE sql AS $$
    SELECT array_agg(p.perspective_name ORDER BY random())
    FROM wh_perspectives p
    WHERE (p_names IS NULL OR p.perspective_name = ANY (p_names))
      AND p.paused_at IS NULL
      AND pg_try_advisory_xact_lock_shared(wh_perspective_lock_key(p.perspective_name));
$$;

-- Redefined from its 0006 text; only the perspectives filter changes: it is now
-- wh_claimable_perspectives, so paused ones are skipped.
-- claim_and_fetch_pending_perspective_events calls this one, so it skips them too.
CREATE OR REPLACE FUNCTION get_stream_events(
    p_instance_id uuid,
    p_stream_ids uuid[],
    p_lease_seconds int,
    p_perspective_names text[] DEFAULT NULL,
    p_max_rows int DEFAULT NULL)
RETURNS TABLE (
    event_work_id uuid, stream_id uuid, event_id uuid, perspective_name text,
    global_position bigint, stream_version int, event_type text, event_data jsonb,
    metadata jsonb, attempts int, failures int)
LANGUAGE plpgsql AS $$
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
    -- As in 0003: skip a perspective being rebuilt. 0008: and a paused one; the one place
    -- that says which perspectives may be claimed (0007).
    v_names := wh_claimable_perspectives(p_perspective_names);
    -- 0006: only a registered instance claims, and it holds its row (KEY SHARE) until the claim
    -- commits, so deregister_instance (which deletes that row first) waits for a claim under way
    -- and no claim can lease anything for an instance that has deregistered.
    PERFORM 1 FROM wh_service_instances si WHERE si.instance_id = p_instance_id FOR KEY SHARE;
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
        -- 0004: remember whether this claim bumped, so a give-back refunds exactly that.
        refundable   = pe.instance_id IS DISTINCT FROM p_instance_id
    WHERE pe.event_work_id = ANY (v_take)
      AND (pe.instance_id IS DISTINCT FROM p_instance_id OR pe.lease_expiry <= now());

    -- 5. Everything of the window now validly leased to the caller, with the raw event.
    RETURN QUERY
    SELECT pe.event_work_id, pe.stream_id, pe.event_id, pe.perspective_name,
           pe.global_position, pe.stream_version, ev.event_type, ev.event_data,
           ev.metadata, pe.attempts, pe.failures
    FROM wh_perspective_events pe
    LEFT JOIN wh_event_store ev ON ev.global_position = pe.global_position
                               AND ev.event_id = pe.event_id
    WHERE pe.event_work_id = ANY (v_take)
      AND pe.instance_id = p_instance_id
      AND pe.lease_expiry > now()
    ORDER BY pe.stream_id, pe.perspective_name, pe.stream_version;
END
$$;

------------------------------------------------------------------------------------------------
-- Replay dry run (`vantage dlq replay POSITION --dry-run`)
------------------------------------------------------------------------------------------------

-- The primary key columns of a table, in key order (NULL when it has none).
CREATE FUNCTION wh_primary_key(p_table regclass) RETURNS text[]
LANGUAGE sql STABLE AS $$
    SELECT array_agg(a.attname::text ORDER BY k.ord)
    FROM pg_index i
    CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
    WHERE i.indrelid = p_table AND i.indisprimary;
$$;

-- The row of p_table whose primary key is that of p_row (a row of that table as jsonb), as
-- jsonb, as this transaction sees it now; NULL when there is none (or the table has no primary
-- key). A dry run reads it before and after the handler's statement, both inside the
-- transaction it rolls back. Identifiers are quoted (%I, regclass), values bound.
CREATE FUNCTION wh_read_model_row(p_table regclass, p_row jsonb) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
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
