-- vantage 0020: the lane index's safety net repairs only lanes that have lost their index
-- (wh_reconcile_lanes, part 3, redefined).
--
-- Found by `vantage soak`: ten "lane index repaired" WARN lines in six minutes of a healthy
-- fleet. The reconciliation walked the work table in one statement and looked for each lane's
-- row and wake-ups in the next, with a newer snapshot: a lane drained in between (its last work
-- row completed and its lane row deleted in one transaction) had no row and no wake-up, and was
-- "repaired", an empty lane given a row (harmless: the next claim deletes it) and counted in
-- vantage_lanes_repaired_total as if a restore or a migration had lost it. The check now also
-- reads the lane's work in its own snapshot: a lane is repaired only when that one snapshot
-- shows work, no lane row and no wake-up, which no transaction of the producers' or vantage's
-- ever leaves behind (part 3, L1–L3).
--
-- Contract: signature and results unchanged.

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
        -- with its last row, is not missing anything.)
        SELECT k.sid, k.pname, wh_lane_bucket_key(k.sid, k.pname) AS bucket
        FROM unnest(v_s, v_p) AS k(sid, pname)
        WHERE EXISTS (SELECT 1 FROM wh_perspective_events pe
                      WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid)
          AND NOT EXISTS (SELECT 1 FROM wh_perspective_lanes l
                          WHERE l.stream_id = k.sid AND l.perspective_name = k.pname)
          AND (k.sid, k.pname) NOT IN (SELECT w.stream_id, w.perspective_name
                                      FROM wh_lane_wakeups w)),
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
