//! The scale and shape checks: each seeds its own state, measures, and reports one ratio (with
//! the target docs/operations.md, "Performance", sets when it has one). One file per check.

mod claim_scale;
mod claim_timing;
mod dead_letter;
mod dead_tuples;
mod held_append;
mod latency;
mod parked;
mod perspectives;
mod producers;
mod retries;
mod rss;
mod shapes;
mod statements;
mod traces;
mod versions;

use super::drain::DrainRun;
use super::{Bench, BenchError, Check};

/// A target a ratio should meet.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Target {
    /// The ratio should be at least this.
    AtLeast(f64),
    /// The ratio should be at most this.
    AtMost(f64),
}

impl Target {
    /// Whether `ratio` meets it.
    pub fn holds(self, ratio: f64) -> bool {
        match self {
            Target::AtLeast(t) => ratio >= t,
            Target::AtMost(t) => ratio <= t,
        }
    }

    /// `≥ 0.80` / `≤ 1.50`.
    pub fn describe(self) -> String {
        match self {
            Target::AtLeast(t) => format!(">= {t:.2}"),
            Target::AtMost(t) => format!("<= {t:.2}"),
        }
    }
}

/// One ratio of a check.
#[derive(Clone, Debug, PartialEq)]
pub struct Ratio {
    /// What is divided by what.
    pub label: String,
    /// The value.
    pub value: f64,
    /// The target, if docs/operations.md ("Performance") sets one.
    pub target: Option<Target>,
}

/// What one check measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CheckOutcome {
    /// The check's name.
    pub name: String,
    /// Lines of figures behind the ratios.
    pub details: Vec<String>,
    /// The ratios.
    pub ratios: Vec<Ratio>,
    /// Query plans worth keeping (title, EXPLAIN text).
    pub plans: Vec<(String, String)>,
}

impl CheckOutcome {
    pub(super) fn new(check: Check) -> Self {
        CheckOutcome {
            name: check.name().into(),
            ..Default::default()
        }
    }

    pub(super) fn ratio(&mut self, label: impl Into<String>, value: f64, target: Option<Target>) {
        self.ratios.push(Ratio {
            label: label.into(),
            value,
            target,
        });
    }

    pub(super) fn drain_line(&mut self, run: &DrainRun) {
        self.details.push(format!(
            "{}: {} rows in {:.2} s = {:.0} rows/s (apply p99 {:.2} ms, claim p99 {:.1} ms)",
            run.what,
            run.rows,
            run.elapsed.as_secs_f64(),
            run.rate(),
            run.apply.p99_ms,
            run.claim.p99_ms
        ));
    }
}

/// Runs one check; `main` is the main vantage drain of the run (the reference of some ratios).
pub async fn run(bench: &Bench, check: Check, main: &DrainRun) -> Result<CheckOutcome, BenchError> {
    match check {
        Check::DeadLetter => dead_letter::run(bench).await,
        Check::Retries => retries::run(bench).await,
        Check::Parked => parked::run(bench).await,
        Check::Perspectives => perspectives::run(bench, main).await,
        Check::Shapes => shapes::run(bench, main).await,
        Check::Latency => latency::run(bench).await,
        Check::Rss => rss::run(bench, main).await,
        Check::ClaimScale => claim_scale::run(bench).await,
        Check::DeadTuples => dead_tuples::run(bench).await,
        Check::Producers => producers::run(bench).await,
        Check::HeldAppend => held_append::run(bench).await,
        Check::Versions => versions::run(bench).await,
        Check::Statements => statements::run(bench).await,
        Check::Traces => traces::run(bench).await,
    }
}

/// A tenth of the main run, at least 100 and at most 20 000 events.
pub(super) fn small_n(bench: &Bench) -> u64 {
    (bench.config.events / 10).clamp(100, 20_000)
}

/// The payload size of the run's events.
pub(super) fn payload(bench: &Bench) -> u32 {
    bench.config.payload_bytes
}
