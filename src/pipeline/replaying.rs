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
//! yields: the fresh loops report how long the fresh rows of each claim had waited
//! ([`Replaying::report_fresh`]), and while the longest wait reported in the last
//! [`FRESH_REPORT_WINDOW`] is above [`HISTORY_YIELDS_ABOVE`] the history loop waits before its
//! next claim ([`Replaying::history_wait`]), in steps of [`YIELD_STEP`], at most
//! [`HISTORY_MAX_YIELD`] per claim, so history always moves. The longest, not the latest: most
//! claims of several fresh loops bring young rows or none, and when the latest report decided,
//! one of them released history while other rows had waited seconds (the 60-minute soak's
//! rebuild drained at the same pace whatever the cap). Without reports in the window (the fresh
//! loops are idle or stuck elsewhere) history does not wait.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::store::WorkRow;

/// Fresh rows that waited longer than this when a fresh loop claimed them make the history
/// loop wait: a quarter of the one-second lag an operator notices.
pub const HISTORY_YIELDS_ABOVE: Duration = Duration::from_millis(250);
/// The most the history loop waits before one claim: with claims of up to `batch_size` rows
/// (500 by default), history still moves at about 100 rows a second per process while fresh
/// work waits (1 000 rows/s of history on three processes of a 2-core machine kept the others'
/// lag at 1–3 s).
pub const HISTORY_MAX_YIELD: Duration = Duration::from_secs(5);
/// How long a fresh loop's report counts: history waits while the longest wait reported in
/// this window is above [`HISTORY_YIELDS_ABOVE`].
pub const FRESH_REPORT_WINDOW: Duration = Duration::from_secs(1);
/// The most reports kept for the window; more than fresh loops claim in it on any machine.
const FRESH_REPORTS_KEPT: usize = 64;
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
    /// The fresh loops' reports of the last [`FRESH_REPORT_WINDOW`] that a later one did not
    /// outdo, oldest first: how long the fresh rows of a claim had waited, and when. Each kept
    /// report waited longer than every later one, so the first is the window's longest.
    fresh_waited: Mutex<VecDeque<(Duration, Instant)>>,
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
        let mut reports = self.fresh_waited.lock().unwrap_or_else(|e| e.into_inner());
        // A report that waited no longer than a later one can never be the window's longest.
        while reports.back().is_some_and(|&(w, _)| w <= waited) {
            reports.pop_back();
        }
        if reports.len() >= FRESH_REPORTS_KEPT {
            reports.pop_back();
        }
        reports.push_back((waited, now));
    }

    /// How long the history loop should wait at `now` before claiming again, having waited
    /// `waited` already: [`YIELD_STEP`] while some perspective replays history, the longest
    /// wait the fresh loops reported in the last [`FRESH_REPORT_WINDOW`] is above
    /// [`HISTORY_YIELDS_ABOVE`], and the loop has waited less than [`HISTORY_MAX_YIELD`];
    /// otherwise `None` (claim).
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
        let mut reports = self.fresh_waited.lock().unwrap_or_else(|e| e.into_inner());
        while reports
            .front()
            .is_some_and(|&(_, at)| now.saturating_duration_since(at) > FRESH_REPORT_WINDOW)
        {
            reports.pop_front();
        }
        match reports.front() {
            Some(&(fresh, _)) if fresh > HISTORY_YIELDS_ABOVE => {
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
        // A report older than the window is not obeyed.
        let later = t0 + FRESH_REPORT_WINDOW + Duration::from_millis(1);
        assert_eq!(r.history_wait(Duration::ZERO, later), None);
        // Once it is, claims whose fresh rows are young, or that brought none, let history go.
        r.report_fresh(&[row(false, 1, 0, 20)], later);
        assert_eq!(r.history_wait(Duration::ZERO, later), None);
        r.report_fresh(&[], later);
        assert_eq!(r.history_wait(Duration::ZERO, later), None);
    }

    #[test]
    fn a_young_claim_does_not_release_history_while_another_claim_in_the_window_waited() {
        let r = Replaying::default();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        r.observe(ClaimRole::Fresh, &names(&["c"]), [("c", true)]);
        // One fresh loop's rows waited 900 ms; the next claims (other loops) bring young rows
        // or none: the rows that waited are still the window's news.
        r.report_fresh(&[row(false, 1, 0, 900)], t0);
        r.report_fresh(&[row(false, 1, 0, 20)], t0 + ms(100));
        r.report_fresh(&[], t0 + ms(200));
        assert_eq!(
            r.history_wait(Duration::ZERO, t0 + ms(300)),
            Some(YIELD_STEP)
        );
        // A later, shorter wait still above the mark outlives the longest one.
        r.report_fresh(&[row(false, 1, 0, 400)], t0 + ms(800));
        r.report_fresh(&[row(false, 1, 0, 10)], t0 + ms(900));
        let after_first = t0 + FRESH_REPORT_WINDOW + ms(1);
        assert_eq!(
            r.history_wait(Duration::ZERO, after_first),
            Some(YIELD_STEP)
        );
        // When only young reports are left in the window, history goes.
        let after_second = t0 + ms(800) + FRESH_REPORT_WINDOW + ms(1);
        assert_eq!(r.history_wait(Duration::ZERO, after_second), None);
    }

    #[test]
    fn the_reports_kept_for_the_window_are_bounded_and_keep_the_longest() {
        let r = Replaying::default();
        let t0 = Instant::now();
        r.observe(ClaimRole::Fresh, &names(&["c"]), [("c", true)]);
        // Ever shorter waits, all kept (each may outlive the ones before it): at most the bound.
        for i in 0..1_000u64 {
            r.report_fresh(&[row(false, 1, 0, 5_000 - i)], t0);
        }
        let kept = r.fresh_waited.lock().unwrap().len();
        assert!(kept <= FRESH_REPORTS_KEPT, "{kept} reports kept");
        assert_eq!(
            r.fresh_waited.lock().unwrap().front().map(|&(w, _)| w),
            Some(Duration::from_millis(5_000))
        );
        assert_eq!(r.history_wait(Duration::ZERO, t0), Some(YIELD_STEP));
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
