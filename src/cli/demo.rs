//! `vantage demo`: the newcomer's first command (SPEC §6).
//!
//! 1. Uses the configured database, or starts a [`ThrowawayPostgres`] when none is configured.
//! 2. Loads the demo perspectives from `config/demo.toml` (or the copy built into the binary),
//!    migrates, creates the read model tables in schema `demo` (idempotent).
//! 3. Starts the daemon in-process, with HTTP on `http.listen` (or a free port when it is busy).
//! 4. Appends a deterministic sample of orders — one stream per order, expected versions
//!    honoured — including a few `OrderPaid` events whose amount `revenue_by_day` cannot parse.
//! 5. Shows live progress on stderr until nothing is pending and the poison events are
//!    dead-lettered.
//! 6. Prints the dead letters, a few rows of the read model, the metrics URL and `vantage dlq`
//!    commands to try (stdout), then keeps running until Ctrl-C (`--once`: exits).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, SecondsFormat, Utc};
use clap::Args;
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{exit, output, GlobalArgs};
use crate::config::{DatabaseUrl, HttpSettings, LogSettings, Settings};
use crate::daemon::DaemonBuilder;
use crate::store::{DeadLetter, NewEvent, Store, StoreError, StoreOptions};
use crate::throwaway::ThrowawayPostgres;

/// Where the demo configuration is looked for, relative to the working directory.
pub const DEMO_CONFIG_PATH: &str = "config/demo.toml";
/// The copy built into the binary, used when [`DEMO_CONFIG_PATH`] is not there.
const EMBEDDED_CONFIG: &str = include_str!("../../config/demo.toml");

/// The read model tables of `config/demo.toml`. Idempotent, so the demo can run again on the
/// same database.
const READ_MODEL_DDL: &str = r#"
CREATE SCHEMA IF NOT EXISTS demo;
CREATE TABLE IF NOT EXISTS demo.order_summary (
    order_id     uuid PRIMARY KEY,
    customer_id  uuid NOT NULL,
    status       text NOT NULL,
    items        int NOT NULL,
    total        numeric(12,2) NOT NULL,
    currency     text NOT NULL,
    placed_at    timestamptz NOT NULL,
    paid_at      timestamptz,
    shipped_at   timestamptz,
    carrier      text,
    delivered_at timestamptz,
    cancelled_at timestamptz,
    last_version int NOT NULL
);
CREATE TABLE IF NOT EXISTS demo.revenue_by_day (
    day      date NOT NULL,
    currency text NOT NULL,
    orders   int NOT NULL DEFAULT 0,
    revenue  numeric(14,2) NOT NULL DEFAULT 0,
    refunds  numeric(14,2) NOT NULL DEFAULT 0,
    PRIMARY KEY (day, currency)
);
CREATE TABLE IF NOT EXISTS demo.customer_orders (
    customer_id    uuid PRIMARY KEY,
    orders         int NOT NULL,
    cancelled      int NOT NULL DEFAULT 0,
    first_order_at timestamptz NOT NULL,
    last_order_at  timestamptz NOT NULL
);
"#;

/// How many `OrderPaid` events of the sample carry an amount no statement can parse.
pub const POISON_EVENTS: usize = 3;
/// The sample is the same on every run (its ids aside).
const SEED: u64 = 0x7661_6e74_6167_6521;
/// Concurrent producers appending the sample.
const PRODUCERS: usize = 8;
/// How often the drain is checked (and the progress line refreshed on a terminal).
const TICK: Duration = Duration::from_millis(250);
/// How often a progress line is printed when stderr is not a terminal.
const PLAIN_PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// Options of `vantage demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Exit after the drain instead of running until Ctrl-C.
    #[arg(long)]
    pub once: bool,
    /// Orders in the sample (one stream each, 2 to 4 events).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(10..=1_000_000))]
    pub orders: u32,
    /// Customers placing them.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub customers: u32,
    /// Give up (exit 1) if the sample is not drained within this time.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub timeout: Duration,
}

/// Runs `vantage demo`. Exit 0 after the demo (and, without `--once`, after Ctrl-C); 1 when
/// the drain fails or times out; 2 when no database is configured and none can be started;
/// 69 when the configured database is unreachable; 78 for invalid configuration.
pub async fn run(global: &GlobalArgs, args: DemoArgs) -> i32 {
    let demo = match DemoConfig::load(global) {
        Ok(d) => d,
        Err(message) => {
            eprintln!("vantage demo: {message}");
            return exit::CONFIG;
        }
    };
    let tty = std::io::stderr().is_terminal();
    if let Err(message) = init_logging(&demo.settings.log, tty) {
        eprintln!("vantage demo: {message}");
        return exit::CONFIG;
    }
    let interrupt = match watch_signals(tty) {
        Ok(token) => token,
        Err(e) => {
            eprintln!("vantage demo: cannot install the signal handlers: {e}");
            return exit::FAILURE;
        }
    };

    let mut demo = demo;
    let server = if demo.settings.database.url.is_none() {
        eprint!(
            "No database configured (set DATABASE_URL to use yours): starting a throwaway PostgreSQL... "
        );
        let _ = std::io::stderr().flush();
        match tokio::task::spawn_blocking(ThrowawayPostgres::start).await {
            Ok(Ok(server)) => {
                eprintln!(
                    "ready on 127.0.0.1:{}; it is removed when the demo exits.",
                    server.port()
                );
                demo.settings.database.url = Some(DatabaseUrl::new(server.url()));
                demo.database = DatabaseSource::Throwaway(server.url());
                Some(server)
            }
            Ok(Err(e)) => {
                eprintln!("failed.");
                eprintln!("vantage demo: {e}");
                return exit::USAGE;
            }
            Err(e) => {
                eprintln!("failed.");
                eprintln!("vantage demo: the PostgreSQL launcher crashed: {e}");
                return exit::FAILURE;
            }
        }
    } else {
        None
    };

    let code = if interrupt.is_cancelled() {
        if args.once {
            exit::FAILURE
        } else {
            exit::OK
        }
    } else {
        run_demo(&demo, &args, &interrupt, tty).await
    };

    if let Some(server) = server {
        // Stopping the server waits for it to exit: keep that off the async workers.
        let _ = tokio::task::spawn_blocking(move || drop(server)).await;
    }
    code
}

// ---------------------------------------------------------------------------------------------
// Configuration

/// Where the database of the demo comes from (decides how the printed commands reach it).
#[derive(Debug, Clone)]
enum DatabaseSource {
    /// `--database-url`.
    Flag,
    /// `DATABASE_URL` or `VANTAGE__DATABASE__URL`: the printed commands inherit it.
    Environment,
    /// A configuration file.
    File,
    /// The throwaway server, at this URL (no password: `trust` authentication).
    Throwaway(String),
}

struct DemoConfig {
    settings: Settings,
    /// The demo configuration file, when it was read from disk (not the built-in copy).
    file: Option<PathBuf>,
    database: DatabaseSource,
}

impl DemoConfig {
    /// The demo's perspectives, worker timings and log level from `config/demo.toml`; the
    /// database and HTTP settings from the usual layers (flags, environment, config file).
    fn load(global: &GlobalArgs) -> Result<DemoConfig, String> {
        let base = global.load_settings().map_err(|e| e.to_string())?;
        let path = Path::new(DEMO_CONFIG_PATH);
        let (text, file) = if path.is_file() {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            (text, Some(path.to_path_buf()))
        } else {
            (EMBEDDED_CONFIG.to_owned(), None)
        };
        let label = match &file {
            Some(p) => p.display().to_string(),
            None => format!("{DEMO_CONFIG_PATH} (built-in copy)"),
        };
        let mut settings = Settings::from_toml_str(&text).map_err(|e| format!("{label}: {e}"))?;
        if settings.perspectives.is_empty() {
            return Err(format!("{label}: defines no [[perspectives]]"));
        }
        if settings.worker.max_perspective_event_attempts.is_none() {
            return Err(format!(
                "{label}: worker.max_perspective_event_attempts = \"off\" would retry the \
                 demo's poison events forever; set a number"
            ));
        }

        let url = base.database.url.clone().or(settings.database.url.take());
        settings.database = base.database;
        settings.database.url = url;
        if base.http != HttpSettings::default() {
            settings.http = base.http;
        }

        let from_env = ["DATABASE_URL", "VANTAGE__DATABASE__URL"]
            .iter()
            .any(|v| std::env::var(v).is_ok_and(|s| !s.is_empty()));
        let database = if global.database_url.is_some() {
            DatabaseSource::Flag
        } else if from_env {
            DatabaseSource::Environment
        } else {
            DatabaseSource::File
        };
        Ok(DemoConfig {
            settings,
            file,
            database,
        })
    }

    fn perspective_names(&self) -> Vec<String> {
        self.settings
            .perspectives
            .iter()
            .map(|p| p.name.clone())
            .collect()
    }

    /// How many perspectives each event type fans out to.
    fn fan_out(&self) -> HashMap<String, u64> {
        let mut fan_out = HashMap::new();
        for event_type in EVENT_TYPES {
            let n = self
                .settings
                .perspectives
                .iter()
                .filter(|p| p.events.iter().any(|e| e == "*" || e == event_type))
                .count() as u64;
            fan_out.insert((*event_type).to_owned(), n);
        }
        fan_out
    }
}

// ---------------------------------------------------------------------------------------------
// Logging and signals

/// Logs on stderr, at `log.level` unless `RUST_LOG` is set, coloured only on a terminal and
/// without `NO_COLOR` (the daemon's own setup, [`crate::telemetry::logging`]). On a terminal
/// every log line first clears the progress line, which is redrawn at the next tick.
fn init_logging(log: &LogSettings, tty: bool) -> Result<(), String> {
    crate::telemetry::logging::init_with_writer(log, LogWriter { clear_line: tty }, tty)
        .map_err(|e| e.to_string())
}

#[derive(Clone, Copy)]
struct LogWriter {
    clear_line: bool,
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogLine;
    fn make_writer(&'a self) -> LogLine {
        LogLine {
            clear_line: self.clear_line,
        }
    }
}

struct LogLine {
    clear_line: bool,
}

impl std::io::Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut err = std::io::stderr().lock();
        if std::mem::take(&mut self.clear_line) {
            err.write_all(CLEAR_LINE.as_bytes())?;
        }
        err.write_all(buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// Carriage return and "erase the line".
const CLEAR_LINE: &str = "\r\x1b[2K";

/// Cancels the returned token on the first SIGINT or SIGTERM; a second one exits at once.
fn watch_signals(tty: bool) -> std::io::Result<CancellationToken> {
    use tokio::signal::unix::{signal, SignalKind};
    // Registered here, not in the task, so a Ctrl-C right away is already ours.
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        let lead = if tty { CLEAR_LINE } else { "" };
        eprintln!(
            "{lead}Stopping: shutting the daemon down gracefully (press Ctrl-C again to exit at once)."
        );
        cancel.cancel();
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        eprintln!("vantage demo: second signal, exiting at once.");
        // The throwaway server's exit hook still stops it and removes its directory.
        std::process::exit(exit::FAILURE);
    });
    Ok(token)
}

// ---------------------------------------------------------------------------------------------
// The demo

async fn run_demo(
    demo: &DemoConfig,
    args: &DemoArgs,
    interrupt: &CancellationToken,
    tty: bool,
) -> i32 {
    let settings = &demo.settings;
    let options = StoreOptions::from_settings(&settings.database);
    let store = match Store::connect(&options).await {
        Ok(store) => store,
        Err(e) => return store_failure("cannot connect to the database", &e),
    };
    let code = with_store(demo, args, interrupt, tty, &store, &options).await;
    store.close().await;
    code
}

async fn with_store(
    demo: &DemoConfig,
    args: &DemoArgs,
    interrupt: &CancellationToken,
    tty: bool,
    store: &Store,
    options: &StoreOptions,
) -> i32 {
    let settings = &demo.settings;
    match store.migrate().await {
        Ok(applied) if applied.is_empty() => eprintln!(
            "Schema \"{}\" on {} is up to date (no migration to apply).",
            store.schema(),
            store.target()
        ),
        Ok(applied) => {
            let list: Vec<String> = applied
                .iter()
                .map(|m| format!("{} {}", m.version, m.description))
                .collect();
            eprintln!(
                "Migrated schema \"{}\" on {}: applied {}.",
                store.schema(),
                store.target(),
                list.join(", ")
            );
        }
        Err(e) => return store_failure("migration failed", &e),
    }
    if let Err(e) = sqlx::raw_sql(READ_MODEL_DDL).execute(store.pool()).await {
        eprintln!("vantage demo: cannot create the read model tables in schema \"demo\": {e}");
        return exit::FAILURE;
    }
    let names = demo.perspective_names();
    eprintln!(
        "Read model tables ready in schema \"demo\"; perspectives: {}.",
        names.join(", ")
    );

    let listen = settings.http.listen;
    let (listener, http_addr) = match crate::telemetry::http::bind(listen).await {
        Ok(bound) => bound,
        Err(first) => match crate::telemetry::http::bind(SocketAddr::new(listen.ip(), 0)).await {
            Ok((listener, addr)) => {
                eprintln!("{listen} is not available ({first}); serving HTTP on {addr} instead.");
                (listener, addr)
            }
            Err(e) => {
                eprintln!("vantage demo: {e}");
                return exit::FAILURE;
            }
        },
    };

    let daemon = match DaemonBuilder::new(settings.clone())
        .store(store.clone())
        .http_listener(listener)
        .start()
        .await
    {
        Ok(daemon) => daemon,
        Err(e) => {
            eprintln!("vantage demo: the daemon could not start: {e}");
            return e.exit_code();
        }
    };
    eprintln!(
        "Daemon running in this process ({} consumer loop{}); metrics on http://{http_addr}/metrics",
        settings.worker.consumers,
        if settings.worker.consumers == 1 { "" } else { "s" }
    );

    // The producer is another application: its own connections.
    let producer_options = StoreOptions {
        max_connections: PRODUCERS as u32,
        ..options.clone()
    };
    let code = match Store::connect(&producer_options).await {
        Ok(producer) => {
            let code = produce_and_drain(demo, args, interrupt, tty, &producer, http_addr).await;
            producer.close().await;
            code
        }
        Err(e) => Some(store_failure("cannot connect the producer", &e)),
    };

    let code = match code {
        Some(code) => code,
        None => {
            // Finished: keep running until Ctrl-C unless --once.
            if !args.once {
                eprintln!("The daemon keeps running. Press Ctrl-C to stop.");
                interrupt.cancelled().await;
            }
            exit::OK
        }
    };
    if let Err(e) = daemon.shutdown().await {
        eprintln!("vantage demo: shutdown: {e}");
        return if code == exit::OK {
            e.exit_code()
        } else {
            code
        };
    }
    if code == exit::OK {
        eprintln!("Stopped.");
    }
    code
}

/// Appends the sample, drains it with progress, and prints the report. `None` when all went
/// well; otherwise the exit code.
async fn produce_and_drain(
    demo: &DemoConfig,
    args: &DemoArgs,
    interrupt: &CancellationToken,
    tty: bool,
    producer: &Store,
    http_addr: SocketAddr,
) -> Option<i32> {
    let names = demo.perspective_names();
    let baseline = match Snapshot::take(producer, &names).await {
        Ok(s) => s,
        Err(e) => return Some(store_failure("cannot read the work queue", &e)),
    };
    let sample = Sample::generate(args.orders as usize, args.customers as usize, Utc::now());
    let fan_out = demo.fan_out();
    let total_work: u64 = sample
        .orders
        .iter()
        .flat_map(|o| &o.events)
        .map(|e| fan_out.get(&e.event_type).copied().unwrap_or(0))
        .sum();
    let max_attempts = demo
        .settings
        .worker
        .max_perspective_event_attempts
        .unwrap_or(10);
    eprintln!(
        "Appending {} orders from {} customers: {} events, one stream per order, applied {} times \
         in all across the perspectives. {} OrderPaid events carry an amount written with a \
         decimal comma (\"{}\"), which revenue_by_day cannot parse.",
        thousands(sample.orders.len() as u64),
        thousands(sample.customers as u64),
        thousands(sample.events as u64),
        thousands(total_work),
        POISON_EVENTS,
        sample.poison_example,
    );

    let counters = Arc::new(Counters::default());
    let total_events = sample.events as u64;
    let mut producer_task = AbortOnDrop(Some(tokio::spawn(append_sample(
        producer.clone(),
        sample.orders,
        Arc::new(fan_out),
        Arc::clone(&counters),
    ))));
    let mut produced: Option<Produced> = None;

    let started = Instant::now();
    let mut progress = Progress::new(tty);
    let mut ticker = tokio::time::interval(TICK);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_snapshot = baseline;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = interrupt.cancelled() => {
                progress.finish();
                eprintln!("vantage demo: interrupted before the drain finished.");
                // Without --once, stopping is what Ctrl-C is for; with it, the job is undone.
                return Some(if args.once { exit::FAILURE } else { exit::OK });
            }
        }
        if producer_task.is_finished() {
            let task = producer_task.0.take().expect("checked above");
            match task.await {
                Ok(Ok(p)) => produced = Some(p),
                Ok(Err(e)) => {
                    progress.finish();
                    return Some(store_failure("appending the sample failed", &e));
                }
                Err(e) => {
                    progress.finish();
                    eprintln!("vantage demo: the producer crashed: {e}");
                    return Some(exit::FAILURE);
                }
            }
        }
        match Snapshot::take(producer, &names).await {
            Ok(s) => last_snapshot = s,
            Err(e) => progress.note(&format!("cannot read the work queue: {e}")),
        }
        let snap = &last_snapshot;
        let work = counters.work.load(Ordering::Relaxed);
        let applied =
            (work as i64 - (snap.remaining() - baseline.remaining()) - (snap.dead - baseline.dead))
                .clamp(0, work as i64) as u64;
        let appending = produced
            .is_none()
            .then(|| (counters.events.load(Ordering::Relaxed), total_events));
        progress.update(
            started.elapsed(),
            appending,
            applied,
            total_work,
            snap,
            snap.dead - baseline.dead,
        );
        if produced.is_some() && snap.remaining() == 0 {
            progress.finish();
            let elapsed = started.elapsed();
            eprintln!(
                "Drained in {:.1}s: {} applied, {} dead-lettered (about {}/s).",
                elapsed.as_secs_f64(),
                thousands(applied),
                snap.dead - baseline.dead,
                thousands((applied as f64 / elapsed.as_secs_f64().max(0.001)) as u64)
            );
            break;
        }
        if started.elapsed() > args.timeout {
            progress.finish();
            eprintln!(
                "vantage demo: the sample was not drained within {}: {} work rows remain \
                 ({} pending, {} leased, {} waiting to retry) and {} events were dead-lettered. \
                 Run again with RUST_LOG=info for details.",
                humantime::format_duration(args.timeout),
                snap.remaining(),
                snap.pending,
                snap.leased,
                snap.parked,
                snap.dead - baseline.dead,
            );
            return Some(exit::FAILURE);
        }
    }
    let produced = produced.expect("the loop ends only once the producer is done");

    // Every poison event must have been dead-lettered (by some perspective), not applied.
    let dead = match producer.open_dead_letters(None).await {
        Ok(all) => all,
        Err(e) => return Some(store_failure("cannot read the dead letters", &e)),
    };
    let ours: Vec<DeadLetter> = dead
        .iter()
        .filter(|d| names.contains(&d.perspective_name))
        .filter(|d| (produced.first_position..=produced.last_position).contains(&d.global_position))
        .cloned()
        .collect();
    let earlier = dead.len() - ours.len();
    let dead_positions: BTreeSet<i64> = ours.iter().map(|d| d.global_position).collect();
    let missing: Vec<String> = produced
        .poison_positions
        .iter()
        .filter(|p| !dead_positions.contains(p))
        .map(|p| p.to_string())
        .collect();
    if !missing.is_empty() {
        eprintln!(
            "vantage demo: the poison events at positions {} were applied instead of being \
             dead-lettered: was {} changed so that its statements accept them?",
            missing.join(", "),
            demo.file
                .as_deref()
                .map_or(DEMO_CONFIG_PATH.into(), |p| p.display().to_string()),
        );
        return Some(exit::FAILURE);
    }

    print_report(
        demo,
        args,
        &ours,
        earlier,
        max_attempts,
        producer,
        http_addr,
    )
    .await;
    None
}

fn store_failure(what: &str, e: &StoreError) -> i32 {
    eprintln!("vantage demo: {what}: {e}");
    match e {
        StoreError::Unreachable { .. } => exit::UNAVAILABLE,
        StoreError::InvalidUrl(_) | StoreError::SchemaNewer(_) => exit::CONFIG,
        _ => exit::FAILURE,
    }
}

/// Aborts the task when dropped (an early return must not leave the producer running).
struct AbortOnDrop<T>(Option<JoinHandle<T>>);

impl<T> AbortOnDrop<T> {
    fn is_finished(&self) -> bool {
        self.0.as_ref().is_some_and(|h| h.is_finished())
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        if let Some(handle) = &self.0 {
            handle.abort();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Work queue snapshots and progress

/// Work rows and open dead letters of the demo's perspectives.
#[derive(Clone, Copy, Debug, Default)]
struct Snapshot {
    pending: i64,
    leased: i64,
    parked: i64,
    dead: i64,
}

impl Snapshot {
    async fn take(store: &Store, names: &[String]) -> Result<Snapshot, StoreError> {
        let mut s = Snapshot::default();
        for p in store.perspective_status().await? {
            if names.contains(&p.perspective_name) {
                s.pending += p.pending;
                s.leased += p.leased;
                s.parked += p.parked;
                s.dead += p.dead_lettered;
            }
        }
        Ok(s)
    }

    /// Work rows not yet applied nor dead-lettered.
    fn remaining(&self) -> i64 {
        self.pending + self.leased + self.parked
    }
}

/// The progress line: refreshed in place on a terminal, one line per second otherwise.
struct Progress {
    tty: bool,
    last_print: Option<Instant>,
    /// Recent (time, applied) samples, for the rate.
    samples: VecDeque<(Instant, u64)>,
    /// A refreshed line is on screen without its newline.
    line_open: bool,
}

impl Progress {
    fn new(tty: bool) -> Self {
        Progress {
            tty,
            last_print: None,
            samples: VecDeque::new(),
            line_open: false,
        }
    }

    fn update(
        &mut self,
        elapsed: Duration,
        appending: Option<(u64, u64)>,
        applied: u64,
        total: u64,
        snap: &Snapshot,
        dead: i64,
    ) {
        let now = Instant::now();
        self.samples.push_back((now, applied));
        while self
            .samples
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > Duration::from_secs(1))
        {
            self.samples.pop_front();
        }
        let rate = match self.samples.front() {
            Some((at, before)) if now > *at => {
                applied.saturating_sub(*before) as f64 / now.duration_since(*at).as_secs_f64()
            }
            _ => 0.0,
        };
        if !self.tty
            && self
                .last_print
                .is_some_and(|at| now.duration_since(at) < PLAIN_PROGRESS_EVERY)
        {
            return;
        }
        self.last_print = Some(now);

        let mut line = format!("[{:>5.1}s] ", elapsed.as_secs_f64());
        if let Some((done, of)) = appending {
            line.push_str(&format!(
                "appended {}/{} events | ",
                thousands(done),
                thousands(of)
            ));
        }
        line.push_str(&format!(
            "applied {}/{} | pending {}",
            thousands(applied),
            thousands(total),
            thousands(snap.remaining().max(0) as u64)
        ));
        if snap.parked > 0 {
            line.push_str(&format!(" ({} awaiting retry)", snap.parked));
        }
        line.push_str(&format!(
            " | dead-lettered {dead} | {}/s",
            thousands(rate as u64)
        ));
        if self.tty {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "{CLEAR_LINE}{line}");
            let _ = err.flush();
            self.line_open = true;
        } else {
            eprintln!("{line}");
        }
    }

    fn note(&mut self, message: &str) {
        self.finish();
        eprintln!("  ({message})");
    }

    /// Ends a refreshed line, so what follows starts on its own line.
    fn finish(&mut self) {
        if self.line_open {
            eprintln!();
            self.line_open = false;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The producer

#[derive(Default)]
struct Counters {
    /// Events appended so far.
    events: AtomicU64,
    /// Work rows they fanned out to.
    work: AtomicU64,
}

/// What the producer appended.
#[derive(Debug)]
struct Produced {
    first_position: i64,
    last_position: i64,
    poison_positions: Vec<i64>,
}

impl Produced {
    fn new() -> Self {
        Produced {
            first_position: i64::MAX,
            last_position: i64::MIN,
            poison_positions: Vec::new(),
        }
    }

    fn merge(&mut self, other: Produced) {
        self.first_position = self.first_position.min(other.first_position);
        self.last_position = self.last_position.max(other.last_position);
        self.poison_positions.extend(other.poison_positions);
    }
}

/// Appends every order, [`PRODUCERS`] at a time.
async fn append_sample(
    store: Store,
    orders: Vec<Order>,
    fan_out: Arc<HashMap<String, u64>>,
    counters: Arc<Counters>,
) -> Result<Produced, StoreError> {
    let mut appends = futures::stream::iter(orders)
        .map(|order| {
            append_order(
                store.clone(),
                order,
                Arc::clone(&fan_out),
                Arc::clone(&counters),
            )
        })
        .buffer_unordered(PRODUCERS);
    let mut produced = Produced::new();
    while let Some(result) = appends.next().await {
        produced.merge(result?);
    }
    produced.poison_positions.sort_unstable();
    Ok(produced)
}

/// Appends one order's events one by one, as the commands of an application would, each with
/// the stream version its writer last saw.
async fn append_order(
    store: Store,
    order: Order,
    fan_out: Arc<HashMap<String, u64>>,
    counters: Arc<Counters>,
) -> Result<Produced, StoreError> {
    let mut produced = Produced::new();
    for (version, event) in order.events.iter().enumerate() {
        let appended = store
            .append_events(
                order.stream_id,
                Some(version as i32),
                std::slice::from_ref(event),
            )
            .await?;
        for a in &appended {
            produced.first_position = produced.first_position.min(a.global_position);
            produced.last_position = produced.last_position.max(a.global_position);
            if order.poison_event == Some(version) {
                produced.poison_positions.push(a.global_position);
            }
        }
        counters
            .events
            .fetch_add(appended.len() as u64, Ordering::Relaxed);
        counters.work.fetch_add(
            fan_out.get(&event.event_type).copied().unwrap_or(0),
            Ordering::Relaxed,
        );
    }
    Ok(produced)
}

// ---------------------------------------------------------------------------------------------
// The sample

/// Every event type of the sample.
const EVENT_TYPES: &[&str] = &[
    "OrderPlaced",
    "OrderPaid",
    "OrderShipped",
    "OrderDelivered",
    "OrderCancelled",
];
const CURRENCIES: &[(&str, u64)] = &[("EUR", 70), ("USD", 20), ("GBP", 10)];
const CARRIERS: &[&str] = &["DHL", "UPS", "GLS", "DPD", "PostNL"];
const PAYMENT_METHODS: &[&str] = &["card", "paypal", "bank_transfer"];

/// One order: its stream and events, in order.
struct Order {
    stream_id: Uuid,
    events: Vec<NewEvent>,
    /// Index of the poison event in `events`, if this order has one.
    poison_event: Option<usize>,
}

struct Sample {
    orders: Vec<Order>,
    /// Distinct customers who placed them.
    customers: usize,
    events: usize,
    /// The amount one poison event carries, for the explanation.
    poison_example: String,
}

/// How an order ends.
enum Fate {
    CancelledUnpaid,
    Paid,
    Refunded,
    Shipped,
    Delivered,
}

impl Sample {
    /// `orders` orders of `customers` customers (a few buy often, most rarely), placed over four
    /// weeks ending a week before `now`, so every later event is in the past too. The shape is
    /// the same on every run; the ids are new. [`POISON_EVENTS`] orders, spread through the
    /// sample, are paid with an amount written with a decimal comma.
    fn generate(orders: usize, customers: usize, now: DateTime<Utc>) -> Sample {
        let mut rng = Rng(SEED);
        let people: Vec<(Uuid, &str)> = (0..customers)
            .map(|_| (Uuid::new_v4(), rng.weighted(CURRENCIES)))
            .collect();
        let poison: BTreeSet<usize> = (1..=POISON_EVENTS)
            .map(|k| k * orders / (POISON_EVENTS + 1))
            .collect();
        let mut used = BTreeSet::new();
        let mut events = 0;
        let mut poison_example = String::new();
        let mut sample = Vec::with_capacity(orders);
        let newest = now - chrono::Duration::days(7);

        for i in 0..orders {
            let order_id = Uuid::new_v4();
            let who = ((rng.unit().powi(2) * customers as f64) as usize).min(customers - 1);
            used.insert(who);
            let (customer_id, currency) = people[who];
            let items = 1 + rng.below(5);
            let total: u64 = (0..items).map(|_| rng.between(499, 12_999)).sum();
            let placed_at = newest - chrono::Duration::seconds(rng.below(28 * 86_400) as i64);
            let is_poison = poison.contains(&i);
            let fate = if is_poison {
                Fate::Delivered
            } else {
                match rng.below(100) {
                    0..=7 => Fate::CancelledUnpaid,
                    8..=19 => Fate::Paid,
                    20..=24 => Fate::Refunded,
                    25..=49 => Fate::Shipped,
                    _ => Fate::Delivered,
                }
            };

            let mut order = Order {
                stream_id: order_id,
                events: Vec::with_capacity(4),
                poison_event: None,
            };
            order.events.push(event(
                "OrderPlaced",
                json!({
                    "order_id": order_id,
                    "customer_id": customer_id,
                    "items": items,
                    "total": money(total),
                    "currency": currency,
                    "placed_at": timestamp(placed_at),
                }),
            ));
            if let Fate::CancelledUnpaid = fate {
                let cancelled_at = placed_at + minutes(rng.between(30, 4_320));
                order.events.push(event(
                    "OrderCancelled",
                    json!({
                        "order_id": order_id,
                        "customer_id": customer_id,
                        "currency": currency,
                        "cancelled_at": timestamp(cancelled_at),
                        "reason": "payment not received",
                    }),
                ));
            } else {
                let paid_at = placed_at + minutes(rng.between(1, 120));
                let amount = if is_poison {
                    // A producer bug: the amount formatted for a German invoice.
                    let text = money(total).replace('.', ",");
                    poison_example = text.clone();
                    order.poison_event = Some(order.events.len());
                    text
                } else {
                    money(total)
                };
                order.events.push(event(
                    "OrderPaid",
                    json!({
                        "order_id": order_id,
                        "amount": amount,
                        "currency": currency,
                        "method": PAYMENT_METHODS[rng.below(PAYMENT_METHODS.len() as u64) as usize],
                        "paid_at": timestamp(paid_at),
                    }),
                ));
                match fate {
                    Fate::Refunded => {
                        let cancelled_at = paid_at + minutes(rng.between(60, 2_880));
                        order.events.push(event(
                            "OrderCancelled",
                            json!({
                                "order_id": order_id,
                                "customer_id": customer_id,
                                "currency": currency,
                                "cancelled_at": timestamp(cancelled_at),
                                "reason": "customer request",
                                "refund_amount": money(total),
                            }),
                        ));
                    }
                    Fate::Shipped | Fate::Delivered => {
                        let carrier = CARRIERS[rng.below(CARRIERS.len() as u64) as usize];
                        let shipped_at = paid_at + minutes(rng.between(120, 2_880));
                        order.events.push(event(
                            "OrderShipped",
                            json!({
                                "order_id": order_id,
                                "carrier": carrier,
                                "tracking_number": format!("{carrier}{:010}", rng.below(10_000_000_000)),
                                "shipped_at": timestamp(shipped_at),
                            }),
                        ));
                        if let Fate::Delivered = fate {
                            let delivered_at = shipped_at + minutes(rng.between(1_200, 5_760));
                            order.events.push(event(
                                "OrderDelivered",
                                json!({
                                    "order_id": order_id,
                                    "delivered_at": timestamp(delivered_at),
                                }),
                            ));
                        }
                    }
                    Fate::CancelledUnpaid | Fate::Paid => {}
                }
            }
            events += order.events.len();
            sample.push(order);
        }
        Sample {
            orders: sample,
            customers: used.len(),
            events,
            poison_example,
        }
    }
}

fn event(event_type: &str, data: Value) -> NewEvent {
    NewEvent {
        event_type: event_type.to_owned(),
        data,
        metadata: Some(json!({
            "producer": "vantage demo",
            "correlation_id": Uuid::new_v4(),
        })),
        event_id: None,
    }
}

fn money(cents: u64) -> String {
    format!("{}.{:02}", cents / 100, cents % 100)
}

fn timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Secs, true)
}

fn minutes(n: u64) -> chrono::Duration {
    chrono::Duration::minutes(n as i64)
}

/// SplitMix64: a small, seedable generator, so the sample has the same shape on every run.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`; the modulo bias is negligible for these sizes).
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in `lo..=hi`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn weighted<'a>(&mut self, choices: &[(&'a str, u64)]) -> &'a str {
        let total: u64 = choices.iter().map(|(_, w)| w).sum();
        let mut pick = self.below(total);
        for (choice, weight) in choices {
            if pick < *weight {
                return choice;
            }
            pick -= weight;
        }
        choices[0].0
    }
}

// ---------------------------------------------------------------------------------------------
// The report

/// The dead letters, the read model, the metrics URL and the commands to try, on stdout.
async fn print_report(
    demo: &DemoConfig,
    args: &DemoArgs,
    dead: &[DeadLetter],
    earlier: usize,
    max_attempts: u32,
    store: &Store,
    http_addr: SocketAddr,
) {
    let mut out = String::new();
    let mut line = |text: &str| {
        out.push_str(text);
        out.push('\n');
    };

    line("");
    line(&format!(
        "Dead letters: {} event(s) a perspective gave up on",
        dead.len()
    ));
    let mut t = output::table(&[
        "Perspective",
        "Position",
        "Event",
        "Stream",
        "Reason",
        "Claims",
        "Last error",
    ]);
    for d in dead {
        t.add_row(vec![
            d.perspective_name.clone(),
            d.global_position.to_string(),
            d.event_type.clone().unwrap_or_else(|| "?".into()),
            short_id(d.stream_id),
            d.failure_reason.clone(),
            d.attempts_when_dlq.to_string(),
            last_error(d),
        ]);
    }
    output::align_right(&mut t, &[1, 5]);
    line(&t.to_string());
    if earlier > 0 {
        line(&format!(
            "(and {earlier} open dead letter(s) from earlier runs or other perspectives: `dlq list` shows them all)"
        ));
    }
    line(&format!(
        "What happened: {POISON_EVENTS} OrderPaid events carry an amount written with a decimal \
         comma. revenue_by_day's statement failed on each of its {max_attempts} claims (parked \
         with backoff in between), so the {} claim dead-lettered it; the rest of those streams \
         and the other perspectives carried on.",
        ordinal(max_attempts + 1)
    ));

    for section in read_model(store).await {
        line("");
        line(&section);
    }

    line("");
    line(&format!(
        "Metrics: http://{http_addr}/metrics (health: http://{http_addr}/healthz, http://{http_addr}/readyz)"
    ));
    line("");
    let cli = CliHint::new(demo);
    let throwaway = matches!(demo.database, DatabaseSource::Throwaway(_));
    match (throwaway, args.once) {
        (true, true) => line(
            "Try the operator CLI. With --once the demo has stopped, and its throwaway database \
             with it: run the demo without --once and use these commands from another terminal \
             while it keeps running.",
        ),
        (true, false) => line(
            "Try the operator CLI from another terminal while the demo keeps running (its \
             throwaway database goes away when the demo stops):",
        ),
        (false, _) => line("Try the operator CLI:"),
    }
    for note in &cli.notes {
        line(&format!("  ({note})"));
    }
    let (position, perspective) = dead
        .first()
        .map(|d| (d.global_position, d.perspective_name.as_str()))
        .unwrap_or((1, "revenue_by_day"));
    let retries = max_attempts + 1;
    for (command, comment) in [
        ("status".to_owned(), ""),
        ("dlq list".to_owned(), ""),
        (format!("dlq inspect {position}"), ""),
        (
            format!("dlq replay {position} --perspective {perspective}"),
            "  # fails again: the amount is still not a number",
        ),
        ("dlq requeue --all --dry-run".to_owned(), ""),
        (
            format!("dlq requeue {position} --perspective {perspective} --yes"),
            "  # back to the daemon, which dead-letters it again",
        ),
        (
            format!("dlq purge {position} --perspective {perspective} --yes"),
            "",
        ),
    ] {
        line(&format!("  {}{comment}", cli.command(&command)));
    }
    if !args.once {
        // Written out by hand to keep the keys in a readable order.
        let order_id = Uuid::new_v4();
        let paid = format!(
            r#"{{"stream_id":"{order_id}","event_type":"OrderPaid","data":{{"order_id":"{order_id}","amount":"19,99","currency":"EUR","method":"card","paid_at":"{}"}}}}"#,
            timestamp(Utc::now())
        );
        line("");
        line(&format!(
            "Append another unreadable payment and see it dead-lettered after {retries} claims, \
             a few seconds later, in `dlq list`:"
        ));
        line(&format!("  echo '{paid}' | {}", cli.command("append")));
    }
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(out.as_bytes());
    let _ = stdout.flush();
}

/// Day, currency, orders paid, revenue, refunds.
type RevenueRow = (String, String, i32, String, String);

/// A few rows of each read model table, as printable sections.
async fn read_model(store: &Store) -> Vec<String> {
    let mut sections = Vec::new();
    let pool = store.pool();

    let by_status: Result<Vec<(String, i64, String)>, sqlx::Error> = sqlx::query_as(
        "SELECT status, count(*), \
                round(100.0 * count(*) / sum(count(*)) OVER (), 1)::text || '%' \
         FROM demo.order_summary GROUP BY status \
         ORDER BY array_position(ARRAY['placed','paid','shipped','delivered','cancelled'], status), \
                  status",
    )
    .fetch_all(pool)
    .await;
    sections.push(match by_status {
        Ok(rows) => {
            let total: i64 = rows.iter().map(|r| r.1).sum();
            let mut t = output::table(&["Status", "Orders", "Share"]);
            for (status, orders, share) in rows {
                t.add_row(vec![status, thousands(orders as u64), share]);
            }
            output::align_right(&mut t, &[1, 2]);
            format!(
                "Orders by status (demo.order_summary, {} orders):\n{t}",
                thousands(total as u64)
            )
        }
        Err(e) => format!("(cannot read demo.order_summary: {e})"),
    });

    let revenue: Result<Vec<RevenueRow>, sqlx::Error> = sqlx::query_as(
        "SELECT r.day::text, r.currency, r.orders, r.revenue::text, r.refunds::text \
         FROM demo.revenue_by_day r ORDER BY r.revenue DESC, r.day DESC LIMIT 5",
    )
    .fetch_all(pool)
    .await;
    sections.push(match revenue {
        Ok(rows) => {
            let mut t = output::table(&["Day", "Currency", "Orders paid", "Revenue", "Refunds"]);
            for (day, currency, orders, revenue, refunds) in rows {
                t.add_row(vec![day, currency, orders.to_string(), revenue, refunds]);
            }
            output::align_right(&mut t, &[2, 3, 4]);
            format!("Top 5 days by revenue (demo.revenue_by_day):\n{t}")
        }
        Err(e) => format!("(cannot read demo.revenue_by_day: {e})"),
    });

    let customers: Result<Vec<(Uuid, i32, i32, String)>, sqlx::Error> = sqlx::query_as(
        "SELECT customer_id, orders, cancelled, \
                to_char(last_order_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI') \
         FROM demo.customer_orders ORDER BY orders DESC, last_order_at DESC LIMIT 5",
    )
    .fetch_all(pool)
    .await;
    sections.push(match customers {
        Ok(rows) => {
            let mut t = output::table(&["Customer", "Orders", "Cancelled", "Last order (UTC)"]);
            for (customer, orders, cancelled, last) in rows {
                t.add_row(vec![
                    short_id(customer),
                    orders.to_string(),
                    cancelled.to_string(),
                    last,
                ]);
            }
            output::align_right(&mut t, &[1, 2]);
            format!("Top 5 customers (demo.customer_orders):\n{t}")
        }
        Err(e) => format!("(cannot read demo.customer_orders: {e})"),
    });
    sections
}

/// The error a perspective last reported for a dead letter, on one short line.
fn last_error(d: &DeadLetter) -> String {
    let text = d.error_text.as_deref().unwrap_or("");
    let error = text
        .lines()
        .find_map(|l| l.strip_prefix("last error: "))
        .or_else(|| text.lines().next())
        .unwrap_or("");
    truncate(error, 72)
}

fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        let mut short: String = text.chars().take(max - 1).collect();
        short.push('…');
        short
    }
}

fn short_id(id: Uuid) -> String {
    id.simple().to_string()[..8].to_owned()
}

/// `1234567` → `1,234,567`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn ordinal(n: u32) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// How the printed commands reach the demo's database and perspectives.
struct CliHint {
    /// Environment assignments, program and global options.
    prefix: String,
    notes: Vec<String>,
}

impl CliHint {
    fn new(demo: &DemoConfig) -> CliHint {
        let mut notes = Vec::new();
        let mut parts = Vec::new();
        let settings = &demo.settings;
        if settings.database.schema != "vantage"
            && std::env::var("VANTAGE__DATABASE__SCHEMA").map_or(true, |v| v.is_empty())
        {
            parts.push(format!(
                "VANTAGE__DATABASE__SCHEMA={}",
                shell_quote(&settings.database.schema)
            ));
        }
        parts.push(shell_quote(&program()));

        // Replay needs the perspectives' statements: point the commands at the demo's file.
        let config = match &demo.file {
            Some(path) => Some(path.clone()),
            None => {
                let copy = std::env::temp_dir().join("vantage-demo.toml");
                match std::fs::write(&copy, EMBEDDED_CONFIG) {
                    Ok(()) => {
                        notes.push(format!(
                            "{} is a copy of the demo configuration built into this binary",
                            copy.display()
                        ));
                        Some(copy)
                    }
                    Err(e) => {
                        notes.push(format!(
                            "replay needs the demo perspectives' configuration, which could not \
                             be written to {}: {e}",
                            copy.display()
                        ));
                        None
                    }
                }
            }
        };
        if let Some(config) = config {
            parts.push(format!(
                "--config {}",
                shell_quote(&config.display().to_string())
            ));
        }

        let url = settings.database.url.as_ref();
        match (&demo.database, url) {
            (DatabaseSource::Throwaway(url), _) => {
                parts.push(format!("--database-url {}", shell_quote(url)));
            }
            (_, Some(url)) if url.redacted() == url.expose() => {
                parts.push(format!("--database-url {}", shell_quote(url.expose())));
            }
            (DatabaseSource::Environment, Some(_)) => notes.push(
                "they use the database of DATABASE_URL / VANTAGE__DATABASE__URL: run them with \
                 the same environment"
                    .into(),
            ),
            (_, Some(url)) => {
                parts.push(format!("--database-url {}", shell_quote(&url.redacted())));
                notes.push("the password is hidden: put yours in place of ***".into());
            }
            (_, None) => {}
        }
        CliHint {
            prefix: parts.join(" "),
            notes,
        }
    }

    fn command(&self, rest: &str) -> String {
        format!("{} {rest}", self.prefix)
    }
}

/// This executable as the user can type it: relative to the working directory when it is
/// inside it (`target/release/vantage`), else its full path.
fn program() -> String {
    let Ok(exe) = std::env::current_exe() else {
        return "vantage".into();
    };
    let relative = std::env::current_dir()
        .ok()
        .and_then(|cwd| exe.strip_prefix(cwd).ok().map(Path::to_path_buf));
    match relative {
        Some(rel) if rel.components().count() > 1 => rel.display().to_string(),
        Some(rel) => format!("./{}", rel.display()),
        None => exe.display().to_string(),
    }
}

/// Quotes `s` for a POSIX shell when it holds anything but plainly safe characters.
fn shell_quote(s: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "@%+=:,./-_".contains(c);
    if !s.is_empty() && s.chars().all(safe) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_configuration_is_valid() {
        let s = Settings::from_toml_str(EMBEDDED_CONFIG).expect("config/demo.toml parses");
        let names: Vec<&str> = s.perspectives.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            ["order_summary", "revenue_by_day", "customer_orders"]
        );
        assert_eq!(s.worker.max_perspective_event_attempts, Some(3));
        for p in &s.perspectives {
            for e in &p.events {
                assert!(EVENT_TYPES.contains(&e.as_str()), "{e}");
            }
        }
    }

    #[test]
    fn sample_has_the_promised_shape() {
        let s = Sample::generate(2000, 500, Utc::now());
        assert_eq!(s.orders.len(), 2000);
        assert!(s.customers > 300 && s.customers <= 500, "{}", s.customers);
        assert!(s.orders.iter().all(|o| (2..=4).contains(&o.events.len())));
        assert_eq!(
            s.events,
            s.orders.iter().map(|o| o.events.len()).sum::<usize>()
        );
        let poison: Vec<&NewEvent> = s
            .orders
            .iter()
            .filter_map(|o| o.poison_event.map(|i| &o.events[i]))
            .collect();
        assert_eq!(poison.len(), POISON_EVENTS);
        for e in poison {
            assert_eq!(e.event_type, "OrderPaid");
            assert!(e.data["amount"].as_str().unwrap().contains(','));
        }
        // Every healthy amount parses; all timestamps are in the past.
        let now = timestamp(Utc::now());
        for o in &s.orders {
            for (i, e) in o.events.iter().enumerate() {
                if o.poison_event != Some(i) {
                    if let Some(amount) = e.data.get("amount") {
                        amount.as_str().unwrap().parse::<f64>().unwrap();
                    }
                }
                for (key, value) in e.data.as_object().unwrap() {
                    if key.ends_with("_at") {
                        assert!(value.as_str().unwrap() < now.as_str(), "{key} {value}");
                    }
                }
            }
        }
        // The same shape on every run.
        let again = Sample::generate(2000, 500, Utc::now());
        assert_eq!(again.events, s.events);
    }

    #[test]
    fn helpers() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(ordinal(4), "4th");
        assert_eq!(ordinal(11), "11th");
        assert_eq!(ordinal(21), "21st");
        assert_eq!(ordinal(2), "2nd");
        assert_eq!(money(1205), "12.05");
        assert_eq!(shell_quote("postgres://u@h:5/db"), "postgres://u@h:5/db");
        assert_eq!(
            shell_quote("postgres://u:***@h/db"),
            "'postgres://u:***@h/db'"
        );
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(truncate("abcdef", 4), "abc…");
    }
}
