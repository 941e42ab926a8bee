-- vantage 0017: the fold never waits, and folds a lane's whole backlog at once
-- (wh_fold_lane_wakeups and wh_reconcile_lanes, part 3, redefined; wh_lane_bucket_key, new).
--
-- Found by `vantage soak` (RELIABILITY.md, finding D): after the database had been unreachable
-- for a while at 500 events/s, 563 000 wake-ups of about 6 000 lanes waited to be folded and one
-- fold took 35 s, although each of its statements took at most 120 ms alone. Two faults of
-- 0011's fold made a convoy:
-- * It inserted a missing lane with ON CONFLICT DO NOTHING, which waits for any transaction
--   inserting the same lane: another claim, whose fold had taken other wake-ups of that lane,
--   holding its uncommitted insert until its claim commits. Claims queued behind claims, and
--   completions behind them (they lock the lanes those claims hold).
-- * It deleted only the wake-ups it had taken (at most p_max), so a lane with a hundred of them
--   was folded by a hundred claims, each inserting or locking it again.
--
-- Now:
-- * Lanes are inserted only under an advisory lock on the lane's bucket (one of 64, by a hash of
--   the lane key; wh_lane_bucket_key), held until the inserting transaction ends and taken with
--   pg_try_advisory_xact_lock, by the fold and by the reconciliation alike. A bucket another
--   transaction holds is skipped: its lanes keep their wake-ups for the next fold. Two inserters
--   of one lane need the same bucket, so an insert meets either no row or a committed one, and
--   never waits (L3). Buckets rather than one lock per lane bound the advisory locks a claim
--   holds (64, the default max_locks_per_transaction) however many lanes are new.
-- * After taking its first p_max wake-ups (SKIP LOCKED, as before), a fold also takes every
--   other wake-up of the same lanes that nobody else holds (at most 100 per lane on average),
--   decides each lane's hint from all of them (the lowest min_version), and deletes them all
--   when it folds the lane. A wake-up is still deleted only by the fold that read it, in the
--   transaction that holds its lane's row (L1, L2 unchanged).
-- A caller that claims inside a long transaction (the daemon never does) keeps the buckets its
-- fold inserted into until it ends: new lanes of those buckets wait for it, as the lanes it
-- inserted always had to.
--
-- * The lane's hint is decided without joining the wake-ups' keys a second time (see held
--   below): the soak's steady 1 000 events/s spent 4.4 s per fold there, most of the claim.
--
-- Contract: signatures, results and the invariants of part 3 are unchanged.

-- The advisory-lock key of a lane's insert bucket. Namespaced like wh_perspective_lock_key
-- (part 4), so two vantage schemas in one database, or the application's own advisory locks,
-- do not collide with it.
CREATE FUNCTION wh_lane_bucket_key(p_stream_id uuid, p_perspective_name text)
 RETURNS bigint
 LANGUAGE sql
 STABLE PARALLEL SAFE
AS $$
    SELECT hashtextextended('vantage:lane-bucket:' || current_schema() || ':'
                            || (hashtext(p_perspective_name || ':' || p_stream_id::text) & 63)::text,
                            0);
$$;

CREATE OR REPLACE FUNCTION wh_fold_lane_wakeups(p_max int DEFAULT 1000) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    v_tid   tid[];
    v_s     uuid[];
    v_p     text[];
    v_v     int[];
    v_done_s uuid[];
    v_done_p text[];
    v_gone  int;
BEGIN
    -- The lanes of the first p_max free wake-ups, then every free wake-up of those lanes (ours
    -- included: SKIP LOCKED does not skip our own locks).
    WITH first AS MATERIALIZED (
        SELECT DISTINCT f.stream_id, f.perspective_name
        FROM (SELECT w.stream_id, w.perspective_name
              FROM wh_lane_wakeups w
              LIMIT greatest(p_max, 0)
              FOR UPDATE SKIP LOCKED) f)
    SELECT array_agg(w.ctid), array_agg(w.stream_id), array_agg(w.perspective_name),
           array_agg(w.min_version)
    INTO v_tid, v_s, v_p, v_v
    FROM (SELECT w.ctid, w.stream_id, w.perspective_name, w.min_version
          FROM wh_lane_wakeups w
          WHERE (w.stream_id, w.perspective_name) IN (SELECT f.stream_id, f.perspective_name
                                                      FROM first f)
          LIMIT greatest(p_max, 0)::bigint * 100
          FOR UPDATE SKIP LOCKED) w;
    IF v_tid IS NULL THEN
        RETURN 0;
    END IF;

    WITH keys AS (
        -- (a wake-up without a version, from before 0011, counts as a new head)
        SELECT k.sid, k.pname,
               CASE WHEN bool_or(k.v IS NULL) THEN NULL ELSE min(k.v) END AS min_version
        FROM unnest(v_s, v_p, v_v) AS k(sid, pname, v)
        GROUP BY k.sid, k.pname),
    held AS MATERIALIZED (
        -- Existing lanes, locked without waiting, with what their wake-ups say. (The lowest
        -- version travels with the lane, so the UPDATE below joins nothing but the lane's key:
        -- 0011 joined the wake-ups' keys again, and the generic plan PL/pgSQL caches, sized for
        -- ten keys, probed the work table once per pair of keys, quadratic in the fold's size.)
        SELECT l.stream_id, l.perspective_name, k.min_version
        FROM wh_perspective_lanes l
        JOIN keys k ON k.sid = l.stream_id AND k.pname = l.perspective_name
        ORDER BY l.stream_id, l.perspective_name
        FOR UPDATE OF l SKIP LOCKED),
    lowered AS (
        -- Due now only if the new rows may be the head: rows appended behind an existing one
        -- change nothing about when the lane can next be claimed (its head's own writers keep
        -- that hint, L2).
        UPDATE wh_perspective_lanes l
        SET due_at = now()
        FROM held h
        WHERE l.stream_id = h.stream_id AND l.perspective_name = h.perspective_name
          AND l.due_at > now()
          AND (h.min_version IS NULL
               OR NOT EXISTS (SELECT 1 FROM wh_perspective_events pe
                              WHERE pe.perspective_name = h.perspective_name
                                AND pe.stream_id = h.stream_id
                                AND pe.stream_version < h.min_version))
        RETURNING l.stream_id, l.perspective_name),
    missing AS MATERIALIZED (
        -- Lanes with no row, as this statement sees it.
        SELECT k.sid, k.pname, wh_lane_bucket_key(k.sid, k.pname) AS bucket
        FROM keys k
        WHERE NOT EXISTS (SELECT 1 FROM wh_perspective_lanes l
                          WHERE l.stream_id = k.sid AND l.perspective_name = k.pname)),
    buckets AS MATERIALIZED (
        -- The buckets this transaction may insert into: nobody else is inserting there.
        SELECT b.bucket
        FROM (SELECT DISTINCT m.bucket FROM missing m) b
        WHERE pg_try_advisory_xact_lock(b.bucket)),
    added AS (
        -- (a conflict now means a committed row: someone folded it after our snapshot)
        INSERT INTO wh_perspective_lanes AS l (stream_id, perspective_name, due_at)
        SELECT m.sid, m.pname, now()
        FROM missing m
        JOIN buckets b ON b.bucket = m.bucket
        ORDER BY m.sid, m.pname
        ON CONFLICT (stream_id, perspective_name) DO NOTHING
        RETURNING l.stream_id, l.perspective_name)
    -- (every held lane is folded, lowered or not; a data-modifying WITH runs whether or not
    -- the query reads it)
    SELECT array_agg(d.stream_id), array_agg(d.perspective_name) INTO v_done_s, v_done_p
    FROM (SELECT h.stream_id, h.perspective_name FROM held h
          UNION ALL SELECT a.stream_id, a.perspective_name FROM added a) d;

    WITH gone AS (
        DELETE FROM wh_lane_wakeups w
        USING unnest(v_tid, v_s, v_p) AS t(tid, sid, pname)
        JOIN unnest(coalesce(v_done_s, '{}'), coalesce(v_done_p, '{}')) AS d(sid, pname)
          ON d.sid = t.sid AND d.pname = t.pname
        WHERE w.ctid = t.tid
        RETURNING 1)
    SELECT count(*)::int INTO v_gone FROM gone;
    RETURN v_gone;
END
$$;

-- The safety net of part 3, inserting under the same bucket locks as the fold (a lane whose
-- bucket another transaction holds is left for the next pass, which finds it again if it still
-- needs repair).
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
        SELECT k.sid, k.pname, wh_lane_bucket_key(k.sid, k.pname) AS bucket
        FROM unnest(v_s, v_p) AS k(sid, pname)
        WHERE NOT EXISTS (SELECT 1 FROM wh_perspective_lanes l
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
