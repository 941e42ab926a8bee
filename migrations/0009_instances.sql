-- vantage baseline, part 9 of 9: daemon instances.
--
-- Each daemon process registers and heartbeats (heartbeat, an upsert). One silent for
-- orphans.stale_after is dead: cleanup_dead_instances removes it, and the instance-gone
-- trigger (part 3) makes the lanes it held due now, so the next claim takes them over
-- (attempts + 1) without waiting for their leases to expire. A graceful shutdown deregisters:
-- the row goes first (a claim in progress holds it KEY SHARE, so none can lease anything for
-- this instance afterwards), then the leases still held are given back, refunded when the
-- claim that took them bumped; rows locked elsewhere are skipped (their batch is settling them).

-- Registers or refreshes an instance; true when it was already registered.
CREATE FUNCTION heartbeat(p_instance_id uuid, p_service_name text DEFAULT 'vantage'::text, p_host_name text DEFAULT ''::text, p_process_id integer DEFAULT 0, p_version text DEFAULT ''::text)
 RETURNS boolean
 LANGUAGE sql
AS $$
    INSERT INTO wh_service_instances AS si
        (instance_id, service_name, host_name, process_id, version)
    VALUES (p_instance_id, p_service_name, p_host_name, p_process_id, p_version)
    ON CONFLICT (instance_id) DO UPDATE SET last_heartbeat_at = now()
    RETURNING (xmax <> 0);
$$;

-- Removes instances silent for longer than p_stale_seconds; returns their ids.
CREATE FUNCTION cleanup_dead_instances(p_stale_seconds double precision)
 RETURNS SETOF uuid
 LANGUAGE sql
 SET lock_timeout TO '5s'
AS $$
    DELETE FROM wh_service_instances si
    WHERE si.last_heartbeat_at < now() - make_interval(secs => p_stale_seconds)
    RETURNING si.instance_id;
$$;

-- Deregisters an instance and gives back its leases (bounded: 2 s of lock waits at most).
CREATE FUNCTION deregister_instance(p_instance_id uuid)
 RETURNS integer
 LANGUAGE plpgsql
 SET lock_timeout TO '2s'
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
