-- vantage schema, part 4: exact refunds, real-clock lease and backoff times, bounded exits.
--
-- * wh_perspective_events.refundable: true while the row's current lease came from a claim that
--   bumped attempts (a takeover) and no give-back has refunded it since. A give-back of rows no
--   handler saw refunds exactly that bump (release_unstarted_leases); rows a handler saw go back
--   without a refund (release_started_leases). Before, every give-back refunded one attempt, so
--   rows re-leased by their own instance (no bump) and rows that had reached a handler were
--   refunded anyway and attempts undercounted.
-- * Lease expiries and retry times written inside a transaction use clock_timestamp(), not
--   now(): now() is the start of the transaction, and a failure recorded late in a long batch
--   got a backoff that had already (mostly) run out.
-- * note_perspective_event_error keeps the last error of a row given back uncharged.
-- * move_to_dead_letters with an instance id moves only rows leased to that instance (NULL =
--   an operator, unfenced), like every other change made on behalf of a lease.
-- * deregister_instance skips rows it cannot lock and waits at most 2 s for any lock, so a
--   graceful exit can never hang on a transaction that is still rolling back.
--
-- The claim functions are redefined whole (CREATE OR REPLACE) from their 0003 text: only their
-- lease UPDATEs change.

ALTER TABLE wh_perspective_events
    ADD COLUMN refundable boolean NOT NULL DEFAULT false;

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

-- Records an apply failure: failures + 1, last_error, lease cleared, parked until the backoff has
-- passed, counted from the real clock (the failure may come late in a long transaction). The
-- attempt stays charged (the row reached a handler). Fenced on the lease holder.
CREATE OR REPLACE FUNCTION record_perspective_event_failure(
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
            refundable    = false,
            scheduled_for = clock_timestamp()
                            + coalesce(p_retry_after,
                                       make_interval(secs => greatest(p_retry_after_seconds, 0)))
        WHERE pe.event_work_id = p_event_work_id
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT EXISTS (SELECT 1 FROM failed);
$$;

-- Gives back rows the caller claimed but never handed to a handler, refunding exactly the bump
-- their claim made (none for a row its own instance re-leased), so lease churn never
-- dead-letters a healthy event and never undercounts either.
CREATE OR REPLACE FUNCTION release_unstarted_leases(p_instance_id uuid, p_event_work_ids uuid[])
RETURNS int
LANGUAGE sql AS $$
    WITH released AS (
        UPDATE wh_perspective_events pe
        SET instance_id  = NULL,
            lease_expiry = NULL,
            attempts     = greatest(pe.attempts - CASE WHEN pe.refundable THEN 1 ELSE 0 END, 0),
            refundable   = false
        WHERE pe.event_work_id = ANY (p_event_work_ids)
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT count(*)::int FROM released;
$$;

-- Gives back rows a handler saw (a batch rolled back by a lost lease, a lost database, an
-- abandoned shutdown) without a refund: the attempt was used.
CREATE FUNCTION release_started_leases(p_instance_id uuid, p_event_work_ids uuid[])
RETURNS int
LANGUAGE sql AS $$
    WITH released AS (
        UPDATE wh_perspective_events pe
        SET instance_id  = NULL,
            lease_expiry = NULL,
            refundable   = false
        WHERE pe.event_work_id = ANY (p_event_work_ids)
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT count(*)::int FROM released;
$$;

-- Keeps the error of a row that is given back uncharged (a lock conflict, a lost database), so
-- an operator sees why it is not moving. Fenced; changes nothing else.
CREATE FUNCTION note_perspective_event_error(p_instance_id uuid, p_event_work_id uuid, p_error text)
RETURNS boolean
LANGUAGE sql AS $$
    WITH noted AS (
        UPDATE wh_perspective_events pe
        SET last_error = p_error
        WHERE pe.event_work_id = p_event_work_id
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT EXISTS (SELECT 1 FROM noted);
$$;

-- Extends the leases of rows the caller still holds, from the real clock. Rows locked right now
-- are skipped (see 0002).
CREATE OR REPLACE FUNCTION renew_leases(p_instance_id uuid, p_event_work_ids uuid[], p_lease_seconds int)
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
        SET lease_expiry = clock_timestamp() + make_interval(secs => p_lease_seconds)
        FROM mine
        WHERE pe.event_work_id = mine.event_work_id
        RETURNING 1)
    SELECT count(*)::int FROM renewed;
$$;

-- Graceful exit: gives back every lease of the instance (refunding exactly the bumps of rows no
-- handler saw: the daemon releases the rows its handlers saw first), then removes it. Rows still
-- locked (a transaction rolling back) are skipped: they belong to a dead holder once the
-- instance row is gone and are taken over. Never waits long for a lock.
CREATE OR REPLACE FUNCTION deregister_instance(p_instance_id uuid)
RETURNS int
LANGUAGE sql
SET lock_timeout = '2s'
AS $$
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
        RETURNING 1),
    gone AS (
        DELETE FROM wh_service_instances si WHERE si.instance_id = p_instance_id RETURNING 1)
    SELECT count(*)::int FROM released;
$$;

-- Redefined from its 0003 text; only the fence changes.
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
          -- 0004: a caller that names its instance moves only rows leased to it (before, also
          -- unleased rows: a fenced-out worker could dead-letter a row a rebuild had taken back).
          AND (p_instance_id IS NULL OR pe.instance_id = p_instance_id)
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
