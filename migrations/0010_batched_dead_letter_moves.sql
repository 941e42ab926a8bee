-- vantage schema, part 10: the pre-filter moves a claim's exhausted rows in one statement.
--
-- Each exhausted row used to be one move_to_dead_letters call: a round trip, a lookup, the
-- delete, the dead letter, the history record and the lane index's trigger, per row, so
-- dead-lettering N rows cost five times applying them. move_many_to_dead_letters does the same
-- for many rows of one caller set-wise: the same fencing (only rows leased to p_instance_id),
-- the same rebuild lock, the same reopening of a requeued message's dead letter, the same
-- error text and history. Returns one (source id, dead letter id) per row moved; a row not
-- returned was already gone (completed, moved, or no longer ours).

CREATE FUNCTION move_many_to_dead_letters(
    p_instance_id uuid,
    p_source_ids uuid[],
    p_failure_reason text,
    p_error_texts text[])
RETURNS TABLE (source_id uuid, dead_letter_id uuid)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_perspective text;
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'move_many_to_dead_letters: an instance is required' USING ERRCODE = '22004';
    END IF;
    -- As move_to_dead_letters: refused (55P03) while a perspective of these rows is rebuilt.
    FOR v_perspective IN
        SELECT DISTINCT pe.perspective_name
        FROM wh_perspective_events pe
        WHERE pe.event_work_id = ANY (p_source_ids)
        ORDER BY 1
    LOOP
        PERFORM wh_lock_perspective_shared(v_perspective);
    END LOOP;

    RETURN QUERY
    WITH given AS (
        SELECT g.id, g.error_text
        FROM unnest(p_source_ids, p_error_texts) AS g(id, error_text)),
    src AS (
        -- (by the primary key: a join to the ids can be planned as a scan of the queue)
        DELETE FROM wh_perspective_events pe
        WHERE pe.event_work_id = ANY (p_source_ids)
          AND pe.instance_id = p_instance_id
        RETURNING pe.*),
    dl AS (
        INSERT INTO wh_dead_letters AS d
            (dead_letter_id, source_table, source_id, stream_id, event_id, global_position,
             stream_version, event_type, perspective_name, failure_reason, error_text,
             attempts_when_dlq, failures_when_dlq, dead_lettered_at, dead_lettered_by,
             status, status_changed_at)
        SELECT gen_random_uuid(), 'wh_perspective_events', src.event_work_id,
               src.stream_id, src.event_id, src.global_position, src.stream_version,
               ev.event_type, src.perspective_name, p_failure_reason,
               nullif(concat_ws(E'\n', given.error_text,
                                CASE WHEN src.last_error IS NOT NULL
                                     THEN 'last error: ' || src.last_error END), ''),
               src.attempts, src.failures, now(), p_instance_id, 'exhausted', now()
        FROM src
        JOIN given ON given.id = src.event_work_id
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
        RETURNING d.source_id, d.dead_letter_id, d.error_text),
    hist AS (
        INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
        SELECT dl.dead_letter_id, 'Exhausted', 'instance ' || p_instance_id::text,
               p_failure_reason || coalesce(': ' || dl.error_text, '')
        FROM dl)
    SELECT dl.source_id, dl.dead_letter_id FROM dl;
END
$$;
