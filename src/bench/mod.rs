//! `vantage bench`: how fast the real daemon drains a backlog, against the physical limit of
//! the same database effects issued as directly as SQL allows, in one run (docs/operations.md,
//! "Performance").
//!
//! One file per concern:
//! - [`seed`]: the seeded state (events over streams into perspectives), re-created
//!   identically before every run;
//! - [`drain`]: the drain by the real daemon ([`crate::daemon::DaemonBuilder`]) with the
//!   trivial SQL perspective (one upsert per event);
//! - [`limit`]: the physical limit, crash-safe shape and single-transaction floor;
//! - [`checks`]: the scale and shape checks, each a ratio;
//! - [`cores`]: a core of its own for the producers check's producer;
//! - [`measure`]: percentiles, round trips, transactions, WAL, resident memory;
//! - [`progress`]: the progress bar (stderr, only on a terminal);
//! - [`report`]: the table and the closing three lines.
//!
//! Every SQL statement lives in `crate::store::bench`.

pub mod checks;
pub mod cores;
pub mod drain;
pub mod limit;
pub mod measure;
pub mod progress;
pub mod report;
pub mod seed;

use std::time::Duration;

use crate::config::{DatabaseUrl, Settings};
use crate::store::bench::{BenchStore, BENCH_SCHEMA};
use crate::store::{Store, StoreError, StoreOptions};

use self::measure::DaemonMetrics;
use self::progress::Progress;

/// What to measure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchConfig {
    /// Events seeded (N).
    pub events: u64,
    /// Streams they are spread over (S).
    pub streams: u64,
    /// Perspectives each event fans out to (P).
    pub perspectives: u32,
    /// Consumer loops per daemon, and connections of the limit runs per instance (K).
    pub consumers: usize,
    /// Rows per claim (`worker.batch_size`), and per batch of the limit runs.
    pub batch_size: u32,
    /// Bytes of padding in each event's payload.
    pub payload_bytes: u32,
    /// Daemons started side by side (in this process, each with its own pool and instance id).
    pub instances: usize,
    /// The scale and shape checks to run.
    pub checks: Vec<Check>,
    /// The large backlog of the claim-latency check.
    pub large_backlog: u64,
    /// The unprunable dead tuples of the dead-tuple check.
    pub dead_tuples: u64,
    /// Give up on one drain after this long.
    pub drain_timeout: Duration,
    /// Rounds of (main drain, crash-safe limit); the median round by ratio is reported.
    pub rounds: u32,
    /// How long to wait for sessions to flush their statistics before and after a run
    /// (PostgreSQL ≥ 15 flushes at most once a second; shorter waits make the transaction
    /// counts approximate, which only a smoke test wants).
    pub settle: Duration,
    /// Whether the server's processes are ours to re-pin to cores (a throwaway server started
    /// for the run): the producers check then also measures a producer on a core of its own.
    pub own_server: bool,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            events: 200_000,
            streams: 2_000,
            perspectives: 1,
            consumers: 4,
            batch_size: 500,
            payload_bytes: 64,
            instances: 1,
            checks: Check::ALL.to_vec(),
            rounds: 1,
            large_backlog: 5_000_000,
            dead_tuples: 1_000_000,
            drain_timeout: Duration::from_secs(600),
            settle: Duration::from_millis(1_200),
            own_server: false,
        }
    }
}

/// A scale or shape check (deliverable 4 of the benchmark issue).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Check {
    /// Claim latency at a 5 000 000-row backlog against a 10 000-row one.
    ClaimScale,
    /// Claim latency with unprunable dead tuples (an old snapshot held open) against without.
    DeadTuples,
    /// A healthy perspective beside 2 000 parked lanes, against it alone.
    Parked,
    /// 50 perspectives against one.
    Perspectives,
    /// 200 streams of 1 000 events, and 200 000 streams of 1 event, against the main shape.
    Shapes,
    /// Dead-lettering N poison rows against applying N healthy ones.
    DeadLetter,
    /// Retrying N poison rows to the attempt limit, per failed claim, against applying N
    /// healthy ones, one row per stream (a requeue's shape).
    Retries,
    /// The perspective's statement as a data-modifying `WITH`, compiled once per session and
    /// through `EXECUTE`, against the same upsert written plainly.
    Statements,
    /// Append → applied p50/p99 at a steady 1 000 events/s.
    Latency,
    /// Resident memory with the cooldown cache full.
    Rss,
    /// A producer's append latency while the daemon retries failing heads of its streams, while
    /// a rebuild re-queues their history and while an operator requeues their dead letters,
    /// against the same appends with vantage idle; measured sharing the cores and, on a
    /// throwaway server, with the producer on a core of its own.
    Producers,
    /// The drain while a producer holds an append to 300 streams with work open, against the
    /// same drain without it; then how soon the held events apply after the commit.
    HeldAppend,
    /// A versioned perspective: backfill against the drain, the live version's latency while
    /// a new one backfills, cutover and rollback time.
    Versions,
    /// The drain with traces on (every event traced, sampled at 100 %), against it with traces
    /// off.
    Traces,
}

impl Check {
    /// Every check, in the order they run.
    pub const ALL: [Check; 14] = [
        Check::DeadLetter,
        Check::Retries,
        Check::Statements,
        Check::Parked,
        Check::Perspectives,
        Check::Shapes,
        Check::Latency,
        Check::Rss,
        Check::ClaimScale,
        Check::DeadTuples,
        Check::Producers,
        Check::HeldAppend,
        Check::Versions,
        Check::Traces,
    ];

    /// The command-line spelling.
    pub fn name(self) -> &'static str {
        match self {
            Check::ClaimScale => "claim-scale",
            Check::DeadTuples => "dead-tuples",
            Check::Parked => "parked",
            Check::Perspectives => "perspectives",
            Check::Shapes => "shapes",
            Check::DeadLetter => "dead-letter",
            Check::Retries => "retries",
            Check::Statements => "statements",
            Check::Latency => "latency",
            Check::Rss => "rss",
            Check::Producers => "producers",
            Check::HeldAppend => "held-append",
            Check::Versions => "versions",
            Check::Traces => "traces",
        }
    }

    /// Parses one spelling.
    pub fn parse(s: &str) -> Option<Check> {
        Check::ALL.into_iter().find(|c| c.name() == s)
    }
}

/// Why a benchmark could not finish.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A database statement failed.
    #[error("database: {0}")]
    Store(#[from] StoreError),
    /// The daemon could not start or stop.
    #[error("the daemon: {0}")]
    Daemon(#[from] crate::daemon::DaemonError),
    /// A drain did not finish in time.
    #[error("{what}: {done} of {expected} rows done after {waited:?}; giving up")]
    Timeout {
        /// Which run.
        what: String,
        /// Rows done.
        done: u64,
        /// Rows expected.
        expected: u64,
        /// How long we waited.
        waited: Duration,
    },
    /// The metrics recorder could not be installed.
    #[error("{0}")]
    Metrics(#[from] crate::telemetry::recorder::TelemetryError),
    /// A drain broke a rule it measures (exactly once, ordering).
    #[error("{0}")]
    Incorrect(String),
}

/// The benchmark's shared state: the database, the daemon's settings, the metrics, the bar.
pub struct Bench {
    /// The harness's statements.
    pub db: BenchStore,
    /// Options of the daemons' own connections.
    pub daemon_options: StoreOptions,
    /// Settings every daemon starts from (perspectives are added per run).
    pub base_settings: Settings,
    /// The daemon's metrics, read in-process.
    pub metrics: DaemonMetrics,
    /// The progress bar.
    pub progress: Progress,
    /// What to measure.
    pub config: BenchConfig,
    /// Whether `pg_stat_statements` can be read (round trips per event).
    pub statement_stats: bool,
}

impl Bench {
    /// Connects to `url`, recreates the bench schema, and checks for `pg_stat_statements`.
    pub async fn connect(
        url: &str,
        config: BenchConfig,
        progress: Progress,
    ) -> Result<Bench, BenchError> {
        let mut options = StoreOptions::for_url(url);
        options.schema = BENCH_SCHEMA.into();
        options.application_name = "vantage bench".into();
        options.max_connections = (config.consumers * config.instances + 4) as u32;
        let db = BenchStore::new(Store::connect(&options).await?);
        db.recreate_schema().await?;
        let statement_stats = db.enable_statement_stats().await;

        let mut base_settings = Settings::default();
        base_settings.database.url = Some(DatabaseUrl::new(url.to_string()));
        base_settings.database.schema = BENCH_SCHEMA.into();
        base_settings.database.max_connections = (config.consumers + 4) as u32;
        base_settings.worker.consumers = config.consumers;
        base_settings.worker.batch_size = config.batch_size;
        let mut daemon_options = StoreOptions::from_settings(&base_settings.database);
        daemon_options.application_name = "vantage bench daemon".into();

        Ok(Bench {
            db,
            daemon_options,
            base_settings,
            metrics: DaemonMetrics::install()?,
            progress,
            config,
            statement_stats,
        })
    }

    /// Closes the harness's connections.
    pub async fn close(&self) {
        self.db.store().close().await;
    }
}

/// Runs the whole benchmark against `url` and returns the report.
pub async fn run(
    url: &str,
    config: BenchConfig,
    progress: Progress,
) -> Result<report::Report, BenchError> {
    let bench = Bench::connect(url, config, progress).await?;
    let result = run_all(&bench).await;
    bench.progress.finish();
    bench.close().await;
    result
}

async fn run_all(bench: &Bench) -> Result<report::Report, BenchError> {
    let config = &bench.config;
    let mut report = report::Report::new(config.clone(), bench.statement_stats);
    report.server = bench.db.server_settings().await?;

    let main = seed::Seed::main(config);
    let names = main.perspective_names();

    // The main pair, alternating, as many rounds as asked; the round with the median ratio is
    // the one reported (and the one the checks compare against).
    let mut pairs = Vec::new();
    for round in 0..config.rounds.max(1) {
        if config.rounds > 1 {
            bench
                .progress
                .note(&format!("round {} of {}", round + 1, config.rounds));
        }
        seed::apply(bench, &main).await?;
        let vantage = drain::drain(bench, &main, "vantage drain").await?;
        seed::apply(bench, &main).await?;
        let limit = limit::crash_safe(bench, &names, main.rows()).await?;
        pairs.push((vantage, limit));
    }
    let ratios: Vec<f64> = pairs
        .iter()
        .map(|(v, l)| v.rate() / l.rate().max(1e-9))
        .collect();
    let mut order: Vec<usize> = (0..pairs.len()).collect();
    order.sort_by(|a, b| ratios[*a].total_cmp(&ratios[*b]));
    let (vantage, limit) = pairs.swap_remove(order[order.len() / 2]);
    report.rounds = ratios;
    report.vantage = Some(vantage.clone());
    report.crash_safe = Some(limit);

    seed::apply(bench, &main).await?;
    report.crash_safe_own = Some(limit::crash_safe_on_own_table(bench, &names, main.rows()).await?);
    seed::apply(bench, &main).await?;
    report.floor = Some(limit::floor(bench, &names, main.rows()).await?);

    for check in config.checks.iter().copied() {
        bench.progress.note(&format!("check {}", check.name()));
        let outcome = checks::run(bench, check, &vantage).await?;
        report.checks.push(outcome);
    }
    Ok(report)
}
