-- vantage 0019: a batch of SQL perspectives' statements applied and completed as a statement of
-- its own, all or nothing (wh_apply_and_complete_perspective_events_all_or_nothing, new).
--
-- The daemon applied every batch in an explicit transaction: BEGIN, the statement and lock
-- timeouts with the backend's pid, apply_and_complete_perspective_events, COMMIT; four round
-- trips where the call alone would do (issue 18: the trigger-free limit needs two per batch,
-- claim included, and the cores sat idle while the others travelled). Run on its own
-- (autocommit), the call is already one transaction, but a completion that finds a row no
-- longer ours must undo the statements' writes, which the caller can no longer do once the call
-- has returned. This function raises instead (SQLSTATE VL001), so the whole statement rolls
-- back: nothing of the batch is kept, and the daemon gives the rows back as after any lost lease.
-- apply_and_complete_perspective_events (contract) is unchanged; this function's name contains
-- it, so whoever looks for the daemon's batch in pg_stat_activity by that name still finds it.
CREATE FUNCTION wh_apply_and_complete_perspective_events_all_or_nothing(p_instance_id uuid, p_event_work_ids uuid[], p_statements text[], p_statement integer[], p_data jsonb[], p_stream_id uuid[], p_event_id uuid[], p_event_type text[], p_global_position bigint[], p_stream_version integer[], p_metadata jsonb[])
 RETURNS integer
 LANGUAGE plpgsql
AS $$
DECLARE
    v_want int := coalesce(cardinality(p_event_work_ids), 0);
    v_done int;
BEGIN
    v_done := apply_and_complete_perspective_events(p_instance_id, p_event_work_ids, p_statements,
                                                    p_statement, p_data, p_stream_id, p_event_id,
                                                    p_event_type, p_global_position,
                                                    p_stream_version, p_metadata);
    IF v_done < v_want THEN
        RAISE EXCEPTION 'wh_apply_and_complete_perspective_events_all_or_nothing: % of % rows are no longer leased to instance %; the batch was rolled back',
            v_want - v_done, v_want, p_instance_id
            USING ERRCODE = 'VL001';
    END IF;
    RETURN v_done;
END
$$;
