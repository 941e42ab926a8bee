-- vantage schema, part 6: nothing is leased to an instance after it has deregistered.
--
-- A claim abandoned at shutdown (the daemon stops waiting for it) can still finish on the
-- server. It used to finish after deregister_instance had given everything back, leaving rows
-- leased to an instance that no longer exists until another instance took them over (with a
-- bump). Now both claim functions lease only for a registered instance and hold its row with
-- FOR KEY SHARE while they run, and deregister_instance deletes the instance row FIRST (waiting,
-- at most its lock_timeout, for claims under way), then gives back the leases, in a statement
-- of its own that sees what those claims committed.
--
-- The claim functions are redefined whole from their 0004 text; only the guard is new.

CREATE OR REPLACE FUNCTION claim_orphaned_perspective_events(
    p_instance_id uuid,
    p_lease_seconds int,
    p_max_streams int,
    p_max_rows int,
    p_perspective_names text[] DEFAULT NULL)
RETURNS TABLE (event_work_id uuid, stream_id uuid, perspective_name text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_names      text[];
    v_name       text;
    v_start      uuid;
    v_cursor     uuid;
    v_wrapped    boolean;
    v_head       record;
    v_locked     uuid;
    v_heads      uuid[] := '{}';
    v_streams    uuid[] := '{}';
    v_visits     int := 0;
    v_max_heads  int := greatest(coalesce(p_max_rows, p_max_streams), 1);
    -- A safety net against a keyspace full of blocked lanes (parked or leased elsewhere).
    v_max_visits int := greatest(p_max_streams, 1) * 4 + 64;
BEGIN
    SELECT array_agg(p.perspective_name ORDER BY random()) INTO v_names
    FROM wh_perspectives p
    -- As in 0003: skip a perspective being rebuilt (see wh_perspective_lock_key); the shared
    -- lock is held until the claim commits.
    WHERE (p_perspective_names IS NULL OR p.perspective_name = ANY (p_perspective_names))
      AND pg_try_advisory_xact_lock_shared(wh_perspective_lock_key(p.perspective_name));
    -- 0006: only a registered instance claims, and it holds its row (KEY SHARE) until the claim
    -- commits, so deregister_instance (which deletes that row first) waits for a claim under way
    -- and no claim can lease anything for an instance that has deregistered.
    PERFORM 1 FROM wh_service_instances si WHERE si.instance_id = p_instance_id FOR KEY SHARE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF v_names IS NULL OR p_max_streams <= 0 THEN
        RETURN;
    END IF;

    <<perspectives>>
    FOREACH v_name IN ARRAY v_names LOOP
        v_start := gen_random_uuid();
        v_cursor := v_start;
        v_wrapped := false;
        LOOP
            EXIT perspectives WHEN cardinality(v_streams) >= p_max_streams
                                OR cardinality(v_heads) >= v_max_heads
                                OR v_visits >= v_max_visits;
            v_visits := v_visits + 1;

            -- The head of the next lane after the cursor.
            IF v_cursor IS NULL THEN
                SELECT pe.event_work_id, pe.stream_id, pe.instance_id, pe.lease_expiry, pe.scheduled_for
                INTO v_head
                FROM wh_perspective_events pe
                WHERE pe.perspective_name = v_name
                ORDER BY pe.stream_id, pe.stream_version
                LIMIT 1;
            ELSE
                SELECT pe.event_work_id, pe.stream_id, pe.instance_id, pe.lease_expiry, pe.scheduled_for
                INTO v_head
                FROM wh_perspective_events pe
                WHERE pe.perspective_name = v_name AND pe.stream_id > v_cursor
                ORDER BY pe.stream_id, pe.stream_version
                LIMIT 1;
            END IF;

            IF NOT FOUND THEN
                EXIT WHEN v_wrapped;           -- the whole keyspace of this perspective is visited
                v_wrapped := true;
                v_cursor := NULL;              -- wrap around to the smallest stream id
                CONTINUE;
            END IF;
            EXIT WHEN v_wrapped AND v_head.stream_id >= v_start;
            v_cursor := v_head.stream_id;

            CONTINUE WHEN v_head.stream_id = ANY (v_streams);

            -- Cheap pre-check on the snapshot; the locking query below re-checks on the live row.
            CONTINUE WHEN NOT CASE
                WHEN v_head.instance_id IS NULL THEN v_head.scheduled_for <= now()
                WHEN v_head.lease_expiry < now() THEN true
                ELSE NOT EXISTS (SELECT 1 FROM wh_service_instances si
                                 WHERE si.instance_id = v_head.instance_id)
            END;

            -- Another consumer loop of this instance holds a lane of this stream.
            CONTINUE WHEN EXISTS (
                SELECT 1
                FROM unnest(v_names) AS n(pname)
                CROSS JOIN LATERAL (
                    SELECT o.instance_id, o.lease_expiry
                    FROM wh_perspective_events o
                    WHERE o.perspective_name = n.pname AND o.stream_id = v_head.stream_id
                    ORDER BY o.stream_version
                    LIMIT 1) h
                WHERE h.instance_id = p_instance_id AND h.lease_expiry > now());

            -- Lock the head by its key (never "the first unlocked row of the lane").
            SELECT pe.event_work_id INTO v_locked
            FROM wh_perspective_events pe
            WHERE pe.event_work_id = v_head.event_work_id
              AND CASE
                    WHEN pe.instance_id IS NULL THEN pe.scheduled_for <= now()
                    WHEN pe.lease_expiry < now() THEN true
                    ELSE NOT EXISTS (SELECT 1 FROM wh_service_instances si
                                     WHERE si.instance_id = pe.instance_id)
                  END
              AND NOT EXISTS (SELECT 1 FROM wh_perspective_events e
                              WHERE e.perspective_name = pe.perspective_name
                                AND e.stream_id = pe.stream_id
                                AND e.stream_version < pe.stream_version)
            FOR UPDATE OF pe SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;

            v_heads := v_heads || v_locked;
            IF NOT v_head.stream_id = ANY (v_streams) THEN
                v_streams := v_streams || v_head.stream_id;
            END IF;
        END LOOP;
    END LOOP;

    IF cardinality(v_heads) = 0 THEN
        RETURN;
    END IF;

    RETURN QUERY
    UPDATE wh_perspective_events pe
    SET instance_id  = p_instance_id,
        lease_expiry = clock_timestamp() + make_interval(secs => p_lease_seconds),
        attempts     = pe.attempts + CASE WHEN pe.instance_id IS DISTINCT FROM p_instance_id
                                          THEN 1 ELSE 0 END,
        -- 0004: remember whether this claim bumped, so a give-back refunds exactly that.
        refundable   = pe.instance_id IS DISTINCT FROM p_instance_id
    WHERE pe.event_work_id = ANY (v_heads)
    RETURNING pe.event_work_id, pe.stream_id, pe.perspective_name;
END
$$;

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
    SELECT array_agg(p.perspective_name) INTO v_names
    FROM wh_perspectives p
    -- As in 0003: skip a perspective being rebuilt.
    WHERE (p_perspective_names IS NULL OR p.perspective_name = ANY (p_perspective_names))
      AND pg_try_advisory_xact_lock_shared(wh_perspective_lock_key(p.perspective_name));
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

-- Graceful exit: remove the instance (waiting for claims under way, which hold its row), then
-- give back every lease it holds, refunding exactly the bumps of rows no handler saw (the daemon
-- releases the rows its handlers saw first). Rows still locked (a transaction rolling back) are
-- skipped: they belong to a dead holder now and are taken over. Never waits long for a lock.
CREATE OR REPLACE FUNCTION deregister_instance(p_instance_id uuid)
RETURNS int
LANGUAGE plpgsql
SET lock_timeout = '2s'
AS $$
DECLARE
    v_released int;
BEGIN
    DELETE FROM wh_service_instances si WHERE si.instance_id = p_instance_id;
    WITH mine AS (
        SELECT pe.event_work_id
        FROM wh_perspective_events pe
        WHERE pe.instance_id = p_instance_id
        ORDER BY pe.event_work_id
        FOR UPDATE SKIP LOCKED),
    released AS (
        UPDATE wh_perspective_events pe
        SET instance_id  = NULL,
            lease_expiry = NULL,
            attempts     = greatest(pe.attempts - CASE WHEN pe.refundable THEN 1 ELSE 0 END, 0),
            refundable   = false
        FROM mine
        WHERE pe.event_work_id = mine.event_work_id
        RETURNING 1)
    SELECT count(*)::int INTO v_released FROM released;
    RETURN v_released;
END
$$;
