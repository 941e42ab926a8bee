-- vantage baseline, part 2 of 9: producers, the fan-out and the registry.
--
-- A producer appends with append_events(stream, expected_version, events) or a plain INSERT
-- into wh_event_store; either way the fan-out trigger, in the producer's own transaction,
-- inserts one work row per subscribed perspective (wh_perspective_events; its insert trigger
-- adds the lanes' wake-ups, part 3) and notifies channel vantage_work.
--
-- The producer rule (part 1): everything a producer's transaction writes is a new row. It
-- reads the registry without locking it, takes no lock vantage takes (the per-stream advisory
-- lock below serialises appenders of one stream only), and updates nothing, so its latency and
-- its outcome never depend on a drain, a failing lane, a rebuild or an operator.

-- Appends to one stream, checking the expected version (NULL = any): a mismatch raises
-- 40001 naming the stream and both versions.
CREATE FUNCTION append_events(p_stream_id uuid, p_expected_version integer, p_events jsonb)
 RETURNS TABLE(global_position bigint, event_id uuid, stream_version integer)
 LANGUAGE plpgsql
AS $$
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

-- One work row per (event, subscribed perspective), and one notification per statement.
CREATE FUNCTION wh_event_store_fan_out()
 RETURNS trigger
 LANGUAGE plpgsql
AS $$
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

-- Daemons upsert their configured perspectives at start; an unchanged row is not written.
CREATE FUNCTION register_perspective(p_perspective_name text, p_event_types text[])
 RETURNS void
 LANGUAGE sql
AS $$
    INSERT INTO wh_perspectives (perspective_name, event_types)
    VALUES (p_perspective_name, p_event_types)
    ON CONFLICT (perspective_name) DO UPDATE
        SET event_types = EXCLUDED.event_types,
            updated_at = now()
        WHERE wh_perspectives.event_types IS DISTINCT FROM EXCLUDED.event_types;
$$;
