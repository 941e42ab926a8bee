//! History is background work. A rebuild re-queues a perspective's whole history (and a
//! version's backfill may divert some to the drain): rows marked `replay`. Claims share their
//! rows fairly between perspectives, but a perspective replaying history always has rows due,
//! so every batch came back full of them and the other perspectives' fresh events, one or two
//! per batch, waited for a full batch to be applied: during `vantage soak`'s rebuild of 126 000
//! events, the others' median lag went from 0.04 s to 0.32 s, for minutes on a larger history.
//!
//! So a process with two or more consumer loops gives the perspectives it has seen replaying to
//! one loop (the first, [`ClaimRole::History`]) and the rest to the others
//! ([`ClaimRole::Fresh`]), whose batches stay as small as the fresh work. A perspective is seen
//! replaying when a claim returns a `replay` row of it, and no longer when a claim of the
//! history loop returns none of it. Each lane is still claimed by one claimer at a time in
//! stream order (the database's part); this only chooses which perspectives a claim asks for.
//!
//! Separate loops are not enough on a small machine: the history loops of every process still
//! take the CPU (theirs and the database's) the fresh loops need, and during the 60-minute
//! soak's rebuild of 166 000 events the others' lag stayed at 2–3 s for 83 s. So history also
//! yields: the fresh loops report how long the fresh rows of their latest claim had waited
//! ([`Replaying::report_fresh`]), and while that is above [`HISTORY_YIELDS_ABOVE`] the history
//! loop waits before its next claim ([`Replaying::history_wait`]), in steps of [`YIELD_STEP`],
//! at most [`HISTORY_MAX_YIELD`] per claim, so history always moves. A report older than
//! [`FRESH_REPORT_VALID`] (the fresh loops are idle or stuck elsewhere) is not obeyed.

use std::borrow::Cow;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::store::WorkRow;

/// Fresh rows that waited longer than this when a fresh loop claimed them make the history
/// loop wait: a quarter of the one-second lag an operator notices.
pub const HISTORY_YIELDS_ABOVE: Duration = Duration::from_millis(250);
/// The most the history loop waits before one claim.
pub const HISTORY_MAX_YIELD: Duration = Duration::from_secs(2);
/// How long a fresh loop's report is obeyed.
pub const FRESH_REPORT_VALID: Duration = Duration::from_secs(2);
/// How often a waiting history loop looks at the reports again.
pub const YIELD_STEP: Duration = Duration::from_millis(100);

/// Which perspectives a consumer loop's claims ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimRole {
    /// Every perspective (a process with one consumer loop, tests, the test kit).
    All,
    /// The perspectives seen replaying history, or every one while none is.
    History,
    /// The perspectives not replaying history (every one while none is, or while all are).
    Fresh,
}

impl ClaimRole {
    /// The role of consumer loop `id` of `consumers`: the first of two or more takes history.
    pub fn of_consumer(id: usize, consumers: usize) -> ClaimRole {
        match (consumers, id) {
            (0 | 1, _) => ClaimRole::All,
            (_, 0) => ClaimRole::History,
            _ => ClaimRole::Fresh,
        }
    }
}

/// The perspectives this process has seen replaying history; shared by its consumer loops.
#[derive(Debug, Default)]
pub struct Replaying {
    names: Mutex<Vec<String>>,
    /// The fresh loops' latest report: how long the fresh rows of the claim had waited, and when.
    fresh_waited: Mutex<Option<(Duration, Instant)>>,
}

impl Replaying {
    /// The perspectives of `all` that a claim of `role` asks for: `all` itself (no copy, the
    /// usual case) unless some perspective is replaying history.
    pub fn claimable<'a>(&self, role: ClaimRole, all: &'a [String]) -> Cow<'a, [String]> {
        let replaying = self.names.lock().unwrap_or_else(|e| e.into_inner());
        if role == ClaimRole::All || replaying.is_empty() {
            return Cow::Borrowed(all);
        }
        let (history, fresh): (Vec<&String>, Vec<&String>) =
            all.iter().partition(|p| replaying.contains(p));
        let chosen = match role {
            ClaimRole::History if !history.is_empty() => history,
            ClaimRole::Fresh if !fresh.is_empty() => fresh,
            _ => return Cow::Borrowed(all),
        };
        Cow::Owned(chosen.into_iter().cloned().collect())
    }

    /// Records what a claim of `role` over `asked` returned, `(perspective, replay)` per row:
    /// a replay row marks its perspective; a claim of the history loop that asked for a marked
    /// perspective and got no replay row of it unmarks it (its history is done, or nothing of
    /// it was due: the next replay row seen marks it again).
    pub fn observe<'a>(
        &self,
        role: ClaimRole,
        asked: &[String],
        rows: impl IntoIterator<Item = (&'a str, bool)>,
    ) {
        let mut replaying = self.names.lock().unwrap_or_else(|e| e.into_inner());
        let mut seen: Vec<&str> = Vec::new();
        for (perspective, replay) in rows {
            if replay && !seen.contains(&perspective) {
                seen.push(perspective);
            }
        }
        for p in &seen {
            if !replaying.iter().any(|r| r == p) {
                replaying.push(p.to_string());
                tracing::info!(
                    perspective = %p,
                    "perspective is replaying history: one consumer loop takes it, the others keep to the rest"
                );
            }
        }
        if role == ClaimRole::History {
            replaying.retain(|r| {
                let done = asked.contains(r) && !seen.contains(&r.as_str());
                if done {
                    tracing::info!(
                        perspective = %r,
                        "perspective has no more history to replay: every consumer loop takes it again"
                    );
                }
                !done
            });
        }
    }

    /// The perspectives seen replaying history, in the order they were first seen.
    pub fn names(&self) -> Vec<String> {
        self.names.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Records what a fresh loop's claim at `now` returned: how long its longest-waiting fresh
    /// row had been queued. Only rows claimed for the first time and never failed count (a retry's
    /// wait includes its backoff); a claim without one reports no wait.
    pub fn report_fresh(&self, rows: &[WorkRow], now: Instant) {
        let waited = rows
            .iter()
            .filter(|r| !r.replay && r.attempts <= 1 && r.failures == 0)
            .filter_map(|r| r.queued_for)
            .max()
            .unwrap_or(Duration::ZERO);
        *self.fresh_waited.lock().unwrap_or_else(|e| e.into_inner()) = Some((waited, now));
    }

    /// How long the history loop should wait at `now` before claiming again, having waited
    /// `waited` already: [`YIELD_STEP`] while some perspective replays history, the fresh
    /// loops' latest report is recent and above [`HISTORY_YIELDS_ABOVE`], and the loop has
    /// waited less than [`HISTORY_MAX_YIELD`]; otherwise `None` (claim).
    pub fn history_wait(&self, waited: Duration, now: Instant) -> Option<Duration> {
        if waited >= HISTORY_MAX_YIELD
            || self
                .names
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
        {
            return None;
        }
        let report = *self.fresh_waited.lock().unwrap_or_else(|e| e.into_inner());
        match report {
            Some((fresh, at))
                if fresh > HISTORY_YIELDS_ABOVE
                    && now.saturating_duration_since(at) <= FRESH_REPORT_VALID =>
            {
                Some(YIELD_STEP.min(HISTORY_MAX_YIELD - waited))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn one_loop_takes_everything_and_the_first_of_several_takes_history() {
        assert_eq!(ClaimRole::of_consumer(0, 1), ClaimRole::All);
        assert_eq!(ClaimRole::of_consumer(0, 0), ClaimRole::All);
        assert_eq!(ClaimRole::of_consumer(0, 4), ClaimRole::History);
        assert_eq!(ClaimRole::of_consumer(1, 4), ClaimRole::Fresh);
        assert_eq!(ClaimRole::of_consumer(3, 4), ClaimRole::Fresh);
    }

    #[test]
    fn while_nothing_replays_every_loop_claims_every_perspective() {
        let r = Replaying::default();
        let all = names(&["a", "b", "c"]);
        for role in [ClaimRole::All, ClaimRole::History, ClaimRole::Fresh] {
            assert_eq!(r.claimable(role, &all), all, "{role:?}");
        }
    }

    #[test]
    fn a_replay_row_gives_its_perspective_to_the_history_loop_until_it_has_none() {
        let r = Replaying::default();
        let all = names(&["a", "b", "c"]);
        // A fresh loop's claim brought history of c: c goes to the history loop.
        r.observe(
            ClaimRole::Fresh,
            &all,
            [("a", false), ("c", true), ("c", true)],
        );
        assert_eq!(r.claimable(ClaimRole::Fresh, &all), names(&["a", "b"]));
        assert_eq!(r.claimable(ClaimRole::History, &all), names(&["c"]));
        assert_eq!(r.claimable(ClaimRole::All, &all), all);
        // A fresh loop's claim without replay rows unmarks nothing.
        r.observe(ClaimRole::Fresh, &names(&["a", "b"]), [("a", false)]);
        assert_eq!(r.names(), names(&["c"]));
        // The history loop still finds history of c: it stays.
        r.observe(
            ClaimRole::History,
            &names(&["c"]),
            [("c", true), ("c", false)],
        );
        assert_eq!(r.names(), names(&["c"]));
        // Its claim of c brings no replay row: c is everyone's again.
        r.observe(ClaimRole::History, &names(&["c"]), [("c", false)]);
        assert_eq!(r.claimable(ClaimRole::Fresh, &all), all);
        assert_eq!(r.claimable(ClaimRole::History, &all), all);
    }

    #[test]
    fn when_every_perspective_replays_the_fresh_loops_do_not_idle() {
        let r = Replaying::default();
        let all = names(&["a", "b"]);
        r.observe(ClaimRole::Fresh, &all, [("a", true), ("b", true)]);
        assert_eq!(r.claimable(ClaimRole::Fresh, &all), all);
        assert_eq!(r.claimable(ClaimRole::History, &all), all);
        // The history loop unmarks only what it asked for.
        r.observe(ClaimRole::History, &names(&["a"]), []);
        assert_eq!(r.names(), names(&["b"]));
    }

    fn row(replay: bool, attempts: i32, failures: i32, queued_ms: u64) -> WorkRow {
        WorkRow {
            event_work_id: uuid::Uuid::nil(),
            stream_id: uuid::Uuid::nil(),
            event_id: uuid::Uuid::nil(),
            perspective_name: "a".into(),
            global_position: 1,
            stream_version: 1,
            event_type: Some("t".into()),
            event_data: None,
            metadata: None,
            attempts,
            failures,
            queued_for: Some(Duration::from_millis(queued_ms)),
            replay,
        }
    }

    #[test]
    fn history_waits_while_fresh_work_waits_and_never_longer_than_its_cap() {
        let r = Replaying::default();
        let t0 = Instant::now();
        // Nothing replays: never wait, whatever the fresh loops report.
        r.report_fresh(&[row(false, 1, 0, 900)], t0);
        assert_eq!(r.history_wait(Duration::ZERO, t0), None);
        r.observe(ClaimRole::Fresh, &names(&["c"]), [("c", true)]);
        // Fresh work waited 900 ms: wait a step, until the cap.
        assert_eq!(r.history_wait(Duration::ZERO, t0), Some(YIELD_STEP));
        assert_eq!(
            r.history_wait(HISTORY_MAX_YIELD - Duration::from_millis(30), t0),
            Some(Duration::from_millis(30))
        );
        assert_eq!(r.history_wait(HISTORY_MAX_YIELD, t0), None);
        // A stale report is not obeyed.
        let later = t0 + FRESH_REPORT_VALID + Duration::from_millis(1);
        assert_eq!(r.history_wait(Duration::ZERO, later), None);
        // A claim whose fresh rows are young, or that brought none, lets history go.
        r.report_fresh(&[row(false, 1, 0, 20)], t0);
        assert_eq!(r.history_wait(Duration::ZERO, t0), None);
        r.report_fresh(&[], t0);
        assert_eq!(r.history_wait(Duration::ZERO, t0), None);
    }

    #[test]
    fn only_first_deliveries_of_fresh_rows_count_as_waiting() {
        let r = Replaying::default();
        let t0 = Instant::now();
        r.observe(ClaimRole::Fresh, &names(&["c"]), [("c", true)]);
        // History, retries and failed rows wait by design (a rebuild, a backoff).
        r.report_fresh(
            &[
                row(true, 1, 0, 60_000),
                row(false, 2, 0, 60_000),
                row(false, 1, 1, 60_000),
                row(false, 1, 0, 10),
            ],
            t0,
        );
        assert_eq!(r.history_wait(Duration::ZERO, t0), None);
        r.report_fresh(&[row(false, 1, 0, 10), row(false, 1, 0, 400)], t0);
        assert_eq!(r.history_wait(Duration::ZERO, t0), Some(YIELD_STEP));
    }

    #[test]
    fn a_perspective_this_process_does_not_handle_is_never_claimed() {
        let r = Replaying::default();
        r.observe(ClaimRole::Fresh, &names(&["a"]), [("zz", true)]);
        assert_eq!(
            r.claimable(ClaimRole::History, &names(&["a", "b"])),
            names(&["a", "b"])
        );
        assert_eq!(
            r.claimable(ClaimRole::Fresh, &names(&["a", "b"])),
            names(&["a", "b"])
        );
    }
}
