-- vantage schema, part 3: rebuilding a perspective on a running daemon, and dead letters that a
-- rebuild cannot race (issue 7, defects 1, 2 and 9).
--
-- The rebuild lock. `vantage perspectives rebuild NAME` holds a SESSION-level exclusive advisory
-- lock on wh_perspective_lock_key(NAME) on a dedicated connection for its whole run, so nothing
-- is persisted: a crashed or killed CLI leaves nothing paused (the server releases the lock when
-- the session ends). While it is held:
-- * both claim functions skip the perspective (they take the lock SHARED with
--   pg_try_advisory_xact_lock_shared, so a claim already running holds it until it commits and
--   the rebuild's exclusive lock waits for that claim; claims after that skip the perspective);
-- * move_to_dead_letters, requeue_dead_letter and resolve_dead_letter raise SQLSTATE 55P03
--   (lock_not_available) "perspective ... is being rebuilt": a transient conflict, nobody is
--   charged, retry later. One that got in first holds the lock shared until its transaction
--   ends, and the rebuild waits for it: so a rebuild's "skip events with an open dead letter"
--   and its re-queue are atomic with respect to every move, requeue and replay.
--
-- Functions redefined here (CREATE OR REPLACE, same signatures and results as in 0002):
-- claim_orphaned_perspective_events, get_stream_events (0002 bodies verbatim except the
-- perspective-name selection, marked "0003"), move_to_dead_letters, requeue_dead_letter,
-- resolve_dead_letter. New: wh_perspective_lock_key, wh_lock_perspective_shared,
-- wh_perspective_is_rebuilding.

------------------------------------------------------------------------------------------------
-- The rebuild lock
------------------------------------------------------------------------------------------------

-- The advisory lock key of a perspective. Schema-qualified, so two vantage schemas in one
-- database never share a lock. (append_events' per-stream keys live in the same key space;
-- a 64-bit collision is not a practical concern.)
CREATE FUNCTION wh_perspective_lock_key(p_perspective_name text)
RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT hashtextextended('vantage:perspective:' || current_schema() || ':' || p_perspective_name, 0);
$$;

-- Takes the perspective's rebuild lock shared until the end of the transaction, or raises 55P03
-- when a rebuild holds it. For state changes that must not interleave with a rebuild's reset and
-- re-queue (dead-letter moves, requeues, replays).
CREATE FUNCTION wh_lock_perspective_shared(p_perspective_name text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(wh_perspective_lock_key(p_perspective_name)) THEN
        RAISE EXCEPTION 'perspective "%" is being rebuilt; try again when the rebuild has finished',
            p_perspective_name
            USING ERRCODE = '55P03',
                  HINT = 'vantage perspectives rebuild holds the perspective''s lock while it resets and re-queues.';
    END IF;
END
$$;

-- True while some session holds the perspective's rebuild lock exclusively (a rebuild runs).
-- For operator messages only: the locks above are what make it safe.
CREATE FUNCTION wh_perspective_is_rebuilding(p_perspective_name text)
RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1
        FROM pg_locks l, (SELECT wh_perspective_lock_key(p_perspective_name) AS k) key
        WHERE l.locktype = 'advisory'
          AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
          AND l.classid = ((key.k >> 32) & 4294967295)::oid
          AND l.objid = (key.k & 4294967295)::oid
          AND l.objsubid = 1
          AND l.mode = 'ExclusiveLock'
          AND l.granted);
$$;

------------------------------------------------------------------------------------------------
-- Claims: skip a perspective being rebuilt
------------------------------------------------------------------------------------------------

-- The 0002 function (see its comment there), verbatim but for the perspective-name selection:
-- a perspective whose rebuild lock is held exclusively is skipped, nothing of it leased.
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
    -- 0003 (the only change to the 0002 body): parentheses, and skip a perspective being
    -- rebuilt (see wh_perspective_lock_key); the shared lock is held until the claim commits.
    WHERE (p_perspective_names IS NULL OR p.perspective_name = ANY (p_perspective_names))
      AND pg_try_advisory_xact_lock_shared(wh_perspective_lock_key(p.perspective_name));
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

-- The 0002 function (see its comment there), verbatim but for the perspective-name selection:
-- rows of a perspective whose rebuild lock is held exclusively are neither claimed nor returned
-- (the daemon gives back the lane heads it acquired just before, with a refund).
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
    -- 0003 (the only change to the 0002 body): parentheses, and skip a perspective being
    -- rebuilt (see wh_perspective_lock_key); the shared lock is held until the claim commits.
    WHERE (p_perspective_names IS NULL OR p.perspective_name = ANY (p_perspective_names))
      AND pg_try_advisory_xact_lock_shared(wh_perspective_lock_key(p.perspective_name));
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

------------------------------------------------------------------------------------------------
-- Dead letters
------------------------------------------------------------------------------------------------

-- Purged stays purged. 0001 kept one dead letter per (source_table, perspective, event) and a
-- move reopened it whatever its status, so a purge (terminal) could be undone by a later
-- exhaustion of the same message. Now uniqueness covers only records that are not purged: a
-- message exhausted again after a purge (it can only be queued again by a rebuild, which
-- re-queues purged events, or by hand) gets a NEW dead letter with its own history, and the
-- purged record and its history are never touched again. A resolved or requeued record is still
-- reopened, as before (one record per message while it is alive). So a message has at most one
-- record that is not purged, hence at most one open (exhausted) one per perspective and position.
ALTER TABLE wh_dead_letters DROP CONSTRAINT wh_dead_letters_message_key;
CREATE UNIQUE INDEX wh_dead_letters_unpurged_message_key
    ON wh_dead_letters (source_table, perspective_name, event_id)
    WHERE status <> 'purged';

-- Moves a work row to wh_dead_letters in one statement: delete the source row, insert (or reopen)
-- the dead letter, append the Exhausted history record. Returns the dead letter's id, or NULL
-- when the source row is already gone (another worker completed or moved it). The stored
-- error_text carries the row's last_error. Fenced: a row leased to another instance is left alone.
-- If the same message was dead-lettered before and the record is not purged (resolved or
-- requeued), that dead letter is reopened; a purged record is never reopened: a new one is made.
-- 0003: raises 55P03 while the row's perspective is being rebuilt (wh_lock_perspective_shared),
-- so a move never interleaves with a rebuild's re-queue.
CREATE OR REPLACE FUNCTION move_to_dead_letters(
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
    v_perspective text;
BEGIN
    IF p_source_table IS DISTINCT FROM 'wh_perspective_events' THEN
        RAISE EXCEPTION 'move_to_dead_letters: unknown source table %', coalesce(p_source_table, 'NULL')
            USING ERRCODE = '22023';
    END IF;

    SELECT pe.perspective_name INTO v_perspective
    FROM wh_perspective_events pe
    WHERE pe.event_work_id = p_source_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    PERFORM wh_lock_perspective_shared(v_perspective);

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
        ON CONFLICT (source_table, perspective_name, event_id) WHERE status <> 'purged' DO UPDATE
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
-- and marks it requeued, atomically, only if it is still exhausted (compare-and-set): false when
-- it no longer is.
-- 0003: raises 23505 (unique_violation), changing nothing, when a work row for the same
-- perspective and event already exists (the event is already queued: requeuing it too would
-- apply it twice) -- 0002 then reported success and wrote Requeued without inserting anything.
-- Raises 55P03 while the perspective is being rebuilt.
CREATE OR REPLACE FUNCTION requeue_dead_letter(p_dead_letter_id uuid, p_actor text)
RETURNS boolean
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_dl       wh_dead_letters%ROWTYPE;
    v_inserted bigint;
BEGIN
    SELECT d.* INTO v_dl FROM wh_dead_letters d WHERE d.dead_letter_id = p_dead_letter_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM wh_lock_perspective_shared(v_dl.perspective_name);

    UPDATE wh_dead_letters d
    SET status = 'requeued', status_changed_at = now()
    WHERE d.dead_letter_id = p_dead_letter_id AND d.status = 'exhausted';
    IF NOT FOUND THEN
        RETURN false;
    END IF;

    INSERT INTO wh_perspective_events
        (event_work_id, stream_id, event_id, global_position, stream_version, perspective_name,
         attempts, failures, scheduled_for)
    VALUES (v_dl.source_id, v_dl.stream_id, v_dl.event_id, v_dl.global_position,
            v_dl.stream_version, v_dl.perspective_name, 0, 0, now())
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS v_inserted = ROW_COUNT;
    IF v_inserted = 0 THEN
        -- Undoes the compare-and-set above with the rest of the statement.
        RAISE EXCEPTION 'dead letter % is already queued: perspective "%" has a work row for event % (position %); requeuing it would apply it twice',
            p_dead_letter_id, v_dl.perspective_name, v_dl.event_id, v_dl.global_position
            USING ERRCODE = '23505';
    END IF;

    INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
    VALUES (p_dead_letter_id, 'Requeued', p_actor, NULL);
    PERFORM pg_notify('vantage_work', '');
    RETURN true;
END
$$;

-- A successful replay: compare-and-set on status = 'exhausted' plus its history record, in the
-- replay's transaction (its effects and the resolution commit together).
-- 0003: raises 55P03 while the perspective is being rebuilt, and otherwise holds the rebuild
-- lock shared until the replay commits, so a rebuild's reset and re-queue never interleave with
-- a replay (the replay's effect is either reset and re-queued, or kept and not re-queued).
CREATE OR REPLACE FUNCTION resolve_dead_letter(p_dead_letter_id uuid, p_actor text, p_detail text DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_perspective text;
    v_done        boolean;
BEGIN
    SELECT d.perspective_name INTO v_perspective
    FROM wh_dead_letters d
    WHERE d.dead_letter_id = p_dead_letter_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM wh_lock_perspective_shared(v_perspective);

    WITH dl AS (
        UPDATE wh_dead_letters d
        SET status = 'resolved', status_changed_at = now()
        WHERE d.dead_letter_id = p_dead_letter_id AND d.status = 'exhausted'
        RETURNING d.dead_letter_id),
    hist AS (
        INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
        SELECT dl.dead_letter_id, 'ReplaySucceeded', p_actor, p_detail FROM dl)
    SELECT EXISTS (SELECT 1 FROM dl) INTO v_done;
    RETURN v_done;
END
$$;
