-- vantage baseline, part 5 of 9: settling claimed rows.
--
-- The lease holder's state changes, each fenced on instance_id (a worker whose lease was taken
-- over can never complete, fail, release, note or renew the new owner's row) and each bounded
-- (lock_timeout: the only waits are for a claim holding a lane, part 3, or for the same row's
-- other vantage writer). The lane triggers of part 3 keep the lane index right: a completion
-- makes the next row the head, due now; a failure parks the head until its backoff; a release
-- makes it due now.

-- Applied: deletes the caller's rows; returns how many were still its own (fewer means a
-- lease was lost, and the caller's transaction must roll back).
CREATE FUNCTION complete_perspective_events(p_instance_id uuid, p_event_work_ids uuid[])
 RETURNS integer
 LANGUAGE sql
 SET lock_timeout TO '5s'
AS $$
    WITH done AS (
        DELETE FROM wh_perspective_events pe
        WHERE pe.event_work_id = ANY (p_event_work_ids)
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT count(*)::int FROM done;
$$;

-- An apply failure (seed 000): failures + 1, last_error, lease cleared, parked until the
-- backoff has passed. Only the failing row is charged; the next claim is a takeover (+1).
CREATE FUNCTION record_perspective_event_failure(p_instance_id uuid, p_event_work_id uuid, p_error text, p_retry_after_seconds integer, p_retry_after interval DEFAULT NULL::interval)
 RETURNS boolean
 LANGUAGE sql
 SET lock_timeout TO '5s'
AS $$
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

-- Given back without a handler having seen them: the claim's bump is refunded exactly.
CREATE FUNCTION release_unstarted_leases(p_instance_id uuid, p_event_work_ids uuid[])
 RETURNS integer
 LANGUAGE sql
 SET lock_timeout TO '5s'
AS $$
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

-- Given back after a handler saw them: no refund (the attempt was used).
CREATE FUNCTION release_started_leases(p_instance_id uuid, p_event_work_ids uuid[])
 RETURNS integer
 LANGUAGE sql
 SET lock_timeout TO '5s'
AS $$
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

-- Extends the caller's leases (rows it still holds; a row locked elsewhere is skipped and
-- renewed next time).
CREATE FUNCTION renew_leases(p_instance_id uuid, p_event_work_ids uuid[], p_lease_seconds integer)
 RETURNS integer
 LANGUAGE sql
AS $$
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

-- Keeps an error as last_error without charging it (a lock conflict, a lost database).
CREATE FUNCTION note_perspective_event_error(p_instance_id uuid, p_event_work_id uuid, p_error text)
 RETURNS boolean
 LANGUAGE sql
 SET lock_timeout TO '5s'
AS $$
    WITH noted AS (
        UPDATE wh_perspective_events pe
        SET last_error = p_error
        WHERE pe.event_work_id = p_event_work_id
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT EXISTS (SELECT 1 FROM noted);
$$;
