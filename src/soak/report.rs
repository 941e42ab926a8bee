//! The soak's verdict: per phase the lag and the time to recover, per daemon memory, file
//! descriptors and connections, the accounting from the read model, and the checks (text for
//! people, the JSON envelope with `--json`).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::store::soak::{Accounting, Lag, SoakStore};
use crate::store::StoreError;

use super::faults::Outcome;
use super::fleet::{self, Incarnation};
use super::{Phase, Soak, SoakConfig};

/// Lag under this is "recovered".
pub const RECOVERED_LAG_SECS: f64 = 1.0;
/// The bar on the time to recover after a fault ends (release profile).
pub const RECOVERY_BAR_SECS: f64 = 60.0;
/// The bar on each long-lived daemon's resident-memory slope (release profile).
pub const RSS_SLOPE_BAR_MIB_PER_H: f64 = 1.0;

/// One daemon at one moment.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DaemonState {
    /// Its slot.
    pub slot: usize,
    /// Its process id.
    pub pid: u32,
    /// Resident memory, KiB.
    pub rss_kib: u64,
    /// Its anonymous part (`RssAnon`), KiB.
    pub anon_kib: u64,
    /// Open file descriptors.
    pub fds: u64,
    /// Its sessions in `pg_stat_activity`.
    pub connections: u64,
}

/// Every running daemon at one moment, and when (seconds since the start).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Snapshot {
    /// Seconds since the start.
    pub at: f64,
    /// The daemons.
    pub daemons: Vec<DaemonState>,
}

/// Reads every running daemon's memory, descriptors and sessions.
pub async fn snapshot(soak: &Soak) -> Snapshot {
    let at = soak.now();
    let pids = soak.fleet.lock().await.pids();
    let mut daemons = Vec::new();
    for (slot, pid) in pids {
        let Some(s) = fleet::sample(pid, at) else {
            continue;
        };
        let connections = soak
            .db
            .instance_of(pid)
            .await
            .map(|i| i.connections)
            .unwrap_or(0);
        daemons.push(DaemonState {
            slot,
            pid,
            rss_kib: s.rss_kib,
            anon_kib: s.anon_kib,
            fds: s.fds,
            connections,
        });
    }
    Snapshot { at, daemons }
}

/// One phase.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PhaseReport {
    /// Its name.
    pub phase: &'static str,
    /// Seconds since the start when it began, and when its fault ended.
    pub started_s: f64,
    /// When its fault ended.
    pub fault_end_s: f64,
    /// Seconds of fault, and of the whole phase.
    pub fault_secs: f64,
    /// Seconds of the whole phase (fault and recovery window).
    pub phase_secs: f64,
    /// Lag of the events appended during the phase.
    pub lag: Lag,
    /// Lag of the events appended during its fault.
    pub fault_lag: Lag,
    /// Seconds after the fault's end until the lag was back under 1 s and stayed there
    /// through the recovery window; `None` when it did not (or nothing was measured).
    pub recovery_secs: Option<f64>,
    /// After the fault's end, per second of append time: (seconds since the fault's end, p99
    /// lag); what `recovery_secs` was read from (JSON only).
    pub recovery_series: Vec<(f64, f64)>,
    /// Whether the phase injects a fault.
    pub is_fault: bool,
    /// What the fault did, and what it could not do.
    pub outcome: Outcome,
    #[serde(skip)]
    window: (DateTime<Utc>, DateTime<Utc>, DateTime<Utc>),
}

impl PhaseReport {
    /// When its fault began and ended (wall clock).
    pub fn fault_window(&self) -> (DateTime<Utc>, DateTime<Utc>) {
        (self.window.0, self.window.1)
    }

    /// A phase that ran from `start` (fault until `fault_end`) to `end`.
    pub fn new(
        phase: Phase,
        start: DateTime<Utc>,
        fault_end: DateTime<Utc>,
        end: DateTime<Utc>,
        started_s: f64,
        fault_end_s: f64,
        outcome: Outcome,
    ) -> PhaseReport {
        let secs = |a: DateTime<Utc>, b: DateTime<Utc>| (b - a).num_milliseconds() as f64 / 1e3;
        PhaseReport {
            phase: phase.name(),
            started_s,
            fault_end_s,
            fault_secs: secs(start, fault_end),
            phase_secs: secs(start, end),
            lag: Lag::default(),
            fault_lag: Lag::default(),
            recovery_secs: None,
            recovery_series: Vec::new(),
            is_fault: phase.is_fault(),
            outcome,
            window: (start, fault_end, end),
        }
    }

    /// Reads the phase's lag and recovery from the read model (after the final drain).
    pub async fn measure(
        &mut self,
        db: &SoakStore,
        perspectives: &[String],
    ) -> Result<(), StoreError> {
        let (start, fault_end, end) = self.window;
        self.lag = db.lag(perspectives, start, end).await?;
        self.fault_lag = db.lag(perspectives, start, fault_end).await?;
        if self.is_fault {
            // Whether an event took under a second is settled a second after its append: one
            // appended in the phase's last second is settled after the next phase's fault
            // began, and the next fault is not this one's recovery (a lone slow last second of
            // pg-restart, with terminate's first kills, in a 22-minute run).
            let settled_until =
                end - chrono::Duration::milliseconds((RECOVERED_LAG_SECS * 1e3) as i64);
            let series = db
                .lag_by_second(perspectives, fault_end, settled_until)
                .await?;
            self.recovery_secs = recovery(&series);
            self.recovery_series = series;
        }
        Ok(())
    }
}

/// The first second of `series` (seconds since the fault's end, p99 lag) from which every
/// later second is under [`RECOVERED_LAG_SECS`]; `None` if the last one is not.
pub fn recovery(series: &[(f64, f64)]) -> Option<f64> {
    let mut first_good = None;
    for (second, lag) in series {
        if *lag < RECOVERED_LAG_SECS {
            first_good.get_or_insert(*second);
        } else {
            first_good = None;
        }
    }
    first_good
}

/// One daemon slot over the run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DaemonReport {
    /// Its slot.
    pub slot: usize,
    /// Processes it had (1 + replacements).
    pub processes: usize,
    /// Processes that exited by themselves (not killed by the soak, not stopped at the end).
    pub unexpected_exits: usize,
    /// Whether its last process ran from the start to the end (the bars apply to it).
    pub long_lived: bool,
    /// Resident memory of its last process after the warm-up and at the end, MiB.
    pub rss_mib: (f64, f64),
    /// The slope of its resident memory after the warm-up (least squares), MiB per hour.
    pub rss_slope_mib_per_h: Option<f64>,
    /// Samples the slope was fitted to.
    pub rss_samples: usize,
    /// The anonymous part of its resident memory (`RssAnon`: heap and stacks, what a leak
    /// grows) after the warm-up and at the end, MiB; reported beside the bar, not a bar.
    pub anon_mib: (f64, f64),
    /// The slope of the anonymous part after the warm-up, MiB per hour.
    pub anon_slope_mib_per_h: Option<f64>,
    /// The samples the anonymous slope was fitted to, (seconds since the start, MiB): where
    /// memory grew, by phase, without a sampler beside the run (JSON only).
    pub anon_series: Vec<(f64, f64)>,
    /// Open file descriptors after the warm-up and at the end.
    pub fds: (u64, u64),
    /// Sessions in `pg_stat_activity` after the warm-up and at the end.
    pub connections: (u64, u64),
}

/// A check and whether it held.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CheckResult {
    /// What it checks.
    pub name: String,
    /// Whether it held.
    pub holds: bool,
    /// Whether a failure fails the run (correctness always; the bars in the release profile).
    pub enforced: bool,
    /// The figures behind it.
    pub detail: String,
}

/// The whole report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    /// The profile.
    pub profile: super::Profile,
    /// Seconds of phases.
    pub duration_secs: f64,
    /// Events per second asked of the producer.
    pub rate: u64,
    /// Streams.
    pub streams: usize,
    /// Daemons.
    pub daemons_asked: usize,
    /// `worker.max_perspective_event_attempts`.
    pub max_attempts: u32,
    /// The phases.
    pub phases: Vec<PhaseReport>,
    /// The read model's accounting.
    pub accounting: Accounting,
    /// Producer batches whose append failed (not retried; nothing of them was appended).
    pub failed_batches: u64,
    /// Seconds the final drain took.
    pub drain_secs: f64,
    /// Whether the final drain completed.
    pub drained: bool,
    /// The daemons after the warm-up.
    pub warm: Snapshot,
    /// The daemons at the end.
    pub end: Snapshot,
    /// Each daemon slot.
    pub daemons: Vec<DaemonReport>,
    /// Every check.
    pub checks: Vec<CheckResult>,
    /// Where the configurations and daemon logs are.
    pub dir: PathBuf,
    #[serde(skip)]
    config: SoakConfig,
}

impl Report {
    /// The report of a run (daemons and checks are filled by [`finish`](Self::finish)).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: SoakConfig,
        phases: Vec<PhaseReport>,
        accounting: Accounting,
        warm: Snapshot,
        end: Snapshot,
        drain: Duration,
        drained: bool,
        failed_batches: u64,
        dir: PathBuf,
    ) -> Report {
        Report {
            profile: config.profile,
            duration_secs: config.duration.as_secs_f64(),
            rate: config.rate,
            streams: config.streams,
            daemons_asked: config.daemons,
            max_attempts: config.max_attempts,
            phases,
            accounting,
            failed_batches,
            drain_secs: drain.as_secs_f64(),
            drained,
            warm,
            end,
            daemons: Vec::new(),
            checks: Vec::new(),
            dir,
            config,
        }
    }

    /// Adds the daemons' figures (from the fleet's samples) and every check; `codes` are the
    /// daemons' exit codes after the final SIGTERM.
    pub async fn finish(&mut self, soak: &Soak, codes: Vec<Option<i32>>) {
        let warmup = self.config.warmup.as_secs_f64().min(self.warm.at);
        {
            let fleet = soak.fleet.lock().await;
            for slot in &fleet.slots {
                self.daemons
                    .push(self.daemon(slot.index, &slot.incarnations, warmup));
            }
        }
        self.checks = self.checks(&codes);
    }

    fn daemon(&self, slot: usize, incarnations: &[Incarnation], warmup: f64) -> DaemonReport {
        let last = incarnations.last();
        let unexpected_exits = incarnations
            .iter()
            .take(incarnations.len().saturating_sub(1))
            .filter(|i| !i.killed && i.exit.is_some())
            .count();
        let long_lived = incarnations.len() == 1;
        let state = |s: &Snapshot| {
            s.daemons
                .iter()
                .find(|d| d.slot == slot && Some(d.pid) == last.map(|l| l.pid))
                .cloned()
                .unwrap_or_default()
        };
        let (w, e) = (state(&self.warm), state(&self.end));
        let fit_from = last.map_or(warmup, |l| l.spawned_at.max(warmup));
        let series = |kib: fn(&fleet::ProcSample) -> u64| -> Vec<(f64, f64)> {
            last.map(|l| {
                l.samples
                    .iter()
                    .filter(|s| s.at >= fit_from)
                    .map(|s| (s.at, kib(s) as f64 / 1024.0))
                    .collect()
            })
            .unwrap_or_default()
        };
        let points = series(|s| s.rss_kib);
        let anon = series(|s| s.anon_kib);
        DaemonReport {
            slot,
            processes: incarnations.len(),
            unexpected_exits,
            long_lived,
            rss_mib: (w.rss_kib as f64 / 1024.0, e.rss_kib as f64 / 1024.0),
            // MiB per second × 3600.
            rss_slope_mib_per_h: fleet::slope(&points).map(|s| s * 3600.0),
            rss_samples: points.len(),
            anon_mib: (w.anon_kib as f64 / 1024.0, e.anon_kib as f64 / 1024.0),
            anon_slope_mib_per_h: fleet::slope(&anon).map(|s| s * 3600.0),
            anon_series: anon,
            fds: (w.fds, e.fds),
            connections: (w.connections, e.connections),
        }
    }

    fn checks(&self, codes: &[Option<i32>]) -> Vec<CheckResult> {
        let a = &self.accounting;
        let bars = self.config.enforces_bars();
        let mut out = Vec::new();
        let mut check = |name: &str, holds: bool, enforced: bool, detail: String| {
            out.push(CheckResult {
                name: name.into(),
                holds,
                enforced,
                detail,
            })
        };
        check(
            "no event lost",
            a.lost == 0,
            true,
            format!(
                "{} of {} expected applies missing",
                a.lost, a.expected_applies
            ),
        );
        check(
            "no event applied twice",
            a.applied_twice == 0,
            true,
            format!("{} applied more than once", a.applied_twice),
        );
        check(
            "stream order kept",
            a.out_of_order == 0 && a.applied_past_poison == 0,
            true,
            format!(
                "{} applied behind a later version, {} applied before an earlier poison event was dead-lettered",
                a.out_of_order, a.applied_past_poison
            ),
        );
        check(
            "nothing applied that must not be",
            a.unexpected_applies == 0,
            true,
            format!("{} unexpected applies", a.unexpected_applies),
        );
        check(
            "every poison event dead-lettered after exactly max + 1 claims",
            a.poison > 0 && a.poison_wrong == 0 && a.poison == a.poison_dead_lettered + a.cured,
            true,
            format!(
                "{} poison events: {} dead-lettered after exactly {} claims, {} cured and requeued, {} wrong ({} after more claims, each inside a session-cutting fault's window: a claim's answer lost)",
                a.poison,
                a.poison_dead_lettered,
                self.max_attempts + 1,
                a.cured,
                a.poison_wrong,
                a.poison_cut
            ),
        );
        check(
            "no healthy event dead-lettered",
            a.healthy_dead_lettered == 0,
            true,
            format!(
                "{} healthy events dead-lettered ({} with no apply failure: by claims alone)",
                a.healthy_dead_lettered, a.healthy_dead_lettered_without_failure
            ),
        );
        check(
            "requeued dead letters accounted",
            a.cured_still_dead == 0,
            true,
            format!(
                "{} cured and requeued, {} of them still dead-lettered",
                a.cured, a.cured_still_dead
            ),
        );
        check(
            "nothing stranded",
            a.stranded == 0 && self.drained,
            true,
            format!(
                "{} work rows left after a drain of {:.1} s",
                a.stranded, self.drain_secs
            ),
        );
        let errors: Vec<String> = self
            .phases
            .iter()
            .flat_map(|p| {
                p.outcome
                    .errors
                    .iter()
                    .map(move |e| format!("{}: {e}", p.phase))
            })
            .collect();
        check(
            "every phase did what it scripts",
            errors.is_empty(),
            true,
            if errors.is_empty() {
                "yes".into()
            } else {
                errors.join("; ")
            },
        );
        let exits: usize = self.daemons.iter().map(|d| d.unexpected_exits).sum();
        check(
            "no daemon exited by itself",
            exits == 0,
            true,
            format!("{exits} exits not caused by the soak"),
        );
        let clean = codes.iter().filter(|c| **c == Some(0)).count();
        check(
            "every daemon stops cleanly on SIGTERM (exit 0)",
            clean == codes.len(),
            true,
            format!("{clean} of {} exited 0: {codes:?}", codes.len()),
        );

        let slow: Vec<String> = self
            .phases
            .iter()
            .filter(|p| p.is_fault)
            .filter(|p| p.recovery_secs.is_none_or_above(RECOVERY_BAR_SECS))
            .map(|p| {
                format!(
                    "{} ({})",
                    p.phase,
                    p.recovery_secs
                        .map_or("not within its window".into(), |s| format!("{s:.0} s"))
                )
            })
            .collect();
        check(
            "lag back under 1 s within 60 s of each fault's end",
            slow.is_empty(),
            bars,
            if slow.is_empty() {
                "every fault phase".into()
            } else {
                format!("slower: {}", slow.join(", "))
            },
        );
        let long: Vec<&DaemonReport> = self.daemons.iter().filter(|d| d.long_lived).collect();
        let steep: Vec<String> = long
            .iter()
            .filter(|d| {
                d.rss_slope_mib_per_h
                    .is_none_or_above(RSS_SLOPE_BAR_MIB_PER_H - f64::EPSILON)
            })
            .map(|d| {
                format!(
                    "daemon {}: {}",
                    d.slot,
                    d.rss_slope_mib_per_h
                        .map_or("not measured".into(), |s| format!("{s:.2} MiB/h"))
                )
            })
            .collect();
        check(
            "RSS slope < 1 MiB/h for every long-lived daemon",
            !long.is_empty() && steep.is_empty(),
            bars,
            if steep.is_empty() {
                long.iter()
                    .map(|d| {
                        format!(
                            "daemon {}: {:.2} MiB/h",
                            d.slot,
                            d.rss_slope_mib_per_h.unwrap_or(0.0)
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            } else {
                steep.join(", ")
            },
        );
        // Flat: a few descriptors of slack (a reconnecting pool, the listener), 10 % at most.
        let fds_grew: Vec<String> = long
            .iter()
            .filter(|d| d.fds.1 > d.fds.0 + (d.fds.0 / 10).max(8))
            .map(|d| format!("daemon {}: {} → {}", d.slot, d.fds.0, d.fds.1))
            .collect();
        check(
            "open file descriptors flat",
            !long.is_empty() && fds_grew.is_empty(),
            bars,
            if fds_grew.is_empty() {
                "every long-lived daemon".into()
            } else {
                fds_grew.join(", ")
            },
        );
        // A daemon's pool is bounded (consumers + 4) plus its LISTEN session.
        let bound = self.config.consumers as u64 + 5;
        let conns_grew: Vec<String> = long
            .iter()
            .filter(|d| d.connections.1 > bound || d.connections.1 > d.connections.0 + 4)
            .map(|d| {
                format!(
                    "daemon {}: {} → {}",
                    d.slot, d.connections.0, d.connections.1
                )
            })
            .collect();
        check(
            "database connections flat",
            !long.is_empty() && conns_grew.is_empty(),
            bars,
            if conns_grew.is_empty() {
                format!("every long-lived daemon, at most {bound}")
            } else {
                conns_grew.join(", ")
            },
        );
        out
    }

    /// Whether every enforced check holds.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.holds || !c.enforced)
    }
}

trait AboveBar {
    fn is_none_or_above(&self, bar: f64) -> bool;
}

impl AboveBar for Option<f64> {
    fn is_none_or_above(&self, bar: f64) -> bool {
        self.map_or(true, |v| v > bar)
    }
}

fn lag_cell(l: &Lag) -> String {
    if l.samples == 0 {
        "-".into()
    } else {
        format!("{:.2}/{:.2}/{:.1}", l.p50, l.p99, l.max)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "vantage soak, {} profile: {:.0} s of phases, {} events/s over {} streams, {} daemons, max attempts {}",
            self.profile.name(),
            self.duration_secs,
            self.rate,
            self.streams,
            self.daemons_asked,
            self.max_attempts
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "{:<13} {:>7} {:>20} {:>20} {:>10}  what happened",
            "phase", "fault s", "lag p50/p99/max s", "fault-window lag", "recovery"
        )?;
        for p in &self.phases {
            let recovery = if !p.is_fault {
                "-".to_string()
            } else {
                p.recovery_secs.map_or("no".into(), |s| format!("{s:.0} s"))
            };
            let mut what = p.outcome.notes.join("; ");
            if !p.outcome.errors.is_empty() {
                what.push_str(&format!("; ERRORS: {}", p.outcome.errors.join("; ")));
            }
            writeln!(
                f,
                "{:<13} {:>7.0} {:>20} {:>20} {:>10}  {}",
                p.phase,
                p.fault_secs,
                lag_cell(&p.lag),
                lag_cell(&p.fault_lag),
                recovery,
                crate::text::one_line(&what)
            )?;
        }
        writeln!(
            f,
            "(lag: append → applied of every tenth event on streams without poison, {}; recovery: seconds after the fault's end until the per-second p99 lag is under 1 s for good)",
            super::LAG_MEASURED.join(" and ")
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "{:<7} {:>9} {:>16} {:>12} {:>16} {:>12} {:>12} {:>12}",
            "daemon",
            "processes",
            "RSS MiB",
            "slope MiB/h",
            "anon MiB",
            "anon MiB/h",
            "fds",
            "connections"
        )?;
        for d in &self.daemons {
            writeln!(
                f,
                "{:<7} {:>9} {:>16} {:>12} {:>16} {:>12} {:>12} {:>12}{}",
                d.slot,
                d.processes,
                format!("{:.1} → {:.1}", d.rss_mib.0, d.rss_mib.1),
                d.rss_slope_mib_per_h
                    .map_or("-".into(), |s| format!("{s:.2}")),
                format!("{:.1} → {:.1}", d.anon_mib.0, d.anon_mib.1),
                d.anon_slope_mib_per_h
                    .map_or("-".into(), |s| format!("{s:.2}")),
                format!("{} → {}", d.fds.0, d.fds.1),
                format!("{} → {}", d.connections.0, d.connections.1),
                if d.long_lived {
                    ""
                } else {
                    "  (replaced; not held to the bars)"
                }
            )?;
        }
        writeln!(
            f,
            "(start = after the {:.0} s warm-up, end = after the final drain; slopes fitted to {} samples of the last process; anon = RssAnon, the heap and stacks a leak would grow)",
            self.warm.at,
            self.daemons.iter().map(|d| d.rss_samples).max().unwrap_or(0)
        )?;
        writeln!(f)?;
        let a = &self.accounting;
        writeln!(
            f,
            "accounting: {} events appended ({} producer batches failed and were not appended), {} applies expected",
            a.appended, self.failed_batches, a.expected_applies
        )?;
        for example in &a.examples {
            writeln!(f, "  {}", crate::text::one_line(example))?;
        }
        writeln!(f)?;
        for c in &self.checks {
            let mark = match (c.holds, c.enforced) {
                (true, _) => "PASS",
                (false, true) => "FAIL",
                (false, false) => "MISS",
            };
            writeln!(
                f,
                "{mark}  {}: {}{}",
                c.name,
                crate::text::one_line(&c.detail),
                if c.enforced {
                    ""
                } else {
                    " (reported, not enforced)"
                }
            )?;
        }
        writeln!(f)?;
        write!(
            f,
            "soak: {}",
            if self.passed() {
                "PASS (every enforced check holds)"
            } else {
                "FAIL"
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovery_is_the_first_second_from_which_lag_stays_low() {
        assert_eq!(recovery(&[(0.0, 5.0), (1.0, 0.2), (2.0, 0.3)]), Some(1.0));
        assert_eq!(
            recovery(&[(0.0, 0.1), (1.0, 3.0), (2.0, 0.3), (3.0, 0.2)]),
            Some(2.0)
        );
        assert_eq!(recovery(&[(0.0, 0.1), (1.0, 3.0)]), None);
        assert_eq!(recovery(&[]), None);
    }
}
