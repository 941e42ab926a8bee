-- vantage 0025: a lane whose head failed before is claimed head only (get_stream_events,
-- part 4, redefined).
--
-- Found by `vantage soak` (RELIABILITY.md, fourteenth run): after `vantage dlq requeue --all`
-- put 7 712 dead letters back on 400 poison streams (about 19 a lane, half of them still
-- poison), their retries ran for three and a half minutes and held the other perspectives' lag
-- at 2.5-4 s, although a failed claim of a one-row lane costs about what a healthy apply does
-- (`vantage bench --checks retries`: 1.36). The lanes were not one row: a claim leased a
-- lane's whole claimable prefix (the requeued rows and every event appended behind them since),
-- the head failed again, and the careful pass gave every row behind it back, refunded: dozens
-- of rows leased and released, each with its lane trigger, for each of the ~40 000 failures.
--
-- Now a lane whose head has failed before (failures > 0) gives the claim its head alone. When
-- the head applies, the lane is due again at once (its delete trigger) and the next claim takes
-- the rest; when it fails, nothing was leased behind it.
--
-- Contract: signature, result and the invariants of parts 3 and 4 are unchanged (a claim still
-- leases a prefix of each lane, in stream order); only how many rows of a retrying lane.

CREATE OR REPLACE FUNCTION get_stream_events(p_instance_id uuid, p_stream_ids uuid[], p_lease_seconds integer, p_perspective_names text[] DEFAULT NULL::text[], p_max_rows integer DEFAULT NULL::integer, p_max_lanes integer DEFAULT NULL::integer, p_per_lane integer DEFAULT NULL::integer)
 RETURNS TABLE(event_work_id uuid, stream_id uuid, event_id uuid, perspective_name text, global_position bigint, stream_version integer, event_type text, event_data jsonb, metadata jsonb, attempts integer, failures integer, queued_at timestamp with time zone, replay boolean)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
#variable_conflict use_column
DECLARE
    v_names      text[];
    v_name       text;
    v_names_left int;
    v_lanes_left int := greatest(coalesce(p_max_lanes, p_max_rows, 100), 0);
    v_rows_left  int := greatest(coalesce(p_max_rows, p_max_lanes, 100), 0);
    v_rows       int;
    -- Per perspective, by its place in v_names: rows leased so far, rows per lane seen,
    -- whether it has no more due lanes for us, its rows and lanes for this round.
    v_n          int;
    v_i          int;
    v_p_got      int[];
    v_p_est      numeric[];
    v_p_dry      boolean[];
    v_p_left     int[];
    v_p_want     int[];
    v_p_lanes    int[];
    v_p_cap      int[];
    v_active     int;
    v_spare      int;
    v_lanes_free int;
    v_holders    uuid[];
    v_alive      uuid[];
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
    v_u_s        uuid[];
    v_u_p        text[];
    v_u_v        int[];
    v_u_q        timestamptz[];
    v_u_r        boolean[];
    v_l_s        uuid[];
    v_l_p        text[];
    v_gap        uuid[];
    v_lock_timeout text;
    v_take       uuid[];
    v_taken      int;
    v_all        uuid[] := '{}';
    v_all_event  uuid[] := '{}';
    v_all_gp     bigint[] := '{}';
    v_all_attempts int[] := '{}';
    v_all_failures int[] := '{}';
    v_all_s      uuid[] := '{}';
    v_all_p      text[] := '{}';
    v_all_v      int[] := '{}';
    v_all_q      timestamptz[] := '{}';
    v_all_r      boolean[] := '{}';
    v_rounds     int := 0;
    v_pass       int;
BEGIN
    -- Named streams: the contract's form for one caller's own streams (operators, tests).
    IF p_stream_ids IS NOT NULL THEN
        RETURN QUERY SELECT * FROM wh_get_named_stream_events(
            p_instance_id, p_stream_ids, p_lease_seconds, p_perspective_names, p_max_rows);
        RETURN;
    END IF;

    v_names := wh_claimable_perspectives(p_perspective_names);
    -- Only a registered instance claims, and it holds its row (KEY SHARE) until the claim
    -- commits, so deregister_instance (which deletes that row first) waits for a claim under way
    -- and no claim can lease anything for an instance that has deregistered. A row being
    -- deleted right now (a deregistration, or a cleanup that found this instance silent) is
    -- skipped, not waited for: such an instance claims nothing until it is registered again.
    PERFORM 1 FROM wh_service_instances si WHERE si.instance_id = p_instance_id
    FOR KEY SHARE SKIP LOCKED;
    IF NOT FOUND OR v_names IS NULL THEN
        RETURN;
    END IF;

    -- 0. New lanes and re-woken ones: what producers, requeues and rebuilds added (part 3).
    PERFORM wh_fold_lane_wakeups(greatest(1000, v_lanes_left));

    v_rows := v_rows_left;
    v_n := cardinality(v_names);
    v_p_got := array_fill(0, ARRAY[v_n]);
    v_p_est := array_fill(coalesce(p_per_lane, 50)::numeric, ARRAY[v_n]);
    v_p_dry := array_fill(false, ARRAY[v_n]);

    WHILE v_lanes_left > 0 AND v_rows_left > 0 AND v_rounds < 4 LOOP
        v_rounds := v_rounds + 1;

        -- 1. Each perspective's share of the claim's rows: the rows are split evenly between
        --    the perspectives that still have due lanes (one that ran out keeps what it got and
        --    leaves the rest to the others), so a perspective whose lanes are deep (a rebuild, a
        --    backlog) takes at most its share while others have work. Each asks for as many lanes
        --    as its share needs at the rows per lane its lanes gave so far; the lanes are dealt
        --    out evenly between those that ask, and what one does not need goes to the others.
        v_active := 0;
        v_spare := v_rows;
        FOR v_i IN 1..v_n LOOP
            IF v_p_dry[v_i] THEN
                v_spare := v_spare - v_p_got[v_i];
            ELSE
                v_active := v_active + 1;
            END IF;
        END LOOP;
        EXIT WHEN v_active = 0;
        v_p_left := array_fill(0, ARRAY[v_n]);
        v_p_want := array_fill(0, ARRAY[v_n]);
        v_p_lanes := array_fill(0, ARRAY[v_n]);
        FOR v_i IN 1..v_n LOOP
            CONTINUE WHEN v_p_dry[v_i];
            -- (an even split of v_spare, the remainder to the first ones: the shares add up to
            --  the rows left)
            v_p_left[v_i] := greatest(v_spare / v_active
                                      + CASE WHEN v_spare % v_active > 0 THEN 1 ELSE 0 END
                                      - v_p_got[v_i], 0);
            v_spare := v_spare - v_spare / v_active
                       - CASE WHEN v_spare % v_active > 0 THEN 1 ELSE 0 END;
            v_active := v_active - 1;
            v_p_left[v_i] := least(v_p_left[v_i], v_rows_left);
            v_p_want[v_i] := ceil(v_p_left[v_i] / greatest(v_p_est[v_i], 1))::int;
        END LOOP;

        v_round_s := '{}';
        v_round_p := '{}';
        v_lanes_free := v_lanes_left;
        FOR v_pass IN 1..3 LOOP
            v_names_left := 0;
            FOR v_i IN 1..v_n LOOP
                IF NOT v_p_dry[v_i] AND v_p_lanes[v_i] < v_p_want[v_i] THEN
                    v_names_left := v_names_left + 1;
                END IF;
            END LOOP;
            EXIT WHEN v_names_left = 0 OR v_lanes_free <= 0;
            FOR v_i IN 1..v_n LOOP
                CONTINUE WHEN v_p_dry[v_i] OR v_p_lanes[v_i] >= v_p_want[v_i];
                v_quota := least(v_p_want[v_i] - v_p_lanes[v_i],
                                 ceil(v_lanes_free::numeric / v_names_left)::int);
                v_names_left := v_names_left - 1;
                CONTINUE WHEN v_quota <= 0;
                v_name := v_names[v_i];
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
                IF coalesce(cardinality(v_got_s), 0) < v_quota THEN
                    v_p_dry[v_i] := true;   -- no more due lanes (that we can lock) for it
                END IF;
                IF v_got_s IS NOT NULL THEN
                    v_round_s := v_round_s || v_got_s;
                    v_round_p := v_round_p || v_got_p;
                    v_p_lanes[v_i] := v_p_lanes[v_i] + cardinality(v_got_s);
                    v_lanes_free := v_lanes_free - cardinality(v_got_s);
                END IF;
            END LOOP;
        END LOOP;
        EXIT WHEN cardinality(v_round_s) = 0;
        v_lanes_left := v_lanes_left - cardinality(v_round_s);

        -- 2. Candidates: per lane, the leading rows that are claimable (bool_and over the lane
        --    keeps only the prefix before the first blocked row), an even share of its
        --    perspective's rows per lane, ranked round-robin across the lanes (every lane's first
        --    row before any lane's second) and cut at the perspective's share (what is left is
        --    taken in the next round).
        v_p_cap := array_fill(1, ARRAY[v_n]);
        FOR v_i IN 1..v_n LOOP
            IF v_p_lanes[v_i] > 0 THEN
                v_p_cap[v_i] := coalesce(p_per_lane,
                                         ceil(v_p_left[v_i]::numeric / v_p_lanes[v_i])::int);
            END IF;
        END LOOP;
        SELECT array_agg(c.event_work_id), array_agg(c.sid), array_agg(c.pname),
               array_agg(c.stream_version), array_agg(c.row_tid)
        INTO v_c_id, v_c_s, v_c_p, v_c_v, v_c_tid
        FROM (
            SELECT s.event_work_id, s.sid, s.pname, s.stream_version, s.row_tid, s.rn
            FROM (
                SELECT r.event_work_id, r.sid, r.pname, r.stream_version, r.row_tid, r.rn,
                       r.quota_rows,
                       row_number() OVER (PARTITION BY r.pname ORDER BY r.rn, r.sid) AS prn
                FROM (
                    SELECT w.event_work_id, k.sid, k.pname, w.stream_version, w.row_tid,
                           q.quota_rows,
                           row_number() OVER lane AS rn,
                           bool_and(w.ok) OVER lane AS prefix_ok,
                           first_value(w.failures) OVER lane AS head_failures
                    FROM unnest(v_round_s, v_round_p) AS k(sid, pname)
                    JOIN unnest(v_names, v_p_left, v_p_cap) AS q(pname, quota_rows, per_lane)
                      ON q.pname = k.pname
                    CROSS JOIN LATERAL (
                        SELECT pe.event_work_id, pe.stream_version, pe.ctid AS row_tid,
                               pe.failures,
                               CASE
                                   WHEN pe.instance_id IS NULL THEN pe.scheduled_for <= now()
                                   WHEN pe.lease_expiry < now() THEN true
                                   ELSE NOT EXISTS (SELECT 1 FROM wh_service_instances si
                                                    WHERE si.instance_id = pe.instance_id)
                               END AS ok
                        FROM wh_perspective_events pe
                        WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid
                        ORDER BY pe.stream_version
                        LIMIT q.per_lane) w
                    WINDOW lane AS (PARTITION BY k.sid, k.pname ORDER BY w.stream_version)
                ) r
                -- (a head that failed before comes alone: it usually fails again, and each row
                --  leased behind it would be given back at every retry; migration 0025)
                WHERE r.prefix_ok AND (r.rn = 1 OR r.head_failures = 0)
            ) s
            WHERE s.prn <= s.quota_rows
            ORDER BY s.rn, s.sid, s.pname
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
                              pe.failures, pe.stream_id, pe.perspective_name, pe.stream_version,
                              pe.created_at, pe.replay)
                SELECT array_agg(l.event_work_id), array_agg(l.event_id),
                       array_agg(l.global_position), array_agg(l.attempts), array_agg(l.failures),
                       array_agg(l.stream_id), array_agg(l.perspective_name),
                       array_agg(l.stream_version), array_agg(l.created_at), array_agg(l.replay)
                INTO v_u_id, v_u_event, v_u_gp, v_u_attempts, v_u_failures, v_u_s, v_u_p, v_u_v,
                     v_u_q, v_u_r
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
                              pe.failures, pe.stream_id, pe.perspective_name, pe.stream_version,
                              pe.created_at, pe.replay)
                SELECT array_agg(l.event_work_id), array_agg(l.event_id),
                       array_agg(l.global_position), array_agg(l.attempts), array_agg(l.failures),
                       array_agg(l.stream_id), array_agg(l.perspective_name),
                       array_agg(l.stream_version), array_agg(l.created_at), array_agg(l.replay)
                INTO v_u_id, v_u_event, v_u_gp, v_u_attempts, v_u_failures, v_u_s, v_u_p, v_u_v,
                     v_u_q, v_u_r
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
                           array_agg(u.fail), array_agg(u.sid), array_agg(u.pname), array_agg(u.v),
                           array_agg(u.q), array_agg(u.rp)
                    INTO v_u_id, v_u_event, v_u_gp, v_u_attempts, v_u_failures, v_u_s, v_u_p, v_u_v,
                         v_u_q, v_u_r
                    FROM unnest(v_u_id, v_u_event, v_u_gp, v_u_attempts, v_u_failures, v_u_s,
                                v_u_p, v_u_v, v_u_q, v_u_r)
                         AS u(id, ev, gp, att, fail, sid, pname, v, q, rp)
                    WHERE NOT u.id = ANY (v_gap);
                END IF;
            END IF;
        END IF;
        v_take := v_u_id;
        v_taken := coalesce(cardinality(v_take), 0);
        v_l_s := '{}';
        v_l_p := '{}';
        IF v_taken > 0 THEN
            v_all := v_all || v_u_id;
            v_all_event := v_all_event || v_u_event;
            v_all_gp := v_all_gp || v_u_gp;
            v_all_attempts := v_all_attempts || v_u_attempts;
            v_all_failures := v_all_failures || v_u_failures;
            v_all_s := v_all_s || v_u_s;
            v_all_p := v_all_p || v_u_p;
            v_all_v := v_all_v || v_u_v;
            v_all_q := v_all_q || v_u_q;
            v_all_r := v_all_r || v_u_r;
            -- The lanes we leased from, once (steps 5 and 6 join on them).
            SELECT array_agg(l.sid), array_agg(l.pname) INTO v_l_s, v_l_p
            FROM (SELECT DISTINCT u.sid, u.pname FROM unnest(v_u_s, v_u_p) AS u(sid, pname)) l;
        END IF;

        -- 5. The lanes' hints. A lane we leased from is due when our lease expires; any other
        --    lane of the round is due when its head is (a parked head's scheduled_for, another
        --    live holder's expiry; a head locked by someone else, in a second), and an empty
        --    lane goes. These statements started after we took the lanes' locks (L1, L2); the
        --    holders named are locked FOR KEY SHARE first, so a cleanup removing one waits for
        --    this claim and then wakes the lane (one being removed right now counts as gone).
        -- (lanes we leased from are due at our own expiry: no holder to look up)
        SELECT array_agg(DISTINCT h.instance_id) INTO v_holders
        FROM (SELECT k.sid, k.pname FROM unnest(v_round_s, v_round_p) AS k(sid, pname)
              EXCEPT
              SELECT l.sid, l.pname FROM unnest(v_l_s, v_l_p) AS l(sid, pname)) k
        CROSS JOIN LATERAL (
            SELECT pe.instance_id
            FROM wh_perspective_events pe
            WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid
            ORDER BY pe.stream_version
            LIMIT 1) h
        WHERE h.instance_id IS NOT NULL AND h.instance_id <> p_instance_id;
        v_alive := '{}';
        IF v_holders IS NOT NULL THEN
            SELECT coalesce(array_agg(a.instance_id), '{}') INTO v_alive
            FROM (SELECT si.instance_id
                  FROM wh_service_instances si
                  WHERE si.instance_id = ANY (v_holders)
                  ORDER BY si.instance_id
                  FOR KEY SHARE SKIP LOCKED) a;
        END IF;

        WITH leased AS (
            SELECT l.sid, l.pname FROM unnest(v_l_s, v_l_p) AS l(sid, pname)),
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
                     AND h.instance_id = ANY (v_alive) THEN h.lease_expiry
                ELSE now() + interval '1 second'
            END,
            holder = CASE WHEN h.leased THEN p_instance_id ELSE h.instance_id END
        FROM heads h
        WHERE l.stream_id = h.sid AND l.perspective_name = h.pname
          AND (h.leased OR h.head IS NOT NULL);

        v_rows_left := v_rows_left - v_taken;
        -- Size each perspective's next round from what its lanes gave in this one.
        FOR v_i IN 1..v_n LOOP
            CONTINUE WHEN v_p_lanes[v_i] = 0;
            v_taken := (SELECT count(*) FROM unnest(v_u_p) AS u(pname)
                        WHERE u.pname = v_names[v_i]);
            v_p_got[v_i] := v_p_got[v_i] + v_taken;
            v_p_est[v_i] := greatest(v_taken::numeric / v_p_lanes[v_i], 1);
        END LOOP;
    END LOOP;

    IF cardinality(v_all) = 0 THEN
        RETURN;
    END IF;

    -- 6. The rows leased, with their raw events (what the lease returned; no second read of
    --    the work rows).
    RETURN QUERY
    SELECT r.id, r.sid, r.ev, r.pname, r.gp, r.v, e.event_type, e.event_data, e.metadata,
           r.att, r.fail, r.q, r.rp
    FROM unnest(v_all, v_all_event, v_all_gp, v_all_attempts, v_all_failures, v_all_s, v_all_p,
                v_all_v, v_all_q, v_all_r)
         AS r(id, ev, gp, att, fail, sid, pname, v, q, rp)
    -- (the events in one index scan by the positions, not one scan per row)
    LEFT JOIN (SELECT e.global_position, e.event_id, e.event_type, e.event_data, e.metadata
               FROM wh_event_store e
               WHERE e.global_position = ANY (v_all_gp)) e
      ON e.global_position = r.gp AND e.event_id = r.ev
    ORDER BY r.sid, r.pname, r.v;
END
$$;
