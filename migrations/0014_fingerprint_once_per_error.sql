-- vantage schema, part 14: a dead-letter move computes each distinct error's fingerprint once.
--
-- error_fingerprint (0008) was a stored generated column: every dead letter ran the masking
-- (ten regular expressions) for itself, ~0.1 ms a row, so moving a claim's 500 exhausted rows
-- spent most of its time fingerprinting the same few error texts again and again, and
-- dead-lettering N rows cost 3-4 times applying them (target: 2). The column is now a plain
-- one, kept by a trigger that fills it only when a writer did not; wh_move_to_dead_letters
-- fingerprints each distinct (perspective, event type, error text) of a move once and supplies
-- it. The value is the same function of the same columns as before: nothing already stored
-- changes, and the open-fingerprint index stays as it is.

ALTER TABLE wh_dead_letters ALTER COLUMN error_fingerprint DROP EXPRESSION;

-- Any other writer (an operator's INSERT, a test) gets the fingerprint computed, as before; an
-- update that changes what it is computed from, without supplying a new one, recomputes it.
CREATE FUNCTION wh_dead_letters_fingerprint() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.error_fingerprint IS NULL
       OR (TG_OP = 'UPDATE'
           AND NEW.error_fingerprint IS NOT DISTINCT FROM OLD.error_fingerprint
           AND (NEW.perspective_name, NEW.event_type, NEW.error_text)
               IS DISTINCT FROM (OLD.perspective_name, OLD.event_type, OLD.error_text)) THEN
        NEW.error_fingerprint :=
            wh_error_fingerprint(NEW.perspective_name, NEW.event_type, NEW.error_text);
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER wh_dead_letters_fingerprint
    BEFORE INSERT OR UPDATE ON wh_dead_letters
    FOR EACH ROW EXECUTE FUNCTION wh_dead_letters_fingerprint();

-- As in 0010, with the fingerprints computed once per distinct error and supplied.
CREATE OR REPLACE FUNCTION wh_move_to_dead_letters(
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
    moved AS (
        SELECT coalesce(given.dead_letter_id, gen_random_uuid()) AS new_id, src.event_work_id,
               src.stream_id, src.event_id, src.global_position, src.stream_version,
               ev.event_type, src.perspective_name,
               nullif(concat_ws(E'\n', given.error_text,
                                CASE WHEN src.last_error IS NOT NULL
                                     THEN 'last error: ' || src.last_error END), '') AS error_text,
               src.attempts, src.failures
        FROM src
        JOIN given ON given.id = src.event_work_id
        LEFT JOIN wh_event_store ev ON ev.global_position = src.global_position),
    -- (a NULL type or text fingerprints as ''; error_text is never '', so the join keys below
    -- only ever join rows whose fingerprints are equal. MATERIALIZED: inlined, the planner
    -- would evaluate the fingerprint once per joined row again.)
    fp AS MATERIALIZED (
        SELECT d.perspective_name, d.event_type, d.error_text,
               wh_error_fingerprint(d.perspective_name, d.event_type, d.error_text) AS fingerprint
        FROM (SELECT DISTINCT m.perspective_name, coalesce(m.event_type, '') AS event_type,
                     coalesce(m.error_text, '') AS error_text
              FROM moved m) d),
    dl AS (
        INSERT INTO wh_dead_letters AS d
            (dead_letter_id, source_table, source_id, stream_id, event_id, global_position,
             stream_version, event_type, perspective_name, failure_reason, error_text,
             attempts_when_dlq, failures_when_dlq, dead_lettered_at, dead_lettered_by,
             status, status_changed_at, error_fingerprint)
        SELECT m.new_id, 'wh_perspective_events', m.event_work_id, m.stream_id, m.event_id,
               m.global_position, m.stream_version, m.event_type, m.perspective_name,
               p_failure_reason, m.error_text, m.attempts, m.failures, now(), p_instance_id,
               'exhausted', now(), fp.fingerprint
        FROM moved m
        JOIN fp ON fp.perspective_name = m.perspective_name
               AND fp.event_type = coalesce(m.event_type, '')
               AND fp.error_text = coalesce(m.error_text, '')
        ON CONFLICT (source_table, perspective_name, event_id) WHERE status <> 'purged' DO UPDATE
            SET source_id = EXCLUDED.source_id,
                failure_reason = EXCLUDED.failure_reason,
                error_text = EXCLUDED.error_text,
                error_fingerprint = EXCLUDED.error_fingerprint,
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
