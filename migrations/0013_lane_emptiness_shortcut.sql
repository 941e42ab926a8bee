-- vantage schema, part 13: a completion proves its lanes are not empty without walking what it
-- just deleted (issue 9).
--
-- Deleted rows, as in 0007, with a shortcut for the common case: a lane whose rows were
-- completed up to some version usually has rows after it, and finding one of those (an index
-- range that starts after the deleted prefix) proves the lane is not empty without walking the
-- prefix the deleting transaction itself just deleted (those index entries cannot be skipped
-- until it commits: about one buffer per deleted row, for every lane of every completion).
-- Only when no later row exists does the full emptiness check of 0007 run. Same locks, same
-- statements, same snapshots: the lane goes exactly when 0007 removed it.
CREATE OR REPLACE FUNCTION wh_perspective_lanes_after_delete() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_streams uuid[];
    v_names   text[];
    v_last    int[];
BEGIN
    SELECT array_agg(l.stream_id), array_agg(l.perspective_name), array_agg(l.last_version)
    INTO v_streams, v_names, v_last
    FROM (
        SELECT l.stream_id, l.perspective_name, o.last_version
        FROM wh_perspective_lanes l
        JOIN (SELECT o.stream_id, o.perspective_name, max(o.stream_version) AS last_version
              FROM old_rows o
              GROUP BY o.stream_id, o.perspective_name) o
          ON o.stream_id = l.stream_id AND o.perspective_name = l.perspective_name
        ORDER BY l.stream_id, l.perspective_name
        FOR UPDATE OF l
    ) l;
    IF v_streams IS NULL THEN
        RETURN NULL;
    END IF;

    DELETE FROM wh_perspective_lanes l
    USING unnest(v_streams, v_names, v_last) AS k(sid, pname, last_version)
    WHERE l.stream_id = k.sid AND l.perspective_name = k.pname
      AND CASE
            WHEN EXISTS (SELECT 1 FROM wh_perspective_events pe
                         WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid
                           AND pe.stream_version > k.last_version)
            THEN false
            ELSE NOT EXISTS (SELECT 1 FROM wh_perspective_events pe
                             WHERE pe.perspective_name = k.pname AND pe.stream_id = k.sid)
          END;

    UPDATE wh_perspective_lanes l
    SET due_at = now()
    FROM unnest(v_streams, v_names) AS k(sid, pname)
    WHERE l.stream_id = k.sid AND l.perspective_name = k.pname
      AND l.due_at > now();
    RETURN NULL;
END
$$;
