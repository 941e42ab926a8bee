-- vantage 0021: vacuum never truncates the queue tables.
--
-- Found by `vantage soak`: lone one-second lag spikes minutes after a fault, each beside an
-- autovacuum waiting on `VacuumTruncate`. The work table, the wake-ups and the lane index empty
-- their tail pages again and again (every completed row is deleted), and vacuum then truncates
-- them: for that it takes the table's ACCESS EXCLUSIVE lock, which every claim, completion and
-- append also needs, waiting up to 5 s for it and holding it while it scans the tail backwards.
-- The emptied pages are reused by the next inserts anyway. Set on the tables, so it holds
-- whatever the server's `vacuum_truncate` default is.
--
-- Contract: no object, signature or result changes.

ALTER TABLE wh_perspective_events SET (vacuum_truncate = false);
ALTER TABLE wh_lane_wakeups SET (vacuum_truncate = false);
ALTER TABLE wh_perspective_lanes SET (vacuum_truncate = false);
