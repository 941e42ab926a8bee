//! Measurements: latency percentiles (from samples, or from the daemon's own histograms),
//! counter deltas (round trips, transactions, WAL) and the process's resident memory.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::store::bench::{BenchStore, RunCounters};
use crate::store::StoreError;
use crate::telemetry::metrics as m;

/// Percentiles of a set of samples, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Percentiles {
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
}

/// The nearest-rank percentile `q` (0..=1) of `samples` (sorted in place).
pub fn percentile(samples: &mut [Duration], q: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.sort_unstable();
    let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
    samples[rank - 1]
}

/// p50 and p99 of `samples`.
pub fn percentiles(samples: &mut [Duration]) -> Percentiles {
    Percentiles {
        p50_ms: percentile(samples, 0.5).as_secs_f64() * 1e3,
        p99_ms: percentile(samples, 0.99).as_secs_f64() * 1e3,
    }
}

/// A histogram as the Prometheus exposition shows it: cumulative counts per upper bound
/// (summed over label sets).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    /// Upper bound (seconds) → cumulative count; `f64::INFINITY` for `+Inf`.
    buckets: Vec<(f64, f64)>,
}

impl Histogram {
    /// The buckets of metric `name` in Prometheus text, summed over its label sets.
    pub fn parse(text: &str, name: &str) -> Histogram {
        let prefix = format!("{name}_bucket");
        let mut sums: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(&prefix) else {
                continue;
            };
            let Some((labels, value)) = rest.rsplit_once(' ') else {
                continue;
            };
            let Some(le) = labels
                .split("le=\"")
                .nth(1)
                .and_then(|s| s.split('"').next())
            else {
                continue;
            };
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                match le.parse::<f64>() {
                    Ok(b) => b,
                    Err(_) => continue,
                }
            };
            let count: f64 = value.trim().parse().unwrap_or(0.0);
            let entry = sums.entry(bound.to_bits()).or_insert((bound, 0.0));
            entry.1 += count;
        }
        let mut buckets: Vec<(f64, f64)> = sums.into_values().collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Histogram { buckets }
    }

    /// This histogram minus an earlier reading of the same one.
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let buckets = self
            .buckets
            .iter()
            .map(|&(bound, count)| {
                let before = earlier
                    .buckets
                    .iter()
                    .find(|(b, _)| *b == bound)
                    .map(|(_, c)| *c)
                    .unwrap_or(0.0);
                (bound, (count - before).max(0.0))
            })
            .collect();
        Histogram { buckets }
    }

    /// Observations counted.
    pub fn count(&self) -> f64 {
        self.buckets.last().map(|b| b.1).unwrap_or(0.0)
    }

    /// The quantile `q`, interpolated linearly inside its bucket (as Prometheus'
    /// `histogram_quantile` does), in seconds; `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut lower_bound = 0.0;
        let mut lower_count = 0.0;
        for &(bound, count) in &self.buckets {
            if count >= rank {
                if bound.is_infinite() {
                    return Some(lower_bound);
                }
                let in_bucket = count - lower_count;
                let fraction = if in_bucket > 0.0 {
                    (rank - lower_count) / in_bucket
                } else {
                    1.0
                };
                return Some(lower_bound + (bound - lower_bound) * fraction);
            }
            lower_bound = bound;
            lower_count = count;
        }
        Some(lower_bound)
    }

    /// p50 and p99 in milliseconds (zero without observations).
    pub fn percentiles(&self) -> Percentiles {
        Percentiles {
            p50_ms: self.quantile(0.5).unwrap_or(0.0) * 1e3,
            p99_ms: self.quantile(0.99).unwrap_or(0.0) * 1e3,
        }
    }
}

/// The sum of a counter over its label sets (optionally only those with `label_filter` in
/// their label text), from Prometheus text.
pub fn counter_sum(text: &str, name: &str, label_filter: Option<&str>) -> f64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .map(|rest| rest.starts_with('{') || rest.starts_with(' '))
                .unwrap_or(false)
        })
        .filter(|l| label_filter.map(|f| l.contains(f)).unwrap_or(true))
        .filter_map(|l| {
            l.rsplit_once(' ')
                .and_then(|(_, v)| v.trim().parse::<f64>().ok())
        })
        .sum()
}

/// The daemon's own metrics, read in this process (no database round trip).
#[derive(Clone, Debug)]
pub struct DaemonMetrics {
    handle: metrics_exporter_prometheus::PrometheusHandle,
}

/// A reading of the daemon's metrics.
#[derive(Clone, Debug, Default)]
pub struct MetricsReading {
    /// The exposition text.
    pub text: String,
}

impl MetricsReading {
    /// Events applied so far (all perspectives, or those whose label contains `filter`).
    pub fn applied(&self, filter: Option<&str>) -> f64 {
        counter_sum(&self.text, m::EVENTS_APPLIED_TOTAL, filter)
            + counter_sum(&self.text, m::COOLDOWN_SKIPS_TOTAL, filter)
    }

    /// Rows moved to the dead letters so far.
    pub fn dead_lettered(&self, filter: Option<&str>) -> f64 {
        counter_sum(&self.text, m::DEAD_LETTER_MOVES_TOTAL, filter)
    }

    /// The apply-duration histogram.
    pub fn apply(&self) -> Histogram {
        Histogram::parse(&self.text, m::APPLY_DURATION_SECONDS)
    }

    /// The claim-duration histogram.
    pub fn claim(&self) -> Histogram {
        Histogram::parse(&self.text, m::CLAIM_DURATION_SECONDS)
    }
}

impl DaemonMetrics {
    /// The process's recorder (installed on first use; the daemon uses the same one).
    pub fn install() -> Result<DaemonMetrics, crate::telemetry::recorder::TelemetryError> {
        Ok(DaemonMetrics {
            handle: crate::telemetry::recorder::install()?,
        })
    }

    /// Reads every metric now.
    pub fn read(&self) -> MetricsReading {
        MetricsReading {
            text: self.handle.render(),
        }
    }
}

/// What one run cost the database, per event.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PerEvent {
    /// Top-level statements (≈ round trips) per event, when pg_stat_statements is loaded.
    pub round_trips: Option<f64>,
    /// Transactions per event.
    pub transactions: f64,
    /// WAL bytes per event.
    pub wal_bytes: f64,
    /// CPU time of the database server per event, microseconds, when the server runs on this
    /// machine (all its processes: backends, autovacuum, WAL writer).
    pub server_cpu_us: Option<f64>,
    /// CPU time of this process per event, microseconds (the daemons the bench runs, or the
    /// limit's clients, and the harness).
    pub client_cpu_us: f64,
}

/// What a run is measured from: the database's counters and the CPU time used so far.
#[derive(Clone, Copy, Debug)]
pub struct Counters {
    /// Transactions, WAL, statements.
    pub db: RunCounters,
    /// CPU time of the server so far, milliseconds (see [`server_cpu_ms`]).
    pub server_cpu_ms: Option<f64>,
    /// CPU time of this process so far, milliseconds.
    pub client_cpu_ms: f64,
}

impl Counters {
    /// Reads them now.
    pub async fn read(db: &BenchStore, with_statements: bool) -> Result<Counters, StoreError> {
        let counters = db.counters(with_statements).await?;
        Ok(Counters {
            server_cpu_ms: server_cpu_ms(counters.backend_pid),
            client_cpu_ms: process_cpu_ms(),
            db: counters,
        })
    }
}

impl PerEvent {
    /// From counters read before and after a run of `events` events; `own_transactions` is the
    /// number of transactions the harness itself ran in between (its progress reads).
    pub fn between(
        before: &Counters,
        after: &Counters,
        events: u64,
        own_transactions: i64,
    ) -> PerEvent {
        let n = events.max(1) as f64;
        let (b, a) = (&before.db, &after.db);
        PerEvent {
            round_trips: match (b.statements, a.statements) {
                (Some(b), Some(a)) => Some((a - b) as f64 / n),
                _ => None,
            },
            transactions: (a.transactions - b.transactions - own_transactions).max(0) as f64 / n,
            wal_bytes: (a.wal_bytes - b.wal_bytes) as f64 / n,
            server_cpu_us: match (before.server_cpu_ms, after.server_cpu_ms) {
                (Some(b), Some(a)) => Some((a - b).max(0.0) * 1e3 / n),
                _ => None,
            },
            client_cpu_us: (after.client_cpu_ms - before.client_cpu_ms).max(0.0) * 1e3 / n,
        }
    }
}

/// CPU time (user + system) of this process so far, milliseconds.
pub fn process_cpu_ms() -> f64 {
    // SAFETY: getrusage writes into the struct we pass and reads nothing else.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0.0;
    }
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    ms(usage.ru_utime) + ms(usage.ru_stime)
}

/// CPU time used so far by the PostgreSQL server that `backend_pid` belongs to, milliseconds:
/// its postmaster's own and reaped children's time plus that of its live children, read from
/// `/proc`. `None` when the server is not on this machine (or not visible to us). Wall-clock
/// rates on a shared machine wander with its other load; CPU time per row much less so.
pub fn server_cpu_ms(backend_pid: i32) -> Option<f64> {
    // (pid, ppid, utime + stime, cutime + cstime), in clock ticks
    fn stat(pid: &str) -> Option<(i64, i64, i64, i64)> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The command name is in parentheses and may hold spaces: fields start after the last.
        let rest = &text[text.rfind(')')? + 1..];
        let f: Vec<i64> = rest
            .split_whitespace()
            .skip(1)
            .map(|v| v.parse().unwrap_or(0))
            .collect();
        // after the state: ppid is field 0 here, utime 10, stime 11, cutime 12, cstime 13
        Some((
            pid.parse().ok()?,
            *f.first()?,
            f.get(10)? + f.get(11)?,
            f.get(12)? + f.get(13)?,
        ))
    }
    let (_, postmaster, _, _) = stat(&backend_pid.to_string())?;
    let (_, _, own, reaped) = stat(&postmaster.to_string())?;
    let mut ticks = own + reaped;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if let Some((_, ppid, time, _)) = stat(pid) {
            if ppid == postmaster {
                ticks += time;
            }
        }
    }
    // SAFETY: sysconf only reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some(ticks as f64 * 1e3 / hz)
}

/// Resident memory of this process, KiB: (current VmRSS, peak VmHWM).
pub fn rss_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Resets the peak resident memory (VmHWM) to the current size, so the next reading is the
/// peak of what follows (Linux: `echo 5 > /proc/self/clear_refs`). Best effort.
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut s: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&mut s, 0.5), Duration::from_millis(50));
        assert_eq!(percentile(&mut s, 0.99), Duration::from_millis(99));
        assert_eq!(percentile(&mut [], 0.5), Duration::ZERO);
    }

    #[test]
    fn histogram_quantiles_interpolate_and_subtract() {
        let text = "\
x_bucket{perspective=\"a\",le=\"0.001\"} 10
x_bucket{perspective=\"a\",le=\"0.01\"} 90
x_bucket{perspective=\"a\",le=\"+Inf\"} 100
x_bucket{perspective=\"b\",le=\"0.001\"} 0
x_bucket{perspective=\"b\",le=\"0.01\"} 0
x_bucket{perspective=\"b\",le=\"+Inf\"} 0
x_sum 1
";
        let h = Histogram::parse(text, "x");
        assert_eq!(h.count(), 100.0);
        let p50 = h.quantile(0.5).unwrap();
        assert!((p50 - 0.0055).abs() < 1e-9, "{p50}");
        let later = Histogram::parse(
            &text.replace("} 100", "} 200").replace("} 90", "} 190"),
            "x",
        );
        assert_eq!(later.since(&h).count(), 100.0);
        assert_eq!(Histogram::default().quantile(0.5), None);
    }

    #[test]
    fn counters_sum_over_labels() {
        let text = "c_total{perspective=\"a\"} 3\nc_total{perspective=\"b\"} 4\nc_total_other 9\n";
        assert_eq!(counter_sum(text, "c_total", None), 7.0);
        assert_eq!(counter_sum(text, "c_total", Some("\"b\"")), 4.0);
    }
}
