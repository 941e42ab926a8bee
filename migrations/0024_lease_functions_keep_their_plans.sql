-- vantage 0024: the lease functions called once per row or per pass are PL/pgSQL, so each
-- session plans their statements once instead of at every call
-- (record_perspective_event_failure, note_perspective_event_error, complete_perspective_events,
-- release_started_leases, release_unstarted_leases, renew_leases; redefined, bodies unchanged).
--
-- Found by `vantage soak` (RELIABILITY.md): after `vantage dlq requeue --all` put 7 500 dead
-- letters back, half of them still poison, their retries (10 each) took two minutes and held
-- the other perspectives' lag above a second. Measured on its own (3 000 to 20 000 one-row lanes
-- of poison, 10 attempts, 1 ms backoff, one daemon): a failed attempt cost three healthy
-- applies, and two thirds of the database's time went to record_perspective_event_failure,
-- 217 µs a call, nearly all of it spent parsing and planning its one-row UPDATE. A SQL-language
-- function that PostgreSQL cannot inline (these all carry SET clauses: lock_timeout and the
-- pinned search_path) is parsed and planned again at every call; a PL/pgSQL function keeps
-- its statements' plans for the session.
--
-- Contract: signatures, results, fencing and locking are unchanged; each body is the same
-- statement, its result read with INTO. search_path is pinned again by the migration runner.

CREATE OR REPLACE FUNCTION record_perspective_event_failure(p_instance_id uuid, p_event_work_id uuid, p_error text, p_retry_after_seconds integer, p_retry_after interval DEFAULT NULL::interval)
 RETURNS boolean
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
DECLARE
    v_failed boolean;
BEGIN
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
    SELECT EXISTS (SELECT 1 FROM failed) INTO v_failed;
    RETURN v_failed;
END
$$;

CREATE OR REPLACE FUNCTION note_perspective_event_error(p_instance_id uuid, p_event_work_id uuid, p_error text)
 RETURNS boolean
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
DECLARE
    v_noted boolean;
BEGIN
    WITH noted AS (
        UPDATE wh_perspective_events pe
        SET last_error = p_error
        WHERE pe.event_work_id = p_event_work_id
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT EXISTS (SELECT 1 FROM noted) INTO v_noted;
    RETURN v_noted;
END
$$;

CREATE OR REPLACE FUNCTION complete_perspective_events(p_instance_id uuid, p_event_work_ids uuid[])
 RETURNS integer
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
DECLARE
    v_done int;
BEGIN
    WITH done AS (
        DELETE FROM wh_perspective_events pe
        WHERE pe.event_work_id = ANY (p_event_work_ids)
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT count(*)::int INTO v_done FROM done;
    RETURN v_done;
END
$$;

CREATE OR REPLACE FUNCTION release_started_leases(p_instance_id uuid, p_event_work_ids uuid[])
 RETURNS integer
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
DECLARE
    v_released int;
BEGIN
    WITH released AS (
        UPDATE wh_perspective_events pe
        SET instance_id  = NULL,
            lease_expiry = NULL,
            refundable   = false
        WHERE pe.event_work_id = ANY (p_event_work_ids)
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT count(*)::int INTO v_released FROM released;
    RETURN v_released;
END
$$;

CREATE OR REPLACE FUNCTION release_unstarted_leases(p_instance_id uuid, p_event_work_ids uuid[])
 RETURNS integer
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
DECLARE
    v_released int;
BEGIN
    WITH released AS (
        UPDATE wh_perspective_events pe
        SET instance_id  = NULL,
            lease_expiry = NULL,
            attempts     = greatest(pe.attempts - CASE WHEN pe.refundable THEN 1 ELSE 0 END, 0),
            refundable   = false
        WHERE pe.event_work_id = ANY (p_event_work_ids)
          AND pe.instance_id = p_instance_id
        RETURNING 1)
    SELECT count(*)::int INTO v_released FROM released;
    RETURN v_released;
END
$$;

CREATE OR REPLACE FUNCTION renew_leases(p_instance_id uuid, p_event_work_ids uuid[], p_lease_seconds integer)
 RETURNS integer
 LANGUAGE plpgsql
AS $$
DECLARE
    v_renewed int;
BEGIN
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
    SELECT count(*)::int INTO v_renewed FROM renewed;
    RETURN v_renewed;
END
$$;
