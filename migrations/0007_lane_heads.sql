-- vantage schema, part 7: claims find due lanes through an index of lanes, not by visiting them.
--
-- Until now a claim walked the lane index of wh_perspective_events one lane at a time (several
-- statements per lane, under a visit budget shared by every perspective). A perspective with
-- thousands of parked or foreign-held lanes ate the budget and starved the others, and behind an
-- old snapshot the walk read every dead index entry of the backlog.
--
-- wh_perspective_lanes holds one row per lane (perspective, stream) that has work, with a hint:
-- due_at, a time before which no claim of the lane's head can succeed. Claims take lanes with
-- due_at <= now() from the index (perspective_name, due_at), lock them FOR UPDATE SKIP LOCKED
-- (so two claimers never work on one lane) and only then read the lane's rows. Parked and
-- validly leased lanes sit in the future part of the index and are never visited.
--
-- The two invariants, kept by triggers so that every writer (the daemon, operators, a producer's
-- plain INSERT, a rebuild) keeps them without knowing about this table:
--   I1  every lane with a work row has a lane row;
--   I2  due_at is never later than the moment the head becomes claimable (it may be earlier: a
--       claim that finds the head not claimable corrects the hint, which costs one visit).
-- due_at is raised only by a claim holding the lane's lock, from what it read on the head:
-- its own lease's expiry, a parked head's scheduled_for, another holder's lease expiry. It is
-- lowered by the triggers: new rows (a new or requeued head), deleted rows (the next row is the
-- head), a cleared or shortened lease, and a holder that is gone.
--
-- Lane rows are deleted only by a session holding their lock that has seen, in a statement
-- started after taking the lock, that the lane is empty. A writer inserting into the lane
-- upserts the lane row (a row lock), so it either waits for that deletion and re-inserts the
-- lane, or makes the deleter wait and see its row. Claimers never wait for a lock (SKIP LOCKED
-- on lanes and rows), so the writers that do wait (appends, completions, releases) cannot
-- deadlock with them.

CREATE TABLE wh_perspective_lanes (
    stream_id        uuid        NOT NULL,
    perspective_name text        NOT NULL,
    -- No claim of this lane's head can succeed before due_at (a hint, see I2).
    due_at           timestamptz NOT NULL DEFAULT now(),
    -- The instance whose lease due_at was last set from (woken when it is gone).
    holder           uuid,
    PRIMARY KEY (stream_id, perspective_name)
) WITH (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 500,
    autovacuum_analyze_scale_factor = 0.02
);

CREATE INDEX wh_perspective_lanes_due_idx ON wh_perspective_lanes (perspective_name, due_at);

-- The lanes of the rows already queued, due now.
INSERT INTO wh_perspective_lanes (stream_id, perspective_name, due_at)
SELECT DISTINCT pe.stream_id, pe.perspective_name, now()
FROM wh_perspective_events pe;

-- New rows: the lane exists and is due (a new row may be a new head: a requeued event, a first
-- event). The upsert locks the lane row, which is what makes a concurrent deletion safe (I1).
CREATE FUNCTION wh_perspective_lanes_after_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO wh_perspective_lanes AS l (stream_id, perspective_name, due_at)
    SELECT DISTINCT n.stream_id, n.perspective_name, now()
    FROM new_rows n
    ORDER BY 1, 2
    ON CONFLICT (stream_id, perspective_name)
        DO UPDATE SET due_at = least(l.due_at, excluded.due_at);
    RETURN NULL;
END
$$;

CREATE TRIGGER wh_perspective_lanes_after_insert
    AFTER INSERT ON wh_perspective_events
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION wh_perspective_lanes_after_insert();

-- Deleted rows (completed, dead-lettered, reset): the next row is the head, due now; an empty
-- lane goes. Waits for the lanes' locks (a claim holds one only briefly and never waits for us);
-- the emptiness check is a statement of its own, started after the locks are held, so it sees
-- every row whose writer committed while we waited (I1).
CREATE FUNCTION wh_perspective_lanes_after_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_streams uuid[];
    v_names   text[];
BEGIN
    SELECT array_agg(l.stream_id), array_agg(l.perspective_name) INTO v_streams, v_names
    FROM (
        SELECT l.stream_id, l.perspective_name
        FROM wh_perspective_lanes l
        JOIN (SELECT DISTINCT o.stream_id, o.perspective_name FROM old_rows o) o
          ON o.stream_id = l.stream_id AND o.perspective_name = l.perspective_name
        ORDER BY l.stream_id, l.perspective_name
        FOR UPDATE OF l
    ) l;
    IF v_streams IS NULL THEN
        RETURN NULL;
    END IF;

    DELETE FROM wh_perspective_lanes l
    USING unnest(v_streams, v_names) AS k(sid, pname)
    WHERE l.stream_id = k.sid AND l.perspective_name = k.pname
      AND NOT EXISTS (SELECT 1 FROM wh_perspective_events pe
                      WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid);

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
-- due: a row behind it (given back with the batch of a failed head) changes nothing, so a
-- parked lane is not made due by the rows waiting behind its head. The hint is only ever
-- lowered here (a concurrent writer may have lowered it further).
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
    WHEN ((NEW.instance_id IS NULL
           AND (OLD.instance_id IS NOT NULL OR NEW.scheduled_for < OLD.scheduled_for))
          OR NEW.lease_expiry < OLD.lease_expiry)
    EXECUTE FUNCTION wh_perspective_lanes_after_release();

-- An instance gone (deregistered, or removed as dead): its lanes are taken over now, without
-- waiting for their leases to expire (SPEC §1.5).
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

-- The perspectives a claim may take lanes of (of p_names, NULL = all), in random order: the
-- registered ones not being rebuilt (as in 0003; the shared lock is held until the claim commits).
-- One place for every reason a perspective is not claimed.
CREATE FUNCTION wh_claimable_perspectives(p_names text[])
RETURNS text[]
LANGUAGE sql AS $$
    SELECT array_agg(p.perspective_name ORDER BY random())
    FROM wh_perspectives p
    WHERE (p_names IS NULL OR p.perspective_name = ANY (p_names))
      AND pg_try_advisory_xact_lock_shared(wh_perspective_lock_key(p.perspective_name));
$$;

-- The claim itself. Takes up to p_max_lanes due lanes (a fair share per perspective, in random
-- order) and leases the claimable prefix of each, up to p_max_rows rows in all and p_per_lane per
-- lane (NULL: as deep as the budget allows). Lanes are locked in rounds sized from how many rows
-- the lanes of the previous round gave, so a backlog of long lanes is taken a few lanes at a
-- time (few lane rows rewritten per event) and a backlog of one-event lanes many at a time.
-- Attempts are bumped on takeover only (SPEC §1.1); rows validly leased to anyone, the caller
-- included (another of its consumer loops), are never taken. Returns the rows it leased, with
-- their raw events, ordered by stream, perspective, stream_version.
CREATE FUNCTION wh_claim_lanes(
    p_instance_id uuid,
    p_lease_seconds int,
    p_max_lanes int,
    p_max_rows int,
    p_perspective_names text[],
    p_per_lane int)
RETURNS TABLE (
    event_work_id uuid, stream_id uuid, event_id uuid, perspective_name text,
    global_position bigint, stream_version int, event_type text, event_data jsonb,
    metadata jsonb, attempts int, failures int)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_names      text[];
    v_name       text;
    v_names_left int;
    v_lanes_left int := greatest(coalesce(p_max_lanes, 1), 0);
    v_rows_left  int := greatest(coalesce(p_max_rows, p_max_lanes, 1), 0);
    v_estimate   numeric := coalesce(p_per_lane, 50);
    v_want       int;
    v_quota      int;
    v_round_s    uuid[];
    v_round_p    text[];
    v_got_s      uuid[];
    v_got_p      text[];
    v_c_id       uuid[];
    v_c_s        uuid[];
    v_c_p        text[];
    v_c_v        int[];
    v_c_tid      tid[];
    v_u_id       uuid[];
    v_u_event    uuid[];
    v_u_gp       bigint[];
    v_u_attempts int[];
    v_u_failures int[];
    v_gap        uuid[];
    v_lock_timeout text;
    v_take       uuid[];
    v_taken      int;
    v_all        uuid[] := '{}';
    v_all_event  uuid[] := '{}';
    v_all_gp     bigint[] := '{}';
    v_all_attempts int[] := '{}';
    v_all_failures int[] := '{}';
    v_all_c_id   uuid[] := '{}';
    v_all_c_s    uuid[] := '{}';
    v_all_c_p    text[] := '{}';
    v_all_c_v    int[] := '{}';
    v_rounds     int := 0;
    v_pass       int;
BEGIN
    v_names := wh_claimable_perspectives(p_perspective_names);
    -- As in 0006: only a registered instance claims, holding its row until the claim commits.
    PERFORM 1 FROM wh_service_instances si WHERE si.instance_id = p_instance_id FOR KEY SHARE;
    IF NOT FOUND OR v_names IS NULL THEN
        RETURN;
    END IF;

    WHILE v_lanes_left > 0 AND v_rows_left > 0 AND v_rounds < 4 LOOP
        v_rounds := v_rounds + 1;
        v_want := least(v_lanes_left, greatest(1, ceil(v_rows_left / greatest(v_estimate, 1))))::int;

        -- 1. Lock due lanes: a fair share per perspective (what one leaves goes to the next),
        --    then, if some had fewer due lanes than their share, the rest from any of them.
        v_round_s := '{}';
        v_round_p := '{}';
        FOR v_pass IN 1..2 LOOP
            EXIT WHEN cardinality(v_round_s) >= v_want;
            v_names_left := cardinality(v_names);
            FOREACH v_name IN ARRAY v_names LOOP
                v_quota := CASE WHEN v_pass = 1
                    THEN ceil((v_want - cardinality(v_round_s))::numeric / v_names_left)::int
                    ELSE v_want - cardinality(v_round_s) END;
                v_names_left := v_names_left - 1;
                CONTINUE WHEN v_quota <= 0;
                SELECT array_agg(d.stream_id), array_agg(d.perspective_name)
                INTO v_got_s, v_got_p
                FROM (
                    SELECT l.stream_id, l.perspective_name
                    FROM wh_perspective_lanes l
                    WHERE l.perspective_name = v_name AND l.due_at <= now()
                      -- (our own locks are not skipped: leave out what we already hold)
                      AND NOT (l.stream_id = ANY (v_round_s) AND l.perspective_name = ANY (v_round_p))
                    ORDER BY l.due_at
                    LIMIT v_quota
                    FOR UPDATE SKIP LOCKED
                ) d;
                IF v_got_s IS NOT NULL THEN
                    v_round_s := v_round_s || v_got_s;
                    v_round_p := v_round_p || v_got_p;
                END IF;
            END LOOP;
        END LOOP;
        EXIT WHEN cardinality(v_round_s) = 0;
        v_lanes_left := v_lanes_left - cardinality(v_round_s);

        -- 2. Candidates: per lane, the leading rows that are claimable (bool_and over the lane
        --    keeps only the prefix before the first blocked row), an even share of the budget
        --    per lane (what short lanes leave is taken in the next round), ranked round-robin.
        SELECT array_agg(c.event_work_id), array_agg(c.sid), array_agg(c.pname),
               array_agg(c.stream_version), array_agg(c.row_tid)
        INTO v_c_id, v_c_s, v_c_p, v_c_v, v_c_tid
        FROM (
            SELECT r.event_work_id, r.sid, r.pname, r.stream_version, r.row_tid
            FROM (
                SELECT w.event_work_id, k.sid, k.pname, w.stream_version, w.row_tid,
                       row_number() OVER lane AS rn,
                       bool_and(w.ok) OVER lane AS prefix_ok
                FROM unnest(v_round_s, v_round_p) AS k(sid, pname)
                CROSS JOIN LATERAL (
                    SELECT pe.event_work_id, pe.stream_version, pe.ctid AS row_tid,
                           CASE
                               WHEN pe.instance_id IS NULL THEN pe.scheduled_for <= now()
                               WHEN pe.lease_expiry < now() THEN true
                               ELSE NOT EXISTS (SELECT 1 FROM wh_service_instances si
                                                WHERE si.instance_id = pe.instance_id)
                           END AS ok
                    FROM wh_perspective_events pe
                    WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid
                    ORDER BY pe.stream_version
                    LIMIT coalesce(p_per_lane,
                                   ceil(v_rows_left::numeric / cardinality(v_round_s))::int)) w
                WINDOW lane AS (PARTITION BY k.sid, k.pname ORDER BY w.stream_version)
            ) r
            WHERE r.prefix_ok
            ORDER BY r.rn, r.sid, r.pname
            LIMIT v_rows_left
        ) c;

        v_u_id := NULL;
        IF v_c_id IS NOT NULL THEN
            -- 3. Lease them, re-checked on the live rows (an old holder may have renewed,
            --    completed or released one since our snapshot); attempts + 1 on takeover only.
            --    Claimers never touch a lane without its lock, so the only rows that can be
            --    locked here are an old holder's, briefly: wait for them a moment, and if that
            --    is not enough (the holder may be waiting for the lane lock we hold), lock what
            --    can be locked without waiting instead.
            v_lock_timeout := current_setting('lock_timeout');
            PERFORM set_config('lock_timeout', '50ms', true);
            BEGIN
                WITH leased AS (
                    UPDATE wh_perspective_events pe
                    SET instance_id  = p_instance_id,
                        lease_expiry = clock_timestamp() + make_interval(secs => p_lease_seconds),
                        attempts     = pe.attempts + CASE WHEN pe.instance_id IS DISTINCT FROM p_instance_id
                                                          THEN 1 ELSE 0 END,
                        refundable   = pe.instance_id IS DISTINCT FROM p_instance_id
                    -- (by the versions we read: a row changed since is not found, see step 4)
                    WHERE pe.ctid = ANY (v_c_tid)
                      AND CASE
                            WHEN pe.instance_id IS NULL THEN pe.scheduled_for <= now()
                            WHEN pe.lease_expiry < now() THEN true
                            ELSE NOT EXISTS (SELECT 1 FROM wh_service_instances si
                                             WHERE si.instance_id = pe.instance_id)
                          END
                    RETURNING pe.event_work_id, pe.event_id, pe.global_position, pe.attempts,
                              pe.failures)
                SELECT array_agg(l.event_work_id), array_agg(l.event_id),
                       array_agg(l.global_position), array_agg(l.attempts), array_agg(l.failures)
                INTO v_u_id, v_u_event, v_u_gp, v_u_attempts, v_u_failures
                FROM leased l;
            EXCEPTION WHEN lock_not_available THEN
                WITH locked AS (
                    SELECT pe.event_work_id
                    FROM wh_perspective_events pe
                    -- (by the versions we read: a row changed since is not found, see step 4)
                    WHERE pe.ctid = ANY (v_c_tid)
                      AND CASE
                            WHEN pe.instance_id IS NULL THEN pe.scheduled_for <= now()
                            WHEN pe.lease_expiry < now() THEN true
                            ELSE NOT EXISTS (SELECT 1 FROM wh_service_instances si
                                             WHERE si.instance_id = pe.instance_id)
                          END
                    ORDER BY pe.event_work_id
                    FOR UPDATE OF pe SKIP LOCKED),
                leased AS (
                    UPDATE wh_perspective_events pe
                    SET instance_id  = p_instance_id,
                        lease_expiry = clock_timestamp() + make_interval(secs => p_lease_seconds),
                        attempts     = pe.attempts + CASE WHEN pe.instance_id IS DISTINCT FROM p_instance_id
                                                          THEN 1 ELSE 0 END,
                        refundable   = pe.instance_id IS DISTINCT FROM p_instance_id
                    FROM locked
                    WHERE pe.event_work_id = locked.event_work_id
                    RETURNING pe.event_work_id, pe.event_id, pe.global_position, pe.attempts,
                              pe.failures)
                SELECT array_agg(l.event_work_id), array_agg(l.event_id),
                       array_agg(l.global_position), array_agg(l.attempts), array_agg(l.failures)
                INTO v_u_id, v_u_event, v_u_gp, v_u_attempts, v_u_failures
                FROM leased l;
            END;
            PERFORM set_config('lock_timeout', v_lock_timeout, true);

            -- 4. Leases stay a prefix of the lane, so nobody can ever hold a row ahead of ours:
            --    a candidate the re-check or a lock left out ends its lane's share, and what we
            --    leased behind it goes back at once, its bump refunded (rare: a race with the
            --    lane's old holder).
            IF coalesce(cardinality(v_u_id), 0) < cardinality(v_c_id) THEN
                SELECT array_agg(g.id) INTO v_gap
                FROM (
                    SELECT c.id, u.id IS NOT NULL AS leased,
                           bool_and(u.id IS NOT NULL) OVER (
                               PARTITION BY c.sid, c.pname ORDER BY c.v) AS contiguous
                    FROM unnest(v_c_id, v_c_s, v_c_p, v_c_v) AS c(id, sid, pname, v)
                    LEFT JOIN unnest(v_u_id) AS u(id) ON u.id = c.id
                ) g
                WHERE g.leased AND NOT g.contiguous;
                IF v_gap IS NOT NULL THEN
                    UPDATE wh_perspective_events pe
                    SET instance_id  = NULL,
                        lease_expiry = NULL,
                        attempts     = greatest(pe.attempts - CASE WHEN pe.refundable THEN 1 ELSE 0 END, 0),
                        refundable   = false
                    WHERE pe.event_work_id = ANY (v_gap);
                    SELECT array_agg(u.id), array_agg(u.ev), array_agg(u.gp), array_agg(u.att),
                           array_agg(u.fail)
                    INTO v_u_id, v_u_event, v_u_gp, v_u_attempts, v_u_failures
                    FROM unnest(v_u_id, v_u_event, v_u_gp, v_u_attempts, v_u_failures)
                         AS u(id, ev, gp, att, fail)
                    WHERE NOT u.id = ANY (v_gap);
                END IF;
            END IF;
        END IF;
        v_take := v_u_id;
        v_taken := coalesce(cardinality(v_take), 0);
        IF v_c_id IS NOT NULL THEN
            v_all_c_id := v_all_c_id || v_c_id;
            v_all_c_s := v_all_c_s || v_c_s;
            v_all_c_p := v_all_c_p || v_c_p;
            v_all_c_v := v_all_c_v || v_c_v;
        END IF;
        IF v_taken > 0 THEN
            v_all := v_all || v_u_id;
            v_all_event := v_all_event || v_u_event;
            v_all_gp := v_all_gp || v_u_gp;
            v_all_attempts := v_all_attempts || v_u_attempts;
            v_all_failures := v_all_failures || v_u_failures;
        END IF;

        -- 5. The lanes' hints. A lane we leased from is due when our lease expires; any other
        --    lane of the round is due when its head is (a parked head's scheduled_for, another
        --    holder's expiry; a head locked by someone else, in a second), and an empty lane
        --    goes (this statement started after we took its lock: see I1).
        WITH leased AS (
            SELECT DISTINCT c.sid, c.pname
            FROM unnest(v_c_id, v_c_s, v_c_p) AS c(id, sid, pname)
            JOIN unnest(v_take) AS t(id) ON t.id = c.id),
        round AS (
            SELECT k.sid, k.pname, (t.sid IS NOT NULL) AS leased
            FROM unnest(v_round_s, v_round_p) AS k(sid, pname)
            LEFT JOIN leased t ON t.sid = k.sid AND t.pname = k.pname),
        heads AS (
            SELECT r.sid, r.pname, r.leased, h.event_work_id AS head, h.instance_id,
                   h.lease_expiry, h.scheduled_for
            FROM round r
            LEFT JOIN LATERAL (
                SELECT pe.event_work_id, pe.instance_id, pe.lease_expiry, pe.scheduled_for
                FROM wh_perspective_events pe
                WHERE pe.perspective_name = r.pname AND pe.stream_id = r.sid
                ORDER BY pe.stream_version
                LIMIT 1) h ON NOT r.leased),
        gone AS (
            DELETE FROM wh_perspective_lanes l
            USING heads h
            WHERE l.stream_id = h.sid AND l.perspective_name = h.pname
              AND NOT h.leased AND h.head IS NULL
            RETURNING 1)
        UPDATE wh_perspective_lanes l
        SET due_at = CASE
                WHEN h.leased THEN clock_timestamp() + make_interval(secs => p_lease_seconds)
                WHEN h.instance_id IS NULL AND h.scheduled_for > now() THEN h.scheduled_for
                WHEN h.instance_id IS NOT NULL AND h.lease_expiry >= now()
                     AND EXISTS (SELECT 1 FROM wh_service_instances si
                                 WHERE si.instance_id = h.instance_id) THEN h.lease_expiry
                ELSE now() + interval '1 second'
            END,
            holder = CASE WHEN h.leased THEN p_instance_id ELSE h.instance_id END
        FROM heads h
        WHERE l.stream_id = h.sid AND l.perspective_name = h.pname
          AND (h.leased OR h.head IS NOT NULL);

        v_rows_left := v_rows_left - v_taken;
        -- Size the next round from what this one's lanes gave.
        v_estimate := greatest(v_taken::numeric / cardinality(v_round_s), 1);
        EXIT WHEN cardinality(v_round_s) < v_want;   -- no more due lanes
    END LOOP;

    IF cardinality(v_all) = 0 THEN
        RETURN;
    END IF;

    -- 6. The rows leased, with their raw events (what the lease returned plus the candidates'
    --    lanes; no second read of the work rows).
    RETURN QUERY
    SELECT r.id, c.sid, r.ev, c.pname, r.gp, c.v, e.event_type, e.event_data, e.metadata,
           r.att, r.fail
    FROM unnest(v_all, v_all_event, v_all_gp, v_all_attempts, v_all_failures)
         AS r(id, ev, gp, att, fail)
    JOIN unnest(v_all_c_id, v_all_c_s, v_all_c_p, v_all_c_v) AS c(id, sid, pname, v)
      ON c.id = r.id
    LEFT JOIN wh_event_store e ON e.global_position = r.gp AND e.event_id = r.ev
    ORDER BY c.sid, c.pname, c.v;
END
$$;

-- The daemon's claim: lanes and their rows in one call (one round trip per batch).
-- p_max_lanes bounds the lanes (worker.max_streams_per_claim), p_max_rows the rows
-- (worker.batch_size).
CREATE FUNCTION claim_perspective_work(
    p_instance_id uuid,
    p_lease_seconds int,
    p_max_lanes int,
    p_max_rows int,
    p_perspective_names text[] DEFAULT NULL)
RETURNS TABLE (
    event_work_id uuid, stream_id uuid, event_id uuid, perspective_name text,
    global_position bigint, stream_version int, event_type text, event_data jsonb,
    metadata jsonb, attempts int, failures int)
LANGUAGE sql AS $$
    SELECT * FROM wh_claim_lanes(p_instance_id, p_lease_seconds, p_max_lanes, p_max_rows,
                                 p_perspective_names, NULL);
$$;

-- The contract's lane-head claim, now through the lane index too: heads only (one row per lane),
-- at most p_max_streams lanes and p_max_rows heads.
CREATE OR REPLACE FUNCTION claim_orphaned_perspective_events(
    p_instance_id uuid,
    p_lease_seconds int,
    p_max_streams int,
    p_max_rows int,
    p_perspective_names text[] DEFAULT NULL)
RETURNS TABLE (event_work_id uuid, stream_id uuid, perspective_name text)
LANGUAGE sql AS $$
    SELECT c.event_work_id, c.stream_id, c.perspective_name
    FROM wh_claim_lanes(p_instance_id, p_lease_seconds,
                        least(greatest(p_max_streams, 0), greatest(coalesce(p_max_rows, p_max_streams), 0)),
                        greatest(coalesce(p_max_rows, p_max_streams), 0),
                        p_perspective_names, 1) c;
$$;
