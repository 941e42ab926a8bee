-- vantage baseline, part 6 of 9: dead letters.
--
-- A row claimed more than max_perspective_event_attempts times is moved by the daemon's DLQ
-- pre-filter (before deserialization) with reason MaxAttemptsExceeded; a permanent failure is
-- moved at once (PermanentFailure). The move is atomic and idempotent: the work row goes and
-- its dead letter comes in one statement, and a row already gone moves nothing. The retry budget
-- belongs to the message: a requeued event exhausted again reopens its dead letter.
-- Operator actions (requeue, resolve after a replay, purge) are compare-and-sets on
-- status = 'exhausted', each with its history record, so two operators never both act. Every
-- function here holds the perspective's rebuild lock shared (refusing during a rebuild) and is
-- bounded by lock_timeout.

-- The one dead-letter move: deletes the work rows (fenced on the caller when it names one)
-- and inserts or reopens their dead letters, fingerprinting each distinct error once, with an
-- Exhausted history record each, in one statement. Refuses (55P03) during a rebuild.
CREATE FUNCTION wh_move_to_dead_letters(p_instance_id uuid, p_source_ids uuid[], p_dead_letter_ids uuid[], p_failure_reason text, p_error_texts text[])
 RETURNS TABLE(source_id uuid, dead_letter_id uuid)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
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

-- The contract's single move: NULL when the row is already gone; raises for an unknown source.
CREATE FUNCTION move_to_dead_letters(p_dead_letter_id uuid, p_source_table text, p_source_id uuid, p_failure_reason text, p_error_text text, p_instance_id uuid)
 RETURNS uuid
 LANGUAGE plpgsql
AS $$
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

-- The daemon's batched move (always fenced on the caller).
CREATE FUNCTION move_many_to_dead_letters(p_instance_id uuid, p_source_ids uuid[], p_failure_reason text, p_error_texts text[])
 RETURNS TABLE(source_id uuid, dead_letter_id uuid)
 LANGUAGE plpgsql
AS $$
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

-- Hands a dead letter back to the daemon (attempts 0, due now), only if still exhausted.
CREATE FUNCTION requeue_dead_letter(p_dead_letter_id uuid, p_actor text)
 RETURNS boolean
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
#variable_conflict use_column
DECLARE
    v_dl       wh_dead_letters%ROWTYPE;
    v_inserted bigint;
BEGIN
    SELECT d.* INTO v_dl FROM wh_dead_letters d WHERE d.dead_letter_id = p_dead_letter_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM wh_lock_perspective_shared(v_dl.perspective_name);

    UPDATE wh_dead_letters d
    SET status = 'requeued', status_changed_at = now()
    WHERE d.dead_letter_id = p_dead_letter_id AND d.status = 'exhausted';
    IF NOT FOUND THEN
        RETURN false;
    END IF;

    INSERT INTO wh_perspective_events
        (event_work_id, stream_id, event_id, global_position, stream_version, perspective_name,
         attempts, failures, scheduled_for)
    VALUES (v_dl.source_id, v_dl.stream_id, v_dl.event_id, v_dl.global_position,
            v_dl.stream_version, v_dl.perspective_name, 0, 0, now())
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS v_inserted = ROW_COUNT;
    IF v_inserted = 0 THEN
        -- Undoes the compare-and-set above with the rest of the statement.
        RAISE EXCEPTION 'dead letter % is already queued: perspective "%" has a work row for event % (position %); requeuing it would apply it twice',
            p_dead_letter_id, v_dl.perspective_name, v_dl.event_id, v_dl.global_position
            USING ERRCODE = '23505';
    END IF;

    INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
    VALUES (p_dead_letter_id, 'Requeued', p_actor, NULL);
    PERFORM pg_notify('vantage_work', '');
    RETURN true;
END
$$;

-- A replay that succeeded: resolved, with its history record (compare-and-set).
CREATE FUNCTION resolve_dead_letter(p_dead_letter_id uuid, p_actor text, p_detail text DEFAULT NULL::text)
 RETURNS boolean
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
#variable_conflict use_column
DECLARE
    v_perspective text;
    v_done        boolean;
BEGIN
    SELECT d.perspective_name INTO v_perspective
    FROM wh_dead_letters d
    WHERE d.dead_letter_id = p_dead_letter_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM wh_lock_perspective_shared(v_perspective);

    WITH dl AS (
        UPDATE wh_dead_letters d
        SET status = 'resolved', status_changed_at = now()
        WHERE d.dead_letter_id = p_dead_letter_id AND d.status = 'exhausted'
        RETURNING d.dead_letter_id),
    hist AS (
        INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
        SELECT dl.dead_letter_id, 'ReplaySucceeded', p_actor, p_detail FROM dl)
    SELECT EXISTS (SELECT 1 FROM dl) INTO v_done;
    RETURN v_done;
END
$$;

-- Purged: terminal, the history is kept (compare-and-set).
CREATE FUNCTION purge_dead_letter(p_dead_letter_id uuid, p_actor text, p_detail text DEFAULT NULL::text)
 RETURNS boolean
 LANGUAGE sql
 SET lock_timeout TO '5s'
AS $$
    WITH dl AS (
        UPDATE wh_dead_letters d
        SET status = 'purged', status_changed_at = now()
        WHERE d.dead_letter_id = p_dead_letter_id AND d.status = 'exhausted'
        RETURNING d.dead_letter_id),
    hist AS (
        INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
        SELECT dl.dead_letter_id, 'Purged', p_actor, p_detail FROM dl)
    SELECT EXISTS (SELECT 1 FROM dl);
$$;

-- A replay that failed again: stays exhausted, the error goes into the history.
CREATE FUNCTION record_dead_letter_replay_failure(p_dead_letter_id uuid, p_actor text, p_error text)
 RETURNS boolean
 LANGUAGE sql
 SET lock_timeout TO '5s'
AS $$
    WITH dl AS (
        UPDATE wh_dead_letters d
        SET status_changed_at = d.status_changed_at
        WHERE d.dead_letter_id = p_dead_letter_id AND d.status = 'exhausted'
        RETURNING d.dead_letter_id),
    hist AS (
        INSERT INTO wh_dead_letter_history (dead_letter_id, kind, actor, detail)
        SELECT dl.dead_letter_id, 'ReplayFailed', p_actor, p_error FROM dl)
    SELECT EXISTS (SELECT 1 FROM dl);
$$;

-- The history is an audit trail: append-only in the database, not only by convention.
CREATE FUNCTION wh_dead_letter_history_append_only()
 RETURNS trigger
 LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'wh_dead_letter_history is append-only (% refused)', TG_OP
        USING ERRCODE = '55000';
END
$$;

CREATE TRIGGER wh_dead_letter_history_append_only
    BEFORE UPDATE OR DELETE ON wh_dead_letter_history
    FOR EACH ROW EXECUTE FUNCTION wh_dead_letter_history_append_only();

-- Any writer but the move (an operator's INSERT, a test) gets the fingerprint computed; an
-- update that changes what it is computed from, without supplying a new one, recomputes it.
CREATE FUNCTION wh_dead_letters_fingerprint()
 RETURNS trigger
 LANGUAGE plpgsql
AS $$
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
