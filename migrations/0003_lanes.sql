-- vantage baseline, part 3 of 9: the lane index, which producers cannot feel.
--
-- A claim finds due lanes through wh_perspective_lanes (perspective_name, due_at) instead of
-- visiting lanes one by one, so parked lanes and lanes validly leased elsewhere cost nothing:
-- they sit in the future part of the index. Claims lock lane rows FOR UPDATE SKIP LOCKED, so
-- two claimers never work on one lane and no claimer waits for a lane.
--
-- Who writes what:
-- * Anyone who inserts work rows (a producer's fan-out, a requeue, a rebuild, a plain INSERT)
--   adds, in the same transaction, one wh_lane_wakeups row per lane touched (the trigger
--   below). That is all: an insert into a table with no unique key, so it never waits for and
--   never conflicts with anyone. No producer ever writes wh_perspective_lanes.
-- * Claims fold committed wake-ups into the lane index (wh_fold_lane_wakeups, at the start of
--   every claim): insert the lane or lower its due_at to now, then delete the wake-up. A lane
--   locked by someone else at that moment keeps its wake-up for the next fold.
-- * vantage's own writers of work rows (completions, releases, failures, dead-letter moves,
--   deregistration, dead-instance cleanup) lower due_at through the triggers below; claims
--   raise it, only while holding the lane's lock, from what they read after taking it.
--
-- Invariants (tests/sql_contract.rs, tests/reliability.rs, and the safety net below):
--   L1 (nothing stranded) every committed work row's lane has a lane row or an unfolded
--      wake-up. A wake-up commits with its rows; the fold deletes it only in a transaction that
--      holds the lane's row (locked or inserted); a lane row is deleted only by a holder of its
--      lock that saw the lane empty in a statement started after taking the lock, which sees
--      every row whose wake-up had been folded before.
--   L2 (no stale hint) due_at is never later than the moment the lane's head becomes
--      claimable. Whoever makes a head claimable sooner takes the lane's lock before writing
--      the hint (waiting, briefly, for a claim holding it, whose hint it then corrects); a claim
--      computes its hint in a statement started after it took the lock, and locks the
--      instances it names as holders FOR KEY SHARE, so a cleanup that removes one waits for the
--      claim and then wakes its lanes.
--   L3 (bounded waits) the waits above are on vantage's own short transactions (a claim is
--      one statement), bounded by lock_timeout; claims never wait on lanes (SKIP LOCKED); nobody
--      waits on a producer.
-- A data-only restore with triggers disabled, or a future mistake, can still break L1; the
-- daemon's reconciliation (wh_reconcile_lanes) finds lanes with work but neither a lane row nor
-- a wake-up and repairs them, counting each (vantage_lanes_repaired_total).

-- New work rows wake their lanes. Statement-level: one wake-up per lane per statement.
CREATE FUNCTION wh_perspective_events_wake_lanes() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO wh_lane_wakeups (stream_id, perspective_name)
    SELECT DISTINCT n.stream_id, n.perspective_name
    FROM new_rows n;
    RETURN NULL;
END
$$;

CREATE TRIGGER wh_perspective_events_wake_lanes
    AFTER INSERT ON wh_perspective_events
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION wh_perspective_events_wake_lanes();

-- Folds up to p_max committed wake-ups into the lane index; returns how many it folded. Never
-- waits for a lock: wake-ups and existing lanes are taken SKIP LOCKED, and a lane someone else
-- holds keeps its wake-up (its holder's hint may predate the new rows; the next fold corrects
-- it). A new lane is inserted; the insert waits only for another fold inserting the same lane,
-- and folds insert in key order, so two folds cannot deadlock.
CREATE FUNCTION wh_fold_lane_wakeups(p_max int DEFAULT 1000) RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    v_tid   tid[];
    v_s     uuid[];
    v_p     text[];
    v_done_s uuid[];
    v_done_p text[];
    v_gone  int;
BEGIN
    SELECT array_agg(w.ctid), array_agg(w.stream_id), array_agg(w.perspective_name)
    INTO v_tid, v_s, v_p
    FROM (SELECT w.ctid, w.stream_id, w.perspective_name
          FROM wh_lane_wakeups w
          LIMIT greatest(p_max, 0)
          FOR UPDATE SKIP LOCKED) w;
    IF v_tid IS NULL THEN
        RETURN 0;
    END IF;

    WITH keys AS (
        SELECT DISTINCT k.sid, k.pname FROM unnest(v_s, v_p) AS k(sid, pname)),
    held AS (
        -- Existing lanes, locked without waiting; made due now.
        SELECT l.stream_id, l.perspective_name
        FROM wh_perspective_lanes l
        JOIN keys k ON k.sid = l.stream_id AND k.pname = l.perspective_name
        ORDER BY l.stream_id, l.perspective_name
        FOR UPDATE OF l SKIP LOCKED),
    lowered AS (
        UPDATE wh_perspective_lanes l
        SET due_at = least(l.due_at, now())
        FROM held h
        WHERE l.stream_id = h.stream_id AND l.perspective_name = h.perspective_name
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
    SELECT array_agg(d.stream_id), array_agg(d.perspective_name) INTO v_done_s, v_done_p
    FROM (SELECT * FROM lowered UNION ALL SELECT * FROM added) d;

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

-- Deleted rows (completed, dead-lettered, reset): the next row is the head, due now; an empty
-- lane goes. Takes the lanes' locks first (waiting for a claim that holds one; claims are one
-- statement and never wait for us), then decides in statements started after that, so it sees
-- every row whose writer committed while it waited (L1) and overrides any hint written before
-- (L2).
CREATE FUNCTION wh_perspective_lanes_after_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_streams uuid[];
    v_names   text[];
    v_last    int[];
BEGIN
    SELECT array_agg(l.stream_id), array_agg(l.perspective_name), array_agg(l.last_version)
    INTO v_streams, v_names, v_last
    FROM (
        SELECT l.stream_id, l.perspective_name, o.last_version
        FROM wh_perspective_lanes l
        JOIN (SELECT o.stream_id, o.perspective_name, max(o.stream_version) AS last_version
              FROM old_rows o
              GROUP BY o.stream_id, o.perspective_name) o
          ON o.stream_id = l.stream_id AND o.perspective_name = l.perspective_name
        ORDER BY l.stream_id, l.perspective_name
        FOR UPDATE OF l
    ) l;
    IF v_streams IS NULL THEN
        RETURN NULL;
    END IF;

    -- (a row behind the last one deleted means not empty, without reading the prefix again)
    DELETE FROM wh_perspective_lanes l
    USING unnest(v_streams, v_names, v_last) AS k(sid, pname, last_version)
    WHERE l.stream_id = k.sid AND l.perspective_name = k.pname
      AND CASE
            WHEN EXISTS (SELECT 1 FROM wh_perspective_events pe
                         WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid
                           AND pe.stream_version > k.last_version)
            THEN false
            ELSE NOT EXISTS (SELECT 1 FROM wh_perspective_events pe
                             WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid)
          END;

    UPDATE wh_perspective_lanes l
    SET due_at = now()
    FROM unnest(v_streams, v_names) AS k(sid, pname)
    WHERE l.stream_id = k.sid AND l.perspective_name = k.pname
      AND l.due_at > now();
    RETURN NULL;
END
$$;

CREATE TRIGGER wh_perspective_lanes_after_delete
    AFTER DELETE ON wh_perspective_events
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION wh_perspective_lanes_after_delete();

-- A lease cleared (released, failed and parked, taken back) or shortened, or a parked row made
-- due sooner: the head may be claimable sooner than the hint says. Row-level with a WHEN clause,
-- so leasing and renewing (the hot path) never run it. Only the head decides when its lane is
-- due: a row behind it changes nothing. The lane's lock is taken before the hint is compared
-- (L2): a claim holding it may be about to write a hint read before this change; waiting for
-- it and comparing afterwards corrects that hint instead of being overwritten by it.
CREATE FUNCTION wh_perspective_lanes_after_release() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_due timestamptz := CASE WHEN NEW.instance_id IS NULL THEN NEW.scheduled_for
                              ELSE NEW.lease_expiry END;
BEGIN
    IF EXISTS (SELECT 1 FROM wh_perspective_events e
               WHERE e.perspective_name = NEW.perspective_name AND e.stream_id = NEW.stream_id
                 AND e.stream_version < NEW.stream_version) THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM wh_perspective_lanes l
    WHERE l.stream_id = NEW.stream_id AND l.perspective_name = NEW.perspective_name
    FOR UPDATE;
    UPDATE wh_perspective_lanes l
    SET due_at = v_due
    WHERE l.stream_id = NEW.stream_id AND l.perspective_name = NEW.perspective_name
      AND l.due_at > v_due;
    RETURN NULL;
END
$$;

CREATE TRIGGER wh_perspective_lanes_after_release
    AFTER UPDATE ON wh_perspective_events
    FOR EACH ROW
    WHEN ((NEW.instance_id IS NULL AND (OLD.instance_id IS NOT NULL
                                        OR NEW.scheduled_for < OLD.scheduled_for))
          OR NEW.lease_expiry < OLD.lease_expiry)
    EXECUTE FUNCTION wh_perspective_lanes_after_release();

-- An instance gone (deregistered, or removed as dead): the lanes whose hint it set are due now.
-- A claim that names an instance as a lane's holder locks its row FOR KEY SHARE, so this
-- statement runs after such a claim committed and sees the holder it wrote (L2).
CREATE FUNCTION wh_perspective_lanes_after_instance_gone() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE wh_perspective_lanes l
    SET due_at = now()
    WHERE l.holder IN (SELECT g.instance_id FROM gone g)
      AND l.due_at > now();
    RETURN NULL;
END
$$;

CREATE TRIGGER wh_perspective_lanes_after_instance_gone
    AFTER DELETE ON wh_service_instances
    REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION wh_perspective_lanes_after_instance_gone();

-- The safety net: walks up to p_max distinct lanes of the work table after the key
-- (p_after_perspective, p_after_stream) (NULLs: from the start), one index probe per lane, and
-- gives every lane that has work but neither a lane row nor a wake-up a lane row, due now.
-- Returns the lanes it repaired and where the walk stopped (NULL: it reached the end).
CREATE FUNCTION wh_reconcile_lanes(p_after_perspective text, p_after_stream uuid, p_max int)
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
    WITH missing AS (
        SELECT k.sid, k.pname
        FROM unnest(v_s, v_p) AS k(sid, pname)
        WHERE NOT EXISTS (SELECT 1 FROM wh_perspective_lanes l
                          WHERE l.stream_id = k.sid AND l.perspective_name = k.pname)
          AND (k.sid, k.pname) NOT IN (SELECT w.stream_id, w.perspective_name
                                      FROM wh_lane_wakeups w)),
    added AS (
        INSERT INTO wh_perspective_lanes AS l (stream_id, perspective_name, due_at)
        SELECT m.sid, m.pname, now() FROM missing m
        ORDER BY m.sid, m.pname
        ON CONFLICT (stream_id, perspective_name) DO NOTHING
        RETURNING l.stream_id, l.perspective_name)
    SELECT a.stream_id, a.perspective_name, v_last_p, v_last_s FROM added a
    UNION ALL
    SELECT NULL::uuid, NULL::text, v_last_p, v_last_s;
END
$$;
