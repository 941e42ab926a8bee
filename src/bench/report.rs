//! The report: the machine and server, the table of runs with ratios, the checks, the query
//! plans, and, last, exactly three lines — `limit: <events/s>`, `vantage: <events/s>`,
//! `drain/limit ratio: <x.xx>` (the limit there is the crash-safe shape).

use std::fmt::{self, Write as _};

use super::checks::CheckOutcome;
use super::drain::DrainRun;
use super::limit::LimitRun;
use super::measure::PerEvent;
use super::BenchConfig;

/// Everything one `vantage bench` measured.
#[derive(Clone, Debug)]
pub struct Report {
    /// What was asked for.
    pub config: BenchConfig,
    /// Whether round trips could be counted (pg_stat_statements).
    pub statement_stats: bool,
    /// Server version and durability settings.
    pub server: Vec<(String, String)>,
    /// The daemon's drain.
    pub vantage: Option<DrainRun>,
    /// The crash-safe limit.
    pub crash_safe: Option<LimitRun>,
    /// The same crash-safe shape on vantage's own work table (paying its lane triggers).
    pub crash_safe_own: Option<LimitRun>,
    /// The single-transaction floor.
    pub floor: Option<LimitRun>,
    /// drain/limit of every round, in run order (one unless `--rounds`).
    pub rounds: Vec<f64>,
    /// The checks, in the order they ran.
    pub checks: Vec<CheckOutcome>,
}

impl Report {
    /// An empty report for `config`.
    pub fn new(config: BenchConfig, statement_stats: bool) -> Self {
        Report {
            config,
            statement_stats,
            server: Vec::new(),
            vantage: None,
            crash_safe: None,
            crash_safe_own: None,
            floor: None,
            rounds: Vec::new(),
            checks: Vec::new(),
        }
    }

    /// Rows per second of the daemon's drain.
    pub fn vantage_rate(&self) -> f64 {
        self.vantage.as_ref().map(|v| v.rate()).unwrap_or(0.0)
    }

    /// Rows per second of the crash-safe limit.
    pub fn limit_rate(&self) -> f64 {
        self.crash_safe.as_ref().map(|l| l.rate()).unwrap_or(0.0)
    }

    /// vantage / crash-safe limit.
    pub fn ratio(&self) -> f64 {
        let limit = self.limit_rate();
        if limit > 0.0 {
            self.vantage_rate() / limit
        } else {
            0.0
        }
    }
}

fn round_trips(p: &PerEvent) -> String {
    p.round_trips
        .map(|r| format!("{r:.3}"))
        .unwrap_or_else(|| "n/a".into())
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "vantage bench: N={} events, S={} streams, P={} perspective(s), K={} consumers, batch {}, payload {} B, {} instance(s)",
            c.events, c.streams, c.perspectives, c.consumers, c.batch_size, c.payload_bytes, c.instances
        )?;
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0);
        let server: Vec<String> = self
            .server
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        writeln!(f, "machine: {cores} cores; server: {}", server.join(", "))?;
        if !self.statement_stats {
            writeln!(
                f,
                "round trips: n/a (pg_stat_statements is not loaded on this server)"
            )?;
        }
        writeln!(f)?;
        let limit = self.limit_rate();
        let mut table = String::new();
        writeln!(
            table,
            "{:<26} {:>9} {:>8} {:>10} {:>7} {:>9} {:>9} {:>10} {:>10} {:>10}",
            "run",
            "rows",
            "seconds",
            "rows/s",
            "/limit",
            "rt/row",
            "tx/row",
            "WAL B/row",
            "srv µs/row",
            "cli µs/row"
        )?;
        let mut line = |what: &str, rows: u64, secs: f64, rate: f64, p: &PerEvent| {
            let _ = writeln!(
                table,
                "{:<26} {:>9} {:>8.2} {:>10.0} {:>7.2} {:>9} {:>9.3} {:>10.0} {:>10} {:>10.1}",
                what,
                rows,
                secs,
                rate,
                if limit > 0.0 { rate / limit } else { 0.0 },
                round_trips(p),
                p.transactions,
                p.wal_bytes,
                p.server_cpu_us
                    .map(|c| format!("{c:.1}"))
                    .unwrap_or_else(|| "n/a".into()),
                p.client_cpu_us
            );
        };
        if let Some(v) = &self.vantage {
            line(
                &v.what,
                v.rows,
                v.elapsed.as_secs_f64(),
                v.rate(),
                &v.per_event,
            );
        }
        for l in [&self.crash_safe, &self.crash_safe_own, &self.floor]
            .into_iter()
            .flatten()
        {
            line(
                &l.what,
                l.rows,
                l.elapsed.as_secs_f64(),
                l.rate(),
                &l.per_event,
            );
        }
        f.write_str(&table)?;
        if let Some(v) = &self.vantage {
            writeln!(
                f,
                "vantage: apply p50/p99 {:.3}/{:.3} ms, claim round p50/p99 {:.2}/{:.2} ms (daemon histograms, interpolated), peak RSS {:.1} MiB, cooldown cache {} entries",
                v.apply.p50_ms,
                v.apply.p99_ms,
                v.claim.p50_ms,
                v.claim.p99_ms,
                v.peak_rss_kib as f64 / 1024.0,
                v.cooldown_entries
            )?;
            writeln!(
                f,
                "vantage: read model checked: {} rows applied, {} twice, {} out of order, {} left",
                v.check.applied, v.check.duplicates, v.check.out_of_order, v.check.remaining
            )?;
        }
        for check in &self.checks {
            writeln!(f)?;
            writeln!(f, "check {}:", check.name)?;
            for d in &check.details {
                writeln!(f, "  {d}")?;
            }
            for r in &check.ratios {
                match r.target {
                    Some(t) => writeln!(
                        f,
                        "  ratio {}: {:.2} (target {}: {})",
                        r.label,
                        r.value,
                        t.describe(),
                        if t.holds(r.value) { "holds" } else { "MISSED" }
                    )?,
                    None => writeln!(f, "  ratio {}: {:.2}", r.label, r.value)?,
                }
            }
        }
        let plans: Vec<&(String, String)> = self.checks.iter().flat_map(|c| &c.plans).collect();
        if !plans.is_empty() {
            writeln!(f)?;
            writeln!(f, "query plans:")?;
            for (title, plan) in plans {
                writeln!(f, "-- {title}")?;
                for l in plan.lines() {
                    writeln!(f, "   {l}")?;
                }
            }
        }
        writeln!(f)?;
        if self.rounds.len() > 1 {
            let list: Vec<String> = self.rounds.iter().map(|r| format!("{r:.2}")).collect();
            writeln!(
                f,
                "rounds (drain/limit, in run order): {}; the median round is reported",
                list.join(", ")
            )?;
        }
        writeln!(f, "limit: {:.0}", self.limit_rate())?;
        writeln!(f, "vantage: {:.0}", self.vantage_rate())?;
        write!(f, "drain/limit ratio: {:.2}", self.ratio())
    }
}
