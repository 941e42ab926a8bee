-- vantage schema, part 10: the pre-filter moves a claim's exhausted rows in one statement.
--
-- Each exhausted row used to be one move_to_dead_letters call: a round trip, a lookup, the
-- delete, the dead letter, the history record and the lane index's trigger, per row, so
-- dead-lettering N rows cost five times applying them. The move is now written once, set-wise
-- (wh_move_to_dead_letters), and both entry points use it:
-- * move_many_to_dead_letters(instance, ids, reason, error texts): the daemon's, for many rows
--   leased to it; returns one (source id, dead letter id) per row moved; a row not returned was
--   already gone (completed, moved, or no longer ours);
-- * move_to_dead_letters (the contract's, one row): redefined from its 0004 text on top of it,
--   same arguments and behaviour (a NULL instance moves the row whoever holds it).
-- The rules are 0004's: fenced on the instance when one is named, refused (55P03) while a
-- perspective of the rows is being rebuilt, a requeued message's dead letter reopened instead
-- of a second one, the row's last_error carried into the error text, one Exhausted history
-- record per move.

CREATE FUNCTION wh_move_to_dead_letters(
    p_instance_id uuid,
    p_source_ids uuid[],
    p_dead_letter_ids uuid[],
    p_failure_reason text,
    p_error_texts text[])
RETURNS TABLE (source_id uuid, dead_letter_id uuid)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_perspective text;
BEGIN
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
        SELECT g.id, g.dead_letter_id, g.error_text
        FROM unnest(p_source_ids, p_dead_letter_ids, p_error_texts)
             AS g(id, dead_letter_id, error_text)),
    src AS (
        -- (by the primary key: a join to the ids can be planned as a scan of the queue)
        DELETE FROM wh_perspective_events pe
        WHERE pe.event_work_id = ANY (p_source_ids)
          AND (p_instance_id IS NULL OR pe.instance_id = p_instance_id)
        RETURNING pe.*),
    dl AS (
        INSERT INTO wh_dead_letters AS d
            (dead_letter_id, source_table, source_id, stream_id, event_id, global_position,
             stream_version, event_type, perspective_name, failure_reason, error_text,
             attempts_when_dlq, failures_when_dlq, dead_lettered_at, dead_lettered_by,
             status, status_changed_at)
        SELECT coalesce(given.dead_letter_id, gen_random_uuid()), 'wh_perspective_events',
               src.event_work_id, src.stream_id, src.event_id, src.global_position,
               src.stream_version, ev.event_type, src.perspective_name, p_failure_reason,
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
        SELECT dl.dead_letter_id, 'Exhausted',
               coalesce('instance ' || p_instance_id::text, 'vantage'),
               p_failure_reason || coalesce(': ' || dl.error_text, '')
        FROM dl)
    SELECT dl.source_id, dl.dead_letter_id FROM dl;
END
$$;

CREATE FUNCTION move_many_to_dead_letters(
    p_instance_id uuid,
    p_source_ids uuid[],
    p_failure_reason text,
    p_error_texts text[])
RETURNS TABLE (source_id uuid, dead_letter_id uuid)
LANGUAGE plpgsql AS $$
BEGIN
    IF p_instance_id IS NULL THEN
        RAISE EXCEPTION 'move_many_to_dead_letters: an instance is required' USING ERRCODE = '22004';
    END IF;
    RETURN QUERY
    SELECT m.source_id, m.dead_letter_id
    FROM wh_move_to_dead_letters(p_instance_id, p_source_ids,
                                 array_fill(NULL::uuid, ARRAY[cardinality(p_source_ids)]),
                                 p_failure_reason, p_error_texts) m;
END
$$;

CREATE OR REPLACE FUNCTION move_to_dead_letters(
    p_dead_letter_id uuid,
    p_source_table text,
    p_source_id uuid,
    p_failure_reason text,
    p_error_text text,
    p_instance_id uuid)
RETURNS uuid
LANGUAGE plpgsql AS $$
BEGIN
    IF p_source_table IS DISTINCT FROM 'wh_perspective_events' THEN
        RAISE EXCEPTION 'move_to_dead_letters: unknown source table %', coalesce(p_source_table, 'NULL')
            USING ERRCODE = '22023';
    END IF;
    RETURN (SELECT m.dead_letter_id
            FROM wh_move_to_dead_letters(p_instance_id, ARRAY[p_source_id],
                                         ARRAY[p_dead_letter_id], p_failure_reason,
                                         ARRAY[p_error_text]) m);
END
$$;
