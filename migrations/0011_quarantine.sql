-- vantage schema, part 11: automatic quarantine (`perspectives[].quarantine_after`).
--
-- A perspective configured with quarantine_after = "N in DURATION" is paused by the daemon
-- once N of its events were dead-lettered within DURATION: one fenced UPDATE of its
-- wh_perspectives row (`paused_at IS NULL`, so of several daemons only one pauses it, and
-- only that one logs and counts it). The statement is the store's (Store::quarantine_perspective).
--
-- * resumed_at: when the perspective was last resumed. Only dead letters after it count, so a
--   resume is not undone at once by the dead letters that caused the pause.
-- * An index of dead letters by perspective and time, so the count reads at most N entries of
--   one perspective's recent dead letters (every status: a dead letter requeued or purged
--   since was still dead-lettered in the window; a reopened one has its new time).

ALTER TABLE wh_perspectives
    ADD COLUMN resumed_at timestamptz;

CREATE INDEX wh_dead_letters_recent_idx
    ON wh_dead_letters (perspective_name, dead_lettered_at);
