-- vantage 0022: folding wake-ups costs in proportion to the wake-ups, whatever the plan
-- (wh_fold_lane_wakeups and wh_reconcile_lanes, part 3, redefined; an index on wh_lane_wakeups).
--
-- Found by `vantage soak` (RELIABILITY.md): after a fault, a rebuild or on a saturated machine,
-- claims ran 5 to 18 s on the CPU, eight at once, waiting on no lock, and lag took minutes to come
-- back. auto_explain showed 0017's fold gathering "every wake-up of the lanes it took" as a nested
-- loop: a scan of all 29 875 waiting wake-ups, each compared with the 753 lanes taken, 22.5
-- million comparisons per claim. The planner chose it because the table's statistics said about
-- 100 rows: autovacuum analyses a queue table when it is nearly empty, its usual state. The more
-- the fold fell behind, the slower every claim became, so it stayed behind. Its final DELETE
-- joined two arrays the same way (the wake-ups taken, the lanes folded), and the reconciliation's
-- NOT IN over all wake-ups is evaluated row by row once they no longer fit in work_mem.
--
-- Now nothing joins one unbounded set against another without a key to look it up by:
-- * wh_lane_wakeups gets an index on the lane key. It is not unique, so an insert still never
--   waits (a producer's trigger adds one entry per lane its statement touched).
-- * The fold takes the lanes of its first p_max wake-ups (SKIP LOCKED, as before), locks the
--   existing lanes among them (SKIP LOCKED) and inserts the missing ones under their bucket's
--   advisory lock (0017), and only then takes the wake-ups of the lanes it now holds, one index
--   lookup per lane (SKIP LOCKED). Every wake-up it took is then folded, so it deletes them by
--   their row addresses: no second join to find which to keep.
-- * The reconciliation asks whether a lane has a wake-up by an index lookup per lane.
--
-- Contract: signatures, results and the invariants of part 3 are unchanged (a wake-up is deleted
-- only by the fold that read it, in the transaction that holds its lane's row; the fold and the
-- reconciliation never wait).

CREATE INDEX wh_lane_wakeups_lane_idx ON wh_lane_wakeups (stream_id, perspective_name);

CREATE OR REPLACE FUNCTION wh_fold_lane_wakeups(p_max int DEFAULT 1000) RETURNS int
LANGUAGE plpgsql AS $$
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
$$;

CREATE OR REPLACE FUNCTION wh_reconcile_lanes(p_after_perspective text, p_after_stream uuid, p_max int)
RETURNS TABLE (repaired_stream uuid, repaired_perspective text, next_perspective text,
               next_stream uuid)
LANGUAGE plpgsql AS $$
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
$$;
