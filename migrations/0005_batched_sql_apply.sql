-- vantage schema, part 5: SQL perspectives applied set-wise (issue 9).
--
-- The daemon's optimistic pass used to send one statement per event: N + 5 round trips for a
-- batch of N. apply_perspective_statements runs the statements of many events in one call, in
-- the order given (the caller keeps each lane in stream_version order), each with the seven
-- parameters SQL perspectives are bound (SPEC §3.1: $1 data, $2 stream_id, $3 event_id,
-- $4 event_type, $5 global_position, $6 stream_version, $7 metadata). It runs inside the
-- batch's transaction, so the effects still commit with the completion of the work rows; if
-- any statement fails, the whole call fails and the daemon applies the batch again one event
-- per savepoint, which finds and charges the failing event.
--
-- p_statements holds each distinct statement once; p_statement[i] is the 1-based index of the
-- statement for event i.
CREATE FUNCTION apply_perspective_statements(
    p_statements text[],
    p_statement int[],
    p_data jsonb[],
    p_stream_id uuid[],
    p_event_id uuid[],
    p_event_type text[],
    p_global_position bigint[],
    p_stream_version int[],
    p_metadata jsonb[])
RETURNS int
LANGUAGE plpgsql AS $$
DECLARE
    v_n int := coalesce(cardinality(p_statement), 0);
BEGIN
    FOR i IN 1 .. v_n LOOP
        EXECUTE p_statements[p_statement[i]]
            USING p_data[i], p_stream_id[i], p_event_id[i], p_event_type[i],
                  p_global_position[i], p_stream_version[i], p_metadata[i];
    END LOOP;
    RETURN v_n;
END
$$;
