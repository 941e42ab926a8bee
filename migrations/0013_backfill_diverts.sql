-- vantage 0013: a poison event in a new version's history never wedges its backfill, and what
-- a building version is behind is known without reading the history.
--
-- 0012 applied a backfill batch in one statement; if one event's statement failed, the batch
-- failed, and so did every retry: the version stayed 'building' forever, behind one event. Now
-- a batch that cannot be applied directly is diverted: its events become ordinary work rows
-- of the version (p_divert), so the drain takes them once the backfill is done, with attempts,
-- backoff, the head-of-line gate and dead letters exactly as for any perspective.
--
-- Order. Claims skip a building version, so direct applies all happen before any claim; a
-- lane's events must then reach the version in stream order. An event is therefore diverted
-- too, instead of applied directly, when its stream already has a work row of the version
-- below it (an earlier diverted event): the claim applies that lane head first. Work rows the
-- fan-out wrote for events after the registration sit above the history, so they divert
-- nothing. Diverted rows are inserted like the fan-out's (the lane wake-up trigger sees them).

DROP FUNCTION backfill_perspective_version(text, integer, integer);

CREATE FUNCTION backfill_perspective_version(p_perspective_name text, p_version integer, p_max integer DEFAULT 1000, p_divert boolean DEFAULT false)
 RETURNS TABLE(outcome text, applied integer, backfill_position bigint, backfill_target bigint, diverted integer)
 LANGUAGE plpgsql
 SET lock_timeout TO '5s'
AS $$
#variable_conflict use_column
DECLARE
    v        wh_perspective_versions;
    v_last   bigint;
    v_n      int := 0;
    v_moved  int := 0;
    v_data   jsonb[];
    v_stream uuid[];
    v_id     uuid[];
    v_type   text[];
    v_pos    bigint[];
    v_ver    int[];
    v_meta   jsonb[];
BEGIN
    SELECT * INTO v FROM wh_perspective_versions x
    WHERE x.perspective_name = p_perspective_name AND x.version = p_version
    FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'busy'::text, 0, NULL::bigint, NULL::bigint, 0;
        RETURN;
    END IF;
    IF v.state <> 'building' THEN
        RETURN QUERY SELECT v.state, 0, v.backfill_position, v.backfill_target, 0;
        RETURN;
    END IF;
    IF v.backfill_horizon IS NULL THEN
        -- (taken after the registration committed: later transactions see the registry row)
        v.backfill_horizon := pg_snapshot_xmax(pg_current_snapshot());
        v.backfill_target := (SELECT coalesce(max(e.global_position), 0) FROM wh_event_store e);
        UPDATE wh_perspective_versions x
        SET backfill_horizon = v.backfill_horizon, backfill_target = v.backfill_target,
            backfill_started_at = now()
        WHERE x.perspective_name = p_perspective_name AND x.version = p_version;
    END IF;
    IF NOT wh_horizon_passed(v.backfill_horizon) THEN
        RETURN QUERY SELECT 'waiting'::text, 0, v.backfill_position, v.backfill_target, 0;
        RETURN;
    END IF;

    SELECT max(w.global_position) INTO v_last
    FROM (SELECT e.global_position FROM wh_event_store e
          WHERE e.global_position > v.backfill_position
          ORDER BY e.global_position LIMIT greatest(p_max, 1)) w;
    IF v_last IS NULL THEN
        -- The visible end: every later event has a work row of this version.
        UPDATE wh_perspective_versions x SET state = 'ready', backfill_done_at = now()
        WHERE x.perspective_name = p_perspective_name AND x.version = p_version;
        IF NOT EXISTS (SELECT 1 FROM wh_perspective_versions x
                       WHERE x.perspective_name = p_perspective_name AND x.state = 'live') THEN
            PERFORM wh_make_live(p_perspective_name, p_version, 'Live', 'vantage backfill');
            RETURN QUERY SELECT 'live'::text, 0, v.backfill_position, v.backfill_target, 0;
            RETURN;
        END IF;
        RETURN QUERY SELECT 'ready'::text, 0, v.backfill_position, v.backfill_target, 0;
        RETURN;
    END IF;

    -- The batch's events of this version's types that have no work row of it yet; those to
    -- divert become work rows first (in position order, as the fan-out writes them).
    INSERT INTO wh_perspective_events
        (stream_id, event_id, global_position, stream_version, perspective_name)
    SELECT e.stream_id, e.event_id, e.global_position, e.stream_version, v.registry_name
    FROM wh_event_store e
    WHERE e.global_position > v.backfill_position AND e.global_position <= v_last
      AND (e.event_type = ANY (v.event_types) OR '*' = ANY (v.event_types))
      AND NOT EXISTS (SELECT 1 FROM wh_perspective_events w
                      WHERE w.perspective_name = v.registry_name AND w.event_id = e.event_id)
      AND (p_divert
           OR EXISTS (SELECT 1 FROM wh_perspective_events w
                      WHERE w.perspective_name = v.registry_name AND w.stream_id = e.stream_id
                        AND w.stream_version < e.stream_version))
    ORDER BY e.global_position;
    GET DIAGNOSTICS v_moved = ROW_COUNT;

    IF NOT p_divert THEN
        SELECT array_agg(e.event_data ORDER BY e.global_position),
               array_agg(e.stream_id ORDER BY e.global_position),
               array_agg(e.event_id ORDER BY e.global_position),
               array_agg(e.event_type ORDER BY e.global_position),
               array_agg(e.global_position ORDER BY e.global_position),
               array_agg(e.stream_version ORDER BY e.global_position),
               array_agg(e.metadata ORDER BY e.global_position)
        INTO v_data, v_stream, v_id, v_type, v_pos, v_ver, v_meta
        FROM wh_event_store e
        WHERE e.global_position > v.backfill_position AND e.global_position <= v_last
          AND (e.event_type = ANY (v.event_types) OR '*' = ANY (v.event_types))
          AND NOT EXISTS (SELECT 1 FROM wh_perspective_events w
                          WHERE w.perspective_name = v.registry_name AND w.event_id = e.event_id);
        IF v_id IS NOT NULL THEN
            EXECUTE format('SELECT %I.vantage_apply_many($1, $2, $3, $4, $5, $6, $7)', v.version_schema)
                INTO v_n
                USING v_data, v_stream, v_id, v_type, v_pos, v_ver, v_meta;
        END IF;
    END IF;
    UPDATE wh_perspective_versions x
    SET backfill_position = v_last, backfill_applied = x.backfill_applied + v_n
    WHERE x.perspective_name = p_perspective_name AND x.version = p_version;
    RETURN QUERY SELECT 'applied'::text, v_n, v_last, v.backfill_target, v_moved;
END
$$;

-- What a version is behind, read by every metrics sample and console refresh: it must not
-- scan the history (0012 counted the events after the backfill position, a read of the whole
-- event store at the start of a backfill, which held a snapshot for seconds on a big store).
-- Its queued work rows, plus, while it builds, the history positions it has yet to look at
-- (up to the event store's end when its backfill began): an upper bound, as positions of other
-- types count too, exact once it is done.
CREATE OR REPLACE FUNCTION wh_version_behind(p_perspective_name text, p_version integer)
 RETURNS bigint
 LANGUAGE sql
 STABLE
AS $$
    SELECT (SELECT count(*) FROM wh_perspective_events w WHERE w.perspective_name = v.registry_name)
         + CASE WHEN v.state = 'building' THEN
               greatest(coalesce(v.backfill_target,
                                 (SELECT max(e.global_position) FROM wh_event_store e), 0)
                        - v.backfill_position, 0)
           ELSE 0 END
    FROM wh_perspective_versions v
    WHERE v.perspective_name = p_perspective_name AND v.version = p_version;
$$;
