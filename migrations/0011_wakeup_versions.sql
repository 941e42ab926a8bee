-- vantage 0011: a producer appending behind a parked or leased head costs vantage nothing.
--
-- Every wake-up used to make its lane due now, so each append to a lane whose head is parked
-- (a failing event waiting out its backoff) or leased sent a claim to lock the lane, read the
-- parked head and write the hint back: with 200 failing lanes and 1 500 appends a second that
-- was most of a core, taken from the producers on a small machine. A wake-up now carries the
-- lowest stream_version its statement inserted, and the fold makes an existing lane due now
-- only when no older row of the lane exists, i.e. when the new rows may be its head. Rows
-- behind an existing head change nothing about when the lane can next be claimed: the head's
-- own writers (completion, release, failure, the claims) keep that hint (L2 in part 3). New
-- lanes, and wake-ups written before this migration (no version), are due now as before.

ALTER TABLE wh_lane_wakeups ADD COLUMN min_version integer;

-- New work rows wake their lanes, with the lowest version each statement inserted per lane.
CREATE OR REPLACE FUNCTION wh_perspective_events_wake_lanes() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO wh_lane_wakeups (stream_id, perspective_name, min_version)
    SELECT n.stream_id, n.perspective_name, min(n.stream_version)
    FROM new_rows n
    GROUP BY n.stream_id, n.perspective_name;
    RETURN NULL;
END
$$;

-- The fold of part 3, lowering due_at only for lanes whose head the new rows may be.
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
    SELECT array_agg(w.ctid), array_agg(w.stream_id), array_agg(w.perspective_name),
           array_agg(w.min_version)
    INTO v_tid, v_s, v_p, v_v
    FROM (SELECT w.ctid, w.stream_id, w.perspective_name, w.min_version
          FROM wh_lane_wakeups w
          LIMIT greatest(p_max, 0)
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
    held AS (
        -- Existing lanes, locked without waiting.
        SELECT l.stream_id, l.perspective_name
        FROM wh_perspective_lanes l
        JOIN keys k ON k.sid = l.stream_id AND k.pname = l.perspective_name
        ORDER BY l.stream_id, l.perspective_name
        FOR UPDATE OF l SKIP LOCKED),
    lowered AS (
        -- Due now only if the new rows may be the head: rows appended behind an existing one
        -- change nothing about when the lane can next be claimed (its head's own writers keep
        -- that hint, L2), so a producer appending behind a parked or leased head does not send
        -- a claim to look at it again.
        UPDATE wh_perspective_lanes l
        SET due_at = now()
        FROM held h
        JOIN keys k ON k.sid = h.stream_id AND k.pname = h.perspective_name
        WHERE l.stream_id = h.stream_id AND l.perspective_name = h.perspective_name
          AND l.due_at > now()
          AND (k.min_version IS NULL
               OR NOT EXISTS (SELECT 1 FROM wh_perspective_events pe
                              WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid
                                AND pe.stream_version < k.min_version))
        RETURNING l.stream_id, l.perspective_name),
    added AS (
        -- Lanes with no row (as this statement sees it): a conflict means someone else has
        -- it, and the wake-up stays.
        INSERT INTO wh_perspective_lanes AS l (stream_id, perspective_name, due_at)
        SELECT k.sid, k.pname, now()
        FROM keys k
        WHERE NOT EXISTS (SELECT 1 FROM wh_perspective_lanes l
                          WHERE l.stream_id = k.sid AND l.perspective_name = k.pname)
        ORDER BY k.sid, k.pname
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
