-- vantage schema, part 13: cheaper lane bookkeeping (issue 9): a completion proves its lanes
-- are not empty without walking what it just deleted, and a claim reads its rows' events in one
-- index scan.
--
-- Deleted rows, as in 0007, with a shortcut for the common case: a lane whose rows were
-- completed up to some version usually has rows after it, and finding one of those (an index
-- range that starts after the deleted prefix) proves the lane is not empty without walking the
-- prefix the deleting transaction itself just deleted (those index entries cannot be skipped
-- until it commits: about one buffer per deleted row, for every lane of every completion).
-- Only when no later row exists does the full emptiness check of 0007 run. Same locks, same
-- statements, same snapshots: the lane goes exactly when 0007 removed it.
CREATE OR REPLACE FUNCTION wh_perspective_lanes_after_delete() RETURNS trigger
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

-- The claim, as in 0007, but the leased rows' events are read in one index scan over their
-- positions instead of one index scan per row (500 rows: 1.9 -> 1.4 ms). Everything else
-- (locks, fairness, lease re-checks, hints, the rows returned) is 0007's. (Taking fewer, longer
-- lanes per claim was tried and measured no cheaper: ten lanes of fifty rows share heap pages
-- when producers interleave streams, one lane of five hundred rows does not.)
CREATE OR REPLACE FUNCTION wh_claim_lanes(
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
    -- (the events in one index scan by the positions, not one scan per row)
    LEFT JOIN (SELECT e.global_position, e.event_id, e.event_type, e.event_data, e.metadata
               FROM wh_event_store e
               WHERE e.global_position = ANY (v_all_gp)) e
      ON e.global_position = r.gp AND e.event_id = r.ev
    ORDER BY c.sid, c.pname, c.v;
END
$$;

