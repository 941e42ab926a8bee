-- vantage schema, part 2: the functions of the database contract (SPEC §2).
--
-- Vocabulary:
-- * lane: the work rows of one (perspective_name, stream_id), applied in stream_version order.
-- * head: the row of a lane with the lowest stream_version (the head-of-line gate: nothing behind
--   it may be applied before it is completed or dead-lettered).
-- * takeover: a claim that changes instance_id (NULL -> caller, or a lapsed/dead holder -> caller).
--   Only a takeover bumps attempts; an instance re-leasing its own rows never does.
-- * dead holder: an instance_id with no row in wh_service_instances (never registered, deregistered,
--   or removed by cleanup_dead_instances once silent for orphans.stale_after).
--
-- Leases held by one instance within a lane are always a prefix of the lane, because claims lease
-- prefixes and the daemon completes, fails or releases rows in lane order.

------------------------------------------------------------------------------------------------
-- Producers
------------------------------------------------------------------------------------------------

-- Fan-out: one work row per inserted event and subscribed perspective, in the same transaction,
-- for append_events and for plain INSERTs alike. Statement-level, so a bulk insert is one
-- INSERT ... SELECT, not one trigger call per row.
CREATE FUNCTION wh_event_store_fan_out() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_rows bigint;
BEGIN
    INSERT INTO wh_perspective_events
        (stream_id, event_id, global_position, stream_version, perspective_name)
    SELECT e.stream_id, e.event_id, e.global_position, e.stream_version, p.perspective_name
    FROM new_events e
    JOIN wh_perspectives p
      ON e.event_type = ANY (p.event_types) OR '*' = ANY (p.event_types)
    ORDER BY e.global_position, p.perspective_name;
    GET DIAGNOSTICS v_rows = ROW_COUNT;
    IF v_rows > 0 THEN
        PERFORM pg_notify('vantage_work', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER wh_event_store_fan_out
    AFTER INSERT ON wh_event_store
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION wh_event_store_fan_out();

-- Appends events to one stream. p_events: [{event_type, data, metadata?, event_id?}, ...].
-- p_expected_version: the version the writer last saw (0 = a new stream), NULL = any.
CREATE FUNCTION append_events(p_stream_id uuid, p_expected_version int, p_events jsonb)
RETURNS TABLE (global_position bigint, event_id uuid, stream_version int)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_current int;
BEGIN
    IF p_stream_id IS NULL THEN
        RAISE EXCEPTION 'append_events: stream id is required' USING ERRCODE = '22004';
    END IF;
    IF p_events IS NULL OR jsonb_typeof(p_events) <> 'array' THEN
        RAISE EXCEPTION 'append_events: events must be a JSON array' USING ERRCODE = '22023';
    END IF;
    IF EXISTS (SELECT 1 FROM jsonb_array_elements(p_events) e
               WHERE jsonb_typeof(e) <> 'object'
                  OR jsonb_typeof(e -> 'event_type') IS DISTINCT FROM 'string'
                  OR e ->> 'event_type' = '') THEN
        RAISE EXCEPTION 'append_events: every event needs a non-empty string event_type'
            USING ERRCODE = '22023';
    END IF;

    -- Serialise appenders of one stream; other streams are not blocked.
    PERFORM pg_advisory_xact_lock(
        ('x' || substr(md5('vantage:stream:' || p_stream_id::text), 1, 16))::bit(64)::bigint);

    SELECT coalesce(max(s.stream_version), 0) INTO v_current
    FROM wh_event_store s WHERE s.stream_id = p_stream_id;

    IF p_expected_version IS NOT NULL AND p_expected_version <> v_current THEN
        RAISE EXCEPTION 'stream % is at version %, expected version %',
            p_stream_id, v_current, p_expected_version
            USING ERRCODE = '40001';
    END IF;

    RETURN QUERY
    INSERT INTO wh_event_store (event_id, stream_id, stream_version, event_type, event_data, metadata)
    SELECT coalesce((e.value ->> 'event_id')::uuid, gen_random_uuid()),
           p_stream_id,
           v_current + e.ordinality::int,
           e.value ->> 'event_type',
           coalesce(e.value -> 'data', '{}'::jsonb),
           coalesce(e.value -> 'metadata', '{}'::jsonb)
    FROM jsonb_array_elements(p_events) WITH ORDINALITY AS e(value, ordinality)
    ORDER BY e.ordinality
    RETURNING global_position, event_id, stream_version;
END
$$;

-- Registers (or updates) a perspective and the event types it subscribes to ('*' = all).
CREATE FUNCTION register_perspective(p_perspective_name text, p_event_types text[])
RETURNS void
LANGUAGE sql AS $$
    INSERT INTO wh_perspectives (perspective_name, event_types)
    VALUES (p_perspective_name, p_event_types)
    ON CONFLICT (perspective_name) DO UPDATE
        SET event_types = EXCLUDED.event_types,
            updated_at = now()
        WHERE wh_perspectives.event_types IS DISTINCT FROM EXCLUDED.event_types;
$$;

------------------------------------------------------------------------------------------------
-- Claims
------------------------------------------------------------------------------------------------

-- Acquires lanes whose head is unowned and due, lease-expired, or held by a dead instance, and
-- leases their heads (attempts + 1 on takeover). Lanes are found by a loose index scan of the
-- lane index from a random starting stream, one probe per lane, so the cost depends on the
-- number of lanes visited, not on the size of the backlog. Streams where the caller already holds
-- a valid lease are skipped (another consumer loop of the same instance is working on them).
-- Returns the leased heads.
CREATE FUNCTION claim_orphaned_perspective_events(
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
    WHERE p_perspective_names IS NULL OR p.perspective_name = ANY (p_perspective_names);
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
        lease_expiry = now() + make_interval(secs => p_lease_seconds),
        attempts     = pe.attempts + CASE WHEN pe.instance_id IS DISTINCT FROM p_instance_id
                                          THEN 1 ELSE 0 END
    WHERE pe.event_work_id = ANY (v_heads)
    RETURNING pe.event_work_id, pe.stream_id, pe.perspective_name;
END
$$;

-- Claims the claimable rows of the given streams (for each lane, a prefix in stream_version order
-- of rows that are the caller's or claimable; a takeover bumps attempts; the caller's own rows are
-- neither bumped nor re-extended while valid, and re-leased without a bump once expired), then
-- returns the rows of those streams validly leased to the caller, with the raw event, ordered by
-- stream, perspective, stream_version. A lane whose head is leased by another live instance, or
-- parked until later, is neither claimed nor returned.
--
-- p_max_rows bounds the rows of one call (spread across lanes: every lane gets its first row
-- before any lane gets a second), so a long stream never yields more than can be applied within
-- the lease. Rows of a lane beyond the window are claimed by a later call.
-- A row whose event has vanished from wh_event_store is returned with a NULL event_type.
CREATE FUNCTION get_stream_events(
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
    WHERE p_perspective_names IS NULL OR p.perspective_name = ANY (p_perspective_names);
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
        lease_expiry = now() + make_interval(secs => p_lease_seconds),
        attempts     = pe.attempts + CASE WHEN pe.instance_id IS DISTINCT FROM p_instance_id
                                          THEN 1 ELSE 0 END
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

-- The same claim for one lane (stream, perspective).
CREATE FUNCTION claim_and_fetch_pending_perspective_events(
    p_stream_id uuid,
    p_perspective_name text,
    p_instance_id uuid,
    p_lease_seconds int,
    p_max_rows int DEFAULT NULL)
RETURNS TABLE (event_work_id uuid, event_id uuid, stream_version int, attempts int)
LANGUAGE sql AS $$
    SELECT g.event_work_id, g.event_id, g.stream_version, g.attempts
    FROM get_stream_events(p_instance_id, ARRAY[p_stream_id], p_lease_seconds,
                           ARRAY[p_perspective_name], p_max_rows) g
    ORDER BY g.stream_version;
$$;

------------------------------------------------------------------------------------------------
-- Lease holder's state changes (all fenced on instance_id)
------------------------------------------------------------------------------------------------

-- Deletes the caller's rows (applied). A row no longer leased to the caller is not touched.
CREATE FUNCTION complete_perspective_events(p_instance_id uuid, p_event_work_ids uuid[])
RETURNS int
LANGUAGE sql AS $$
    WITH done AS (
        DELETE FROM wh_perspective_events pe
        WHERE pe.event_work_id = ANY (p_event_work_ids)
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT count(*)::int FROM done;
$$;

-- Records an apply failure: failures + 1, last_error, lease cleared, parked until the backoff has
-- passed. The next claim is a takeover and bumps attempts. p_retry_after, when given, overrides
-- p_retry_after_seconds (sub-second backoffs).
CREATE FUNCTION record_perspective_event_failure(
    p_instance_id uuid,
    p_event_work_id uuid,
    p_error text,
    p_retry_after_seconds int,
    p_retry_after interval DEFAULT NULL)
RETURNS boolean
LANGUAGE sql AS $$
    WITH failed AS (
        UPDATE wh_perspective_events pe
        SET failures      = pe.failures + 1,
            last_error    = p_error,
            instance_id   = NULL,
            lease_expiry  = NULL,
            scheduled_for = now() + coalesce(p_retry_after,
                                             make_interval(secs => greatest(p_retry_after_seconds, 0)))
        WHERE pe.event_work_id = p_event_work_id
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT EXISTS (SELECT 1 FROM failed);
$$;

-- Gives back rows the caller claimed but never handed to a handler, refunding the attempt so
-- lease churn never dead-letters a healthy event.
CREATE FUNCTION release_unstarted_leases(p_instance_id uuid, p_event_work_ids uuid[])
RETURNS int
LANGUAGE sql AS $$
    WITH released AS (
        UPDATE wh_perspective_events pe
        SET instance_id  = NULL,
            lease_expiry = NULL,
            attempts     = greatest(pe.attempts - 1, 0)
        WHERE pe.event_work_id = ANY (p_event_work_ids)
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT count(*)::int FROM released;
$$;

-- Extends the leases of rows the caller still holds (in-flight work). Rows locked right now are
-- skipped: they are being completed, failed or released by the transaction holding them, and
-- waiting for it could deadlock with the completion of another batch (locks are taken in one
-- order, without waiting).
CREATE FUNCTION renew_leases(p_instance_id uuid, p_event_work_ids uuid[], p_lease_seconds int)
RETURNS int
LANGUAGE sql AS $$
    WITH mine AS (
        SELECT pe.event_work_id
        FROM wh_perspective_events pe
        WHERE pe.event_work_id = ANY (p_event_work_ids)
          AND pe.instance_id = p_instance_id
        ORDER BY pe.event_work_id
        FOR UPDATE SKIP LOCKED),
    renewed AS (
        UPDATE wh_perspective_events pe
        SET lease_expiry = now() + make_interval(secs => p_lease_seconds)
        FROM mine
        WHERE pe.event_work_id = mine.event_work_id
        RETURNING 1)
    SELECT count(*)::int FROM renewed;
$$;

------------------------------------------------------------------------------------------------
-- Instances
------------------------------------------------------------------------------------------------

-- Registers the instance or records its heartbeat. Returns false when the instance had been
-- declared dead (its row was gone) and has just been registered again.
CREATE FUNCTION heartbeat(
    p_instance_id uuid,
    p_service_name text DEFAULT 'vantage',
    p_host_name text DEFAULT '',
    p_process_id int DEFAULT 0,
    p_version text DEFAULT '')
RETURNS boolean
LANGUAGE sql AS $$
    INSERT INTO wh_service_instances AS si
        (instance_id, service_name, host_name, process_id, version)
    VALUES (p_instance_id, p_service_name, p_host_name, p_process_id, p_version)
    ON CONFLICT (instance_id) DO UPDATE SET last_heartbeat_at = now()
    RETURNING (xmax <> 0);
$$;

-- Graceful exit: gives back every lease of the instance with a refund, then removes it.
CREATE FUNCTION deregister_instance(p_instance_id uuid)
RETURNS int
LANGUAGE sql AS $$
    WITH released AS (
        UPDATE wh_perspective_events pe
        SET instance_id  = NULL,
            lease_expiry = NULL,
            attempts     = greatest(pe.attempts - 1, 0)
        WHERE pe.instance_id = p_instance_id
        RETURNING 1),
    gone AS (
        DELETE FROM wh_service_instances si WHERE si.instance_id = p_instance_id RETURNING 1)
    SELECT count(*)::int FROM released;
$$;

-- Removes instances silent for longer than p_stale_seconds. Their leases then belong to a dead
-- holder and are taken over by the next claim (attempts + 1) without waiting for lease expiry.
CREATE FUNCTION cleanup_dead_instances(p_stale_seconds double precision)
RETURNS SETOF uuid
LANGUAGE sql AS $$
    DELETE FROM wh_service_instances si
    WHERE si.last_heartbeat_at < now() - make_interval(secs => p_stale_seconds)
    RETURNING si.instance_id;
$$;

------------------------------------------------------------------------------------------------
-- Dead letters
------------------------------------------------------------------------------------------------

-- Moves a work row to wh_dead_letters in one statement: delete the source row, insert (or reopen)
-- the dead letter, append the Exhausted history record. Returns the dead letter's id, or NULL
-- when the source row is already gone (another worker completed or moved it). The stored
-- error_text carries the row's last_error. Fenced: a row leased to another instance is left alone.
-- If the same message was dead-lettered before (then requeued), that dead letter is reopened,
-- keeping one record and one history per message.
CREATE FUNCTION move_to_dead_letters(
    p_dead_letter_id uuid,
    p_source_table text,
    p_source_id uuid,
    p_failure_reason text,
    p_error_text text,
    p_instance_id uuid)
RETURNS uuid
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_id uuid;
BEGIN
    IF p_source_table IS DISTINCT FROM 'wh_perspective_events' THEN
        RAISE EXCEPTION 'move_to_dead_letters: unknown source table %', coalesce(p_source_table, 'NULL')
            USING ERRCODE = '22023';
    END IF;

    WITH src AS (
        DELETE FROM wh_perspective_events pe
        WHERE pe.event_work_id = p_source_id
          AND (pe.instance_id IS NULL OR p_instance_id IS NULL OR pe.instance_id = p_instance_id)
        RETURNING pe.*),
    dl AS (
        INSERT INTO wh_dead_letters AS d
            (dead_letter_id, source_table, source_id, stream_id, event_id, global_position,
             stream_version, event_type, perspective_name, failure_reason, error_text,
             attempts_when_dlq, failures_when_dlq, dead_lettered_at, dead_lettered_by,
             status, status_changed_at)
        SELECT coalesce(p_dead_letter_id, gen_random_uuid()), p_source_table, src.event_work_id,
               src.stream_id, src.event_id, src.global_position, src.stream_version,
               ev.event_type, src.perspective_name, p_failure_reason,
               nullif(concat_ws(E'\n', p_error_text,
                                CASE WHEN src.last_error IS NOT NULL
                                     THEN 'last error: ' || src.last_error END), ''),
               src.attempts, src.failures, now(), p_instance_id, 'exhausted', now()
        FROM src
        LEFT JOIN wh_event_store ev ON ev.global_position = src.global_position
        ON CONFLICT (source_table, perspective_name, event_id) DO UPDATE
            SET source_id = EXCLUDED.source_id,
                failure_reason = EXCLUDED.failure_reason,
                error_text = EXCLUDED.error_text,
                attempts_when_dlq = EXCLUDED.attempts_when_dlq,
                failures_when_dlq = EXCLUDED.failures_when_dlq,
                dead_lettered_at = EXCLUDED.dead_lettered_at,
                dead_lettered_by = EXCLUDED.dead_lettered_by,
                status = 'exhausted',
                status_changed_at = now()
        RETURNING d.dead_letter_id, d.error_text),
    hist AS (
        INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
        SELECT dl.dead_letter_id, 'Exhausted',
               coalesce('instance ' || p_instance_id::text, 'vantage'),
               p_failure_reason || coalesce(': ' || dl.error_text, '')
        FROM dl)
    SELECT dl.dead_letter_id INTO v_id FROM dl;
    RETURN v_id;
END
$$;

-- Hands a dead letter back to the daemon: re-inserts its work row (attempts 0, unleased, due now)
-- and marks it requeued, atomically, only if it is still exhausted (compare-and-set).
CREATE FUNCTION requeue_dead_letter(p_dead_letter_id uuid, p_actor text)
RETURNS boolean
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_done boolean;
BEGIN
    WITH dl AS (
        UPDATE wh_dead_letters d
        SET status = 'requeued', status_changed_at = now()
        WHERE d.dead_letter_id = p_dead_letter_id AND d.status = 'exhausted'
        RETURNING d.*),
    work AS (
        INSERT INTO wh_perspective_events
            (event_work_id, stream_id, event_id, global_position, stream_version, perspective_name,
             attempts, failures, scheduled_for)
        SELECT dl.source_id, dl.stream_id, dl.event_id, dl.global_position, dl.stream_version,
               dl.perspective_name, 0, 0, now()
        FROM dl
        ON CONFLICT DO NOTHING
        RETURNING 1),
    hist AS (
        INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
        SELECT dl.dead_letter_id, 'Requeued', p_actor, NULL FROM dl)
    SELECT EXISTS (SELECT 1 FROM dl) INTO v_done;
    IF v_done THEN
        PERFORM pg_notify('vantage_work', '');
    END IF;
    RETURN v_done;
END
$$;

-- Operator transitions, each a compare-and-set on status = 'exhausted' plus its history record.
CREATE FUNCTION purge_dead_letter(p_dead_letter_id uuid, p_actor text, p_detail text DEFAULT NULL)
RETURNS boolean
LANGUAGE sql AS $$
    WITH dl AS (
        UPDATE wh_dead_letters d
        SET status = 'purged', status_changed_at = now()
        WHERE d.dead_letter_id = p_dead_letter_id AND d.status = 'exhausted'
        RETURNING d.dead_letter_id),
    hist AS (
        INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
        SELECT dl.dead_letter_id, 'Purged', p_actor, p_detail FROM dl)
    SELECT EXISTS (SELECT 1 FROM dl);
$$;

CREATE FUNCTION resolve_dead_letter(p_dead_letter_id uuid, p_actor text, p_detail text DEFAULT NULL)
RETURNS boolean
LANGUAGE sql AS $$
    WITH dl AS (
        UPDATE wh_dead_letters d
        SET status = 'resolved', status_changed_at = now()
        WHERE d.dead_letter_id = p_dead_letter_id AND d.status = 'exhausted'
        RETURNING d.dead_letter_id),
    hist AS (
        INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
        SELECT dl.dead_letter_id, 'ReplaySucceeded', p_actor, p_detail FROM dl)
    SELECT EXISTS (SELECT 1 FROM dl);
$$;

-- A replay that failed again: the dead letter stays exhausted; the attempt is recorded. Also a
-- compare-and-set, so a replay racing a purge cannot write history onto a purged letter.
CREATE FUNCTION record_dead_letter_replay_failure(p_dead_letter_id uuid, p_actor text, p_error text)
RETURNS boolean
LANGUAGE sql AS $$
    WITH dl AS (
        UPDATE wh_dead_letters d
        SET status_changed_at = d.status_changed_at
        WHERE d.dead_letter_id = p_dead_letter_id AND d.status = 'exhausted'
        RETURNING d.dead_letter_id),
    hist AS (
        INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
        SELECT dl.dead_letter_id, 'ReplayFailed', p_actor, p_error FROM dl)
    SELECT EXISTS (SELECT 1 FROM dl);
$$;
