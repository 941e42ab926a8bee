-- vantage 0016: a work row says whether it re-delivers history (wh_perspective_events.replay),
-- and the claims return it (get_stream_events and its named-stream form, redefined; a new last
-- result column, replay).
--
-- A perspective with effects outside the database (an email, a webhook) must not repeat them
-- when history is delivered to it again to rebuild its read model. The daemon could not tell
-- it: a rebuilt event's work row looked like a live one. Now the row says so, and the daemon
-- hands it on (EventEnvelope::replay, TypedEnvelope::replay).
--
-- Invariant: replay is true exactly for the work rows that deliver an event to a perspective
-- that already had it, to rebuild state: the rows a rebuild re-queues after its reset
-- (requeue_history_batch_in, src/store/events.rs) and the rows a version's backfill diverts
-- (backfill_perspective_version below: history of a version, applied directly otherwise). It
-- is written once, when the row is inserted, and never changed. Every other row is false: the
-- fan-out's (a live event, whatever version it is for), and a dead letter's requeue
-- (requeue_dead_letter: the event's last delivery never committed, and the operator who
-- retries it asks for its effects). A row still queued when a rebuild re-queues the history
-- keeps its row and its false: it was never delivered.
--
-- Contract: replay is added after the existing columns (as 0015 added queued_at), so callers
-- that name their columns see no change. Arguments, behaviour and the invariants of parts 3 and
-- 4 are unchanged; the function bodies are 0015's with the one column carried through, and
-- the backfill is 0013's with its diverted rows marked. Privileges and comments of the claim
-- functions are carried over as 0015 did. The column's constant default makes ADD COLUMN a
-- catalogue change: no rewrite of the work table.

ALTER TABLE wh_perspective_events ADD COLUMN replay boolean NOT NULL DEFAULT false;

-- Save each function's ACL and comment for the duration of this transaction.
DO $$
DECLARE
    v_fn text;
BEGIN
    FOREACH v_fn IN ARRAY ARRAY[
        'get_stream_events(uuid,uuid[],integer,text[],integer,integer,integer)',
        'wh_get_named_stream_events(uuid,uuid[],integer,text[],integer)'] LOOP
        PERFORM set_config('vantage.m0016_acl_' || split_part(v_fn, '(', 1),
                           coalesce((SELECT p.proacl::text FROM pg_proc p
                                     WHERE p.oid = v_fn::regprocedure), ''), true);
        PERFORM set_config('vantage.m0016_comment_' || split_part(v_fn, '(', 1),
                           coalesce(obj_description(v_fn::regprocedure, 'pg_proc'), ''), true);
    END LOOP;
END
$$;

DROP FUNCTION get_stream_events(uuid, uuid[], integer, text[], integer, integer, integer);
DROP FUNCTION wh_get_named_stream_events(uuid, uuid[], integer, text[], integer);

-- The claim (0015's text, with replay).
CREATE FUNCTION get_stream_events(p_instance_id uuid, p_stream_ids uuid[], p_lease_seconds integer, p_perspective_names text[] DEFAULT NULL::text[], p_max_rows integer DEFAULT NULL::integer, p_max_lanes integer DEFAULT NULL::integer, p_per_lane integer DEFAULT NULL::integer)
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
    v_holders    uuid[];
    v_alive      uuid[];
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
        -- Size the next round from what this one's lanes gave.
        v_estimate := greatest(v_taken::numeric / cardinality(v_round_s), 1);
        EXIT WHEN cardinality(v_round_s) < v_want;   -- no more due lanes
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

-- The contract's named-stream form (0015's text, with replay).
CREATE FUNCTION wh_get_named_stream_events(p_instance_id uuid, p_stream_ids uuid[], p_lease_seconds integer, p_perspective_names text[] DEFAULT NULL::text[], p_max_rows integer DEFAULT NULL::integer)
 RETURNS TABLE(event_work_id uuid, stream_id uuid, event_id uuid, perspective_name text, global_position bigint, stream_version integer, event_type text, event_data jsonb, metadata jsonb, attempts integer, failures integer, queued_at timestamp with time zone, replay boolean)
 LANGUAGE plpgsql
AS $$
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
    -- Skip a perspective being rebuilt or paused (wh_claimable_perspectives says which).
    v_names := wh_claimable_perspectives(p_perspective_names);
    -- Only a registered instance claims, and it holds its row (KEY SHARE) until the claim
    -- commits, so deregister_instance (which deletes that row first) waits for a claim under way
    -- and no claim can lease anything for an instance that has deregistered. A row being
    -- deleted right now (a deregistration, or a cleanup that found this instance silent) is
    -- skipped, not waited for: such an instance claims nothing until it is registered again.
    PERFORM 1 FROM wh_service_instances si WHERE si.instance_id = p_instance_id
    FOR KEY SHARE SKIP LOCKED;
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
        -- (remember whether this claim bumped, so a give-back refunds exactly that)
        refundable   = pe.instance_id IS DISTINCT FROM p_instance_id
    WHERE pe.event_work_id = ANY (v_take)
      AND (pe.instance_id IS DISTINCT FROM p_instance_id OR pe.lease_expiry <= now());

    -- 5. Everything of the window now validly leased to the caller, with the raw event.
    RETURN QUERY
    SELECT pe.event_work_id, pe.stream_id, pe.event_id, pe.perspective_name,
           pe.global_position, pe.stream_version, ev.event_type, ev.event_data,
           ev.metadata, pe.attempts, pe.failures, pe.created_at, pe.replay
    FROM wh_perspective_events pe
    LEFT JOIN wh_event_store ev ON ev.global_position = pe.global_position
                               AND ev.event_id = pe.event_id
    WHERE pe.event_work_id = ANY (v_take)
      AND pe.instance_id = p_instance_id
      AND pe.lease_expiry > now()
    ORDER BY pe.stream_id, pe.perspective_name, pe.stream_version;
END
$$;

-- Give the saved ACLs and comments back. An ACL of NULL (never granted or revoked) was the
-- default, which the new functions have already.
DO $$
DECLARE
    v_fn      text;
    v_acl     text;
    v_comment text;
    v_item    record;
BEGIN
    FOREACH v_fn IN ARRAY ARRAY[
        'get_stream_events(uuid,uuid[],integer,text[],integer,integer,integer)',
        'wh_get_named_stream_events(uuid,uuid[],integer,text[],integer)'] LOOP
        v_acl := current_setting('vantage.m0016_acl_' || split_part(v_fn, '(', 1));
        IF v_acl <> '' THEN
            EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', v_fn::regprocedure);
            FOR v_item IN
                SELECT a.grantee, a.is_grantable
                FROM aclexplode(v_acl::aclitem[]) a
                WHERE a.privilege_type = 'EXECUTE'
            LOOP
                EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %s%s', v_fn::regprocedure,
                               CASE WHEN v_item.grantee = 0 THEN 'PUBLIC'
                                    ELSE v_item.grantee::regrole::text END,  -- (quoted as needed)
                               CASE WHEN v_item.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
            END LOOP;
        END IF;
        v_comment := current_setting('vantage.m0016_comment_' || split_part(v_fn, '(', 1));
        IF v_comment <> '' THEN
            EXECUTE format('COMMENT ON FUNCTION %s IS %L', v_fn::regprocedure, v_comment);
        END IF;
    END LOOP;
END
$$;

-- The backfill (0013's text): a diverted event is history of the version, so its row is a
-- replay.
CREATE OR REPLACE FUNCTION backfill_perspective_version(p_perspective_name text, p_version integer, p_max integer DEFAULT 1000, p_divert boolean DEFAULT false)
 RETURNS TABLE(outcome text, applied integer, backfill_position bigint, backfill_target bigint, diverted integer)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
#variable_conflict use_column
DECLARE
    v        wh_perspective_versions;
    v_last   bigint;
    v_n      int := 0;
    v_moved  int := 0;
    v_data   jsonb[];
    v_stream uuid[];
    v_id     uuid[];
    v_type   text[];
    v_pos    bigint[];
    v_ver    int[];
    v_meta   jsonb[];
BEGIN
    SELECT * INTO v FROM wh_perspective_versions x
    WHERE x.perspective_name = p_perspective_name AND x.version = p_version
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'busy'::text, 0, NULL::bigint, NULL::bigint, 0;
        RETURN;
    END IF;
    IF v.state <> 'building' THEN
        RETURN QUERY SELECT v.state, 0, v.backfill_position, v.backfill_target, 0;
        RETURN;
    END IF;
    IF v.backfill_horizon IS NULL THEN
        -- (taken after the registration committed: later transactions see the registry row)
        v.backfill_horizon := pg_snapshot_xmax(pg_current_snapshot());
        v.backfill_target := (SELECT coalesce(max(e.global_position), 0) FROM wh_event_store e);
        UPDATE wh_perspective_versions x
        SET backfill_horizon = v.backfill_horizon, backfill_target = v.backfill_target,
            backfill_started_at = now()
        WHERE x.perspective_name = p_perspective_name AND x.version = p_version;
    END IF;
    IF NOT wh_horizon_passed(v.backfill_horizon) THEN
        RETURN QUERY SELECT 'waiting'::text, 0, v.backfill_position, v.backfill_target, 0;
        RETURN;
    END IF;

    SELECT max(w.global_position) INTO v_last
    FROM (SELECT e.global_position FROM wh_event_store e
          WHERE e.global_position > v.backfill_position
          ORDER BY e.global_position LIMIT greatest(p_max, 1)) w;
    IF v_last IS NULL THEN
        -- The visible end: every later event has a work row of this version.
        UPDATE wh_perspective_versions x SET state = 'ready', backfill_done_at = now()
        WHERE x.perspective_name = p_perspective_name AND x.version = p_version;
        IF NOT EXISTS (SELECT 1 FROM wh_perspective_versions x
                       WHERE x.perspective_name = p_perspective_name AND x.state = 'live') THEN
            PERFORM wh_make_live(p_perspective_name, p_version, 'Live', 'vantage backfill');
            RETURN QUERY SELECT 'live'::text, 0, v.backfill_position, v.backfill_target, 0;
            RETURN;
        END IF;
        RETURN QUERY SELECT 'ready'::text, 0, v.backfill_position, v.backfill_target, 0;
        RETURN;
    END IF;

    -- The batch's events of this version's types that have no work row of it yet; those to
    -- divert become work rows first (in position order, as the fan-out writes them).
    INSERT INTO wh_perspective_events
        (stream_id, event_id, global_position, stream_version, perspective_name, replay)
    SELECT e.stream_id, e.event_id, e.global_position, e.stream_version, v.registry_name, true
    FROM wh_event_store e
    WHERE e.global_position > v.backfill_position AND e.global_position <= v_last
      AND (e.event_type = ANY (v.event_types) OR '*' = ANY (v.event_types))
      AND NOT EXISTS (SELECT 1 FROM wh_perspective_events w
                      WHERE w.perspective_name = v.registry_name AND w.event_id = e.event_id)
      AND (p_divert
           OR EXISTS (SELECT 1 FROM wh_perspective_events w
                      WHERE w.perspective_name = v.registry_name AND w.stream_id = e.stream_id
                        AND w.stream_version < e.stream_version))
    ORDER BY e.global_position;
    GET DIAGNOSTICS v_moved = ROW_COUNT;

    IF NOT p_divert THEN
        SELECT array_agg(e.event_data ORDER BY e.global_position),
               array_agg(e.stream_id ORDER BY e.global_position),
               array_agg(e.event_id ORDER BY e.global_position),
               array_agg(e.event_type ORDER BY e.global_position),
               array_agg(e.global_position ORDER BY e.global_position),
               array_agg(e.stream_version ORDER BY e.global_position),
               array_agg(e.metadata ORDER BY e.global_position)
        INTO v_data, v_stream, v_id, v_type, v_pos, v_ver, v_meta
        FROM wh_event_store e
        WHERE e.global_position > v.backfill_position AND e.global_position <= v_last
          AND (e.event_type = ANY (v.event_types) OR '*' = ANY (v.event_types))
          AND NOT EXISTS (SELECT 1 FROM wh_perspective_events w
                          WHERE w.perspective_name = v.registry_name AND w.event_id = e.event_id);
        IF v_id IS NOT NULL THEN
            EXECUTE format('SELECT %I.vantage_apply_many($1, $2, $3, $4, $5, $6, $7)', v.version_schema)
                INTO v_n
                USING v_data, v_stream, v_id, v_type, v_pos, v_ver, v_meta;
        END IF;
    END IF;
    UPDATE wh_perspective_versions x
    SET backfill_position = v_last, backfill_applied = x.backfill_applied + v_n
    WHERE x.perspective_name = p_perspective_name AND x.version = p_version;
    RETURN QUERY SELECT 'applied'::text, v_n, v_last, v.backfill_target, v_moved;
END
$$;
