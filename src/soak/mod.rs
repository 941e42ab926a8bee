//! `vantage soak`: the long-run reliability harness (docs/cli.md, "vantage soak";
//! RELIABILITY.md, "Soak").
//!
//! Several `vantage run` daemons (children of this executable, each with its own configuration
//! file, reaching the database through an in-process TCP proxy) drain a steady producer through
//! scripted phases of load and faults; at the end the read model proves that every event the
//! producer appended was applied exactly once and in stream order, that every poison event was
//! dead-lettered after exactly max + 1 claims, and that no healthy event was.
//!
//! One file per concern:
//! - [`fleet`]: the daemon processes, their replacement, and `/proc` samples;
//! - [`proxy`]: the TCP proxy that can black-hole the database;
//! - [`producer`]: the steady producer (rate and poison share adjustable);
//! - [`faults`]: what each phase does;
//! - [`report`]: the checks, the text and JSON report.
//!
//! Every SQL statement lives in `crate::store::soak`.

pub mod faults;
pub mod fleet;
pub mod producer;
pub mod proxy;
pub mod report;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use tokio::sync::Mutex;

use crate::store::soak::{SoakStore, Subscription, SOAK_SCHEMA};
use crate::store::{Store, StoreError, StoreOptions};
use crate::throwaway::ThrowawayPostgres;

use self::fleet::Fleet;
use self::producer::{Knobs, Streams, RARE, TICK};
use self::proxy::Proxy;
use self::report::{PhaseReport, Report};

/// The perspectives of the soak: two take every event (the first also gets the poison events),
/// the third only the rare type (the one the operator phase rebuilds).
pub const PERSPECTIVES: [(&str, &[&str]); 3] = [
    ("soak_a", &[TICK, RARE]),
    ("soak_b", &[TICK, RARE]),
    ("soak_c", &[RARE]),
];
/// The perspective that receives poison events.
pub const POISONED: &str = "soak_a";
/// The perspective the operator phase rebuilds.
pub const REBUILT: &str = "soak_c";
/// The perspectives whose lag is measured (the rebuilt one re-applies its history by design).
pub const LAG_MEASURED: [&str; 2] = ["soak_a", "soak_b"];

/// A scripted phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The steady rate, no fault.
    Steady,
    /// 1.5 × the rate.
    Load,
    /// SIGKILL one daemon every few seconds, replaced at once.
    Sigkill,
    /// PostgreSQL restarted (fast shutdown), on the throwaway server only.
    PgRestart,
    /// `pg_terminate_backend` of every daemon session, twice a second.
    Terminate,
    /// The database unreachable: the proxy forwards nothing and keeps its sockets open.
    Blackhole,
    /// A session holding a transaction id, idle in transaction.
    IdleXact,
    /// Readers holding old REPEATABLE READ snapshots.
    RrReaders,
    /// 300 idle connections.
    IdleConns,
    /// Ten times the share of poison events.
    PoisonBurst,
    /// An operator requeues the dead letters (half of them cured first) and rebuilds a
    /// perspective.
    Operator,
}

impl Phase {
    /// Every phase, in the order they run.
    pub const ALL: [Phase; 11] = [
        Phase::Steady,
        Phase::Load,
        Phase::Sigkill,
        Phase::PgRestart,
        Phase::Terminate,
        Phase::Blackhole,
        Phase::IdleXact,
        Phase::RrReaders,
        Phase::IdleConns,
        Phase::PoisonBurst,
        Phase::Operator,
    ];

    /// The command-line spelling.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Steady => "steady",
            Phase::Load => "load",
            Phase::Sigkill => "sigkill",
            Phase::PgRestart => "pg-restart",
            Phase::Terminate => "terminate",
            Phase::Blackhole => "blackhole",
            Phase::IdleXact => "idle-xact",
            Phase::RrReaders => "rr-readers",
            Phase::IdleConns => "idle-conns",
            Phase::PoisonBurst => "poison-burst",
            Phase::Operator => "operator",
        }
    }

    /// Parses one spelling.
    pub fn parse(s: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.name() == s)
    }

    /// Whether the phase injects a fault (whose recovery is measured).
    pub fn is_fault(self) -> bool {
        self != Phase::Steady
    }

    /// Whether the fault cuts daemons off mid-statement (a process killed, a session ended or
    /// starved), so that a claim can commit without its daemon ever acting on it.
    pub fn cuts_sessions(self) -> bool {
        matches!(
            self,
            Phase::Sigkill | Phase::PgRestart | Phase::Terminate | Phase::Blackhole
        )
    }
}

/// Which bars a run enforces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Profile {
    /// ≤ 3 minutes, every phase once at a lower rate; enforces the correctness checks and
    /// reports the rest (the `cargo test` run).
    Short,
    /// The published run: also enforces RSS slope, recovery time, flat fds and connections.
    Release,
}

impl Profile {
    /// The command-line spelling.
    pub fn name(self) -> &'static str {
        match self {
            Profile::Short => "short",
            Profile::Release => "release",
        }
    }
}

/// What to run.
#[derive(Clone, Debug, PartialEq)]
pub struct SoakConfig {
    /// Which bars are enforced, and the defaults below.
    pub profile: Profile,
    /// Time of all phases together (each gets an equal share).
    pub duration: Duration,
    /// The phases, in order.
    pub phases: Vec<Phase>,
    /// Events per second of the producer.
    pub rate: u64,
    /// Daemon processes.
    pub daemons: usize,
    /// Streams the producer spreads over.
    pub streams: usize,
    /// Share of the streams that may receive poison events, per mille.
    pub poison_streams_permille: u64,
    /// Poison events per million events (outside the burst).
    pub poison_ppm: u64,
    /// Poison events per million events during the poison burst.
    pub burst_ppm: u64,
    /// Share of each phase that is its fault (the rest is the recovery window), percent: the
    /// most a fault may take.
    pub fault_percent: u64,
    /// How long each fault lasts when its phase leaves room (`None`: `fault_percent` of the
    /// phase). The recovery bar is about the backlog a fault of this length leaves: at a given
    /// rate, a longer outage needs proportionally longer to drain.
    pub fault: Option<Duration>,
    /// Memory samples before this are left out of the RSS slope (the caches fill first).
    pub warmup: Duration,
    /// How often daemons are sampled.
    pub sample_interval: Duration,
    /// How often a progress line is printed.
    pub progress_interval: Duration,
    /// The final drain gives up when the backlog has not shrunk for this long (a stall, not a
    /// slow machine: a drain that makes progress is waited for, up to `drain_cap`).
    pub drain_stall: Duration,
    /// The longest the final drain is waited for, however it progresses.
    pub drain_cap: Duration,
    /// Time between two SIGKILLs of the sigkill phase.
    pub kill_every: Duration,
    /// Time between two PostgreSQL restarts of the pg-restart phase.
    pub restart_every: Duration,
    /// Idle connections of the idle-conns phase.
    pub idle_connections: usize,
    /// `worker.max_perspective_event_attempts` of the daemons.
    pub max_attempts: u32,
    /// Consumer loops per daemon (`worker.consumers`).
    pub consumers: usize,
}

impl SoakConfig {
    /// The defaults of `profile`.
    pub fn for_profile(profile: Profile) -> SoakConfig {
        match profile {
            Profile::Release => SoakConfig {
                profile,
                duration: Duration::from_secs(60 * 60),
                phases: Phase::ALL.to_vec(),
                rate: 1000,
                daemons: 3,
                streams: 2000,
                poison_streams_permille: 200,
                poison_ppm: 2_000,
                burst_ppm: 20_000,
                fault_percent: 60,
                fault: Some(Duration::from_secs(60)),
                warmup: Duration::from_secs(10 * 60),
                sample_interval: Duration::from_secs(5),
                progress_interval: Duration::from_secs(30),
                drain_stall: Duration::from_secs(5 * 60),
                drain_cap: Duration::from_secs(30 * 60),
                kill_every: Duration::from_secs(5),
                restart_every: Duration::from_secs(30),
                idle_connections: 300,
                max_attempts: 10,
                consumers: 4,
            },
            Profile::Short => SoakConfig {
                profile,
                duration: Duration::from_secs(121),
                rate: 200,
                streams: 400,
                warmup: Duration::from_secs(20),
                sample_interval: Duration::from_secs(1),
                progress_interval: Duration::from_secs(5),
                drain_stall: Duration::from_secs(60),
                drain_cap: Duration::from_secs(6 * 60),
                kill_every: Duration::from_secs(2),
                fault: None,
                ..SoakConfig::for_profile(Profile::Release)
            },
        }
    }

    /// The time of one phase (an equal share of the duration).
    pub fn phase_time(&self) -> Duration {
        self.duration / self.phases.len().max(1) as u32
    }

    /// The fault part of one phase: `fault`, or `fault_percent` of the phase when that is less.
    pub fn fault_time(&self) -> Duration {
        let most = self.phase_time() * self.fault_percent.min(100) as u32 / 100;
        self.fault.map_or(most, |f| f.min(most))
    }

    /// Whether the bars beyond correctness are enforced.
    pub fn enforces_bars(&self) -> bool {
        self.profile == Profile::Release
    }

    /// The soak's subscriptions.
    pub fn subscriptions() -> Vec<Subscription> {
        PERSPECTIVES
            .iter()
            .map(|(name, types)| Subscription {
                perspective: name.to_string(),
                event_types: types.iter().map(|t| t.to_string()).collect(),
            })
            .collect()
    }
}

/// Why a soak could not run to its verdict.
#[derive(Debug, thiserror::Error)]
pub enum SoakError {
    /// A database statement of the harness failed.
    #[error("database: {0}")]
    Store(#[from] StoreError),
    /// A file, a process or a socket could not be set up.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The daemons did not come up.
    #[error("{0}")]
    Startup(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SoakError {
    let what = what.into();
    move |source| SoakError::Io { what, source }
}

/// Everything the phases act on.
pub struct Soak {
    /// The harness's statements (direct to the server, not through the proxy).
    pub db: SoakStore,
    /// The daemons.
    pub fleet: Arc<Mutex<Fleet>>,
    /// The producer's knobs.
    pub knobs: Arc<Knobs>,
    /// The proxy in front of the database.
    pub proxy: Proxy,
    /// The throwaway server, when the soak started one (pg-restart needs it).
    pub server: Option<Arc<ThrowawayPostgres>>,
    /// Options of sessions held open by the phases (direct to the server).
    pub session_options: sqlx::postgres::PgConnectOptions,
    /// The executable the daemons and operator commands run.
    pub exe: PathBuf,
    /// Configuration of the operator commands (direct to the server).
    pub operator_config: PathBuf,
    /// The directory of configurations and logs.
    pub dir: PathBuf,
    /// What to run.
    pub config: SoakConfig,
    /// When the soak started.
    pub started: Instant,
}

impl Soak {
    /// Seconds since the start.
    pub fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// A progress line on stderr.
    pub fn say(&self, line: &str) {
        let t = self.started.elapsed().as_secs();
        eprintln!(
            "soak {:02}:{:02}:{:02} {line}",
            t / 3600,
            t / 60 % 60,
            t % 60
        );
    }
}

/// The daemon configuration: the soak's perspectives, its schema, the proxy's address.
fn daemon_toml(url: &str, config: &SoakConfig) -> String {
    let mut out = format!(
        "# Written by vantage soak for one of its daemons.\n\
         [database]\nurl = {url:?}\nschema = {SOAK_SCHEMA:?}\nmax_connections = {}\n\
         [worker]\nconsumers = {}\nmax_perspective_event_attempts = {}\n\
         # Poison events resolve in seconds, not the default's minutes.\n\
         retry_backoff_base = \"100ms\"\nretry_backoff_max = \"1s\"\n\
         [http]\nlisten = \"127.0.0.1:0\"\n\
         [log]\nlevel = \"info\"\n",
        config.consumers + 4,
        config.consumers,
        config.max_attempts,
    );
    for (name, types) in PERSPECTIVES {
        let statement = crate::store::soak::perspective_statement(name);
        out.push_str(&format!(
            "\n[[perspectives]]\nname = {name:?}\nevents = {types:?}\nreset = {:?}\n[perspectives.sql]\n",
            crate::store::soak::reset_statement(name)
        ));
        for t in types {
            out.push_str(&format!("{t} = {statement:?}\n"));
        }
    }
    out
}

/// `url` with its host and port replaced (the proxy's).
fn via(url: &str, port: u16) -> Result<String, SoakError> {
    let mut u = url::Url::parse(url)
        .map_err(|e| SoakError::Startup(format!("the database url does not parse: {e}")))?;
    u.set_host(Some("127.0.0.1"))
        .and_then(|_| {
            u.set_port(Some(port))
                .map_err(|_| url::ParseError::InvalidPort)
        })
        .map_err(|e| SoakError::Startup(format!("the database url: {e}")))?;
    Ok(u.to_string())
}

/// The server's address, for the proxy.
async fn upstream(url: &str) -> Result<std::net::SocketAddr, SoakError> {
    let u = url::Url::parse(url)
        .map_err(|e| SoakError::Startup(format!("the database url does not parse: {e}")))?;
    let host = u.host_str().unwrap_or("127.0.0.1").to_string();
    let port = u.port().unwrap_or(5432);
    let mut addrs = tokio::net::lookup_host((host.as_str(), port))
        .await
        .map_err(io(format!("resolving {host}:{port}")))?;
    addrs
        .next()
        .ok_or_else(|| SoakError::Startup(format!("{host}:{port} resolves to no address")))
}

/// Runs the whole soak against `url` (with `server` when the soak started it) and returns the
/// report; `dir` receives the configurations and the daemons' logs.
pub async fn run(
    url: &str,
    server: Option<Arc<ThrowawayPostgres>>,
    config: SoakConfig,
    dir: PathBuf,
) -> Result<Report, SoakError> {
    let started = Instant::now();
    let exe = std::env::current_exe().map_err(io("finding this executable"))?;

    let mut options = StoreOptions::for_url(url);
    options.schema = SOAK_SCHEMA.into();
    options.application_name = "vantage soak".into();
    options.max_connections = 6;
    let db = SoakStore::new(Store::connect(&options).await?);
    db.recreate_schema().await?;
    let session_options = options.connect_options()?;

    let proxy = Proxy::start(upstream(url).await?)
        .await
        .map_err(io("starting the proxy"))?;
    let daemon_url = via(url, proxy.port())?;
    let mut configs = Vec::new();
    for i in 0..config.daemons {
        let path = dir.join(format!("daemon-{i}.toml"));
        std::fs::write(&path, daemon_toml(&daemon_url, &config))
            .map_err(io(format!("writing {}", path.display())))?;
        configs.push(path);
    }
    let operator_config = dir.join("operator.toml");
    std::fs::write(&operator_config, daemon_toml(url, &config))
        .map_err(io(format!("writing {}", operator_config.display())))?;

    let mut fleet = Fleet::new(exe.clone(), configs, started);
    for i in 0..config.daemons {
        fleet
            .spawn(i)
            .map_err(io(format!("starting daemon {i} ({})", exe.display())))?;
    }
    let soak = Soak {
        db,
        fleet: Arc::new(Mutex::new(fleet)),
        knobs: Knobs::new(config.rate, config.poison_ppm),
        proxy,
        server,
        session_options,
        exe,
        operator_config,
        dir,
        config,
        started,
    };
    let result = run_started(&soak).await;
    // Whatever happened, no daemon outlives the soak.
    let codes = soak.fleet.lock().await.stop(Duration::from_secs(30)).await;
    let mut report = result?;
    report.finish(&soak, codes).await;
    let forensics = &report.accounting.forensics;
    if !forensics.is_empty() {
        // The database goes with a throwaway server: keep what a diagnosis needs beside the logs.
        let path = soak.dir.join("forensics.txt");
        let mut text = forensics.join("\n\n");
        text.push('\n');
        match std::fs::write(&path, text) {
            Ok(()) => soak.say(&format!(
                "the record of every event that broke a rule is in {}",
                path.display()
            )),
            Err(e) => soak.say(&format!("could not write {}: {e}", path.display())),
        }
    }
    Ok(report)
}

/// Waits until every daemon has registered its instance (they migrate and prepare first).
async fn wait_registered(soak: &Soak) -> Result<(), SoakError> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let pids = soak.fleet.lock().await.pids();
        let mut registered = 0;
        for (_, pid) in &pids {
            if soak.db.instance_of(*pid).await?.instance_id.is_some() {
                registered += 1;
            }
        }
        if registered == soak.config.daemons {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(SoakError::Startup(format!(
                "{registered} of {} daemons registered within 120 s; their logs are in {}",
                soak.config.daemons,
                soak.dir.display()
            )));
        }
        soak.fleet.lock().await.replace_exited();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn run_started(soak: &Soak) -> Result<Report, SoakError> {
    let config = &soak.config;
    wait_registered(soak).await?;
    soak.say(&format!(
        "{} daemons running; producing {} events/s over {} streams; {} phases of {:?} ({:?} fault each)",
        config.daemons,
        config.rate,
        config.streams,
        config.phases.len(),
        config.phase_time(),
        config.fault_time(),
    ));

    let streams = Streams {
        ids: (0..config.streams).map(|_| uuid::Uuid::new_v4()).collect(),
        poison_streams: (config.streams as u64 * config.poison_streams_permille / 1000) as usize,
        poisoned: POISONED.into(),
    };
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let producer = tokio::spawn(producer::run(
        soak.db.clone(),
        streams,
        soak.knobs.clone(),
        seed,
    ));
    let watcher = tokio::spawn(watch(
        soak.fleet.clone(),
        soak.db.clone(),
        soak.knobs.clone(),
        config.sample_interval,
        config.progress_interval,
        soak.started,
    ));
    let mut warm_snapshot = None;

    let mut phases = Vec::new();
    for (i, phase) in config.phases.iter().copied().enumerate() {
        soak.say(&format!(
            "phase {} of {}: {}",
            i + 1,
            config.phases.len(),
            phase.name()
        ));
        let start: DateTime<Utc> = Utc::now();
        let start_s = soak.now();
        let fault_until = Instant::now() + config.fault_time();
        let outcome = faults::run(soak, phase, fault_until).await;
        let fault_end = Utc::now();
        let fault_end_s = soak.now();
        let phase_until = soak.started + Duration::from_secs_f64(start_s) + config.phase_time();
        while Instant::now() < phase_until {
            if warm_snapshot.is_none() && soak.started.elapsed() >= config.warmup {
                warm_snapshot = Some(report::snapshot(soak).await);
            }
            let left = phase_until.saturating_duration_since(Instant::now());
            tokio::time::sleep(left.min(Duration::from_millis(500))).await;
        }
        if warm_snapshot.is_none() && soak.started.elapsed() >= config.warmup {
            warm_snapshot = Some(report::snapshot(soak).await);
        }
        phases.push(PhaseReport::new(
            phase,
            start,
            fault_end,
            Utc::now(),
            start_s,
            fault_end_s,
            outcome,
        ));
    }

    soak.knobs.stop.store(true, Ordering::SeqCst);
    let _ = producer.await;
    let appended = soak.knobs.appended.load(Ordering::SeqCst);
    soak.say(&format!(
        "producer stopped after {appended} events; draining"
    ));
    let names: Vec<String> = PERSPECTIVES.iter().map(|(n, _)| n.to_string()).collect();
    let drain_started = Instant::now();
    let mut drained = false;
    let mut least = u64::MAX;
    let mut progressed = Instant::now();
    while drain_started.elapsed() < config.drain_cap && progressed.elapsed() < config.drain_stall {
        match soak.db.backlog(&names).await {
            Ok((0, _)) => {
                drained = true;
                break;
            }
            Ok((left, _)) => {
                if left < least {
                    least = left;
                    progressed = Instant::now();
                }
            }
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let drain = drain_started.elapsed();
    soak.say(&format!(
        "drain {} after {:.1} s; accounting",
        if drained { "complete" } else { "NOT complete" },
        drain.as_secs_f64()
    ));
    let warm = match warm_snapshot {
        Some(s) => s,
        // A run shorter than its warm-up measures from the end of the phases.
        None => report::snapshot(soak).await,
    };
    let end = report::snapshot(soak).await;
    watcher.abort();
    // A claim lost in a cut is claimed again once its lease lapses (the soak keeps the default
    // `worker.lease`), then waits for its retry backoff at most.
    let lease = crate::config::WorkerSettings::default().lease;
    let after_cut = chrono::Duration::from_std(lease + Duration::from_secs(30))
        .unwrap_or_else(|_| chrono::Duration::seconds(90));
    let cuts: Vec<_> = phases
        .iter()
        .filter(|p| Phase::parse(p.phase).is_some_and(Phase::cuts_sessions))
        .map(|p| {
            let (from, to) = p.fault_window();
            (from, to + after_cut)
        })
        .collect();
    let accounting = soak
        .db
        .account(&SoakConfig::subscriptions(), config.max_attempts, &cuts)
        .await?;
    let lag_names: Vec<String> = LAG_MEASURED.iter().map(|s| s.to_string()).collect();
    for p in &mut phases {
        p.measure(&soak.db, &lag_names).await?;
    }
    Ok(Report::new(
        config.clone(),
        phases,
        accounting,
        warm,
        end,
        drain,
        drained,
        soak.knobs.failed_batches.load(Ordering::SeqCst),
        soak.dir.clone(),
    ))
}

/// Samples the daemons, replaces any that exited by themselves, and prints progress lines,
/// until aborted.
async fn watch(
    fleet: Arc<Mutex<Fleet>>,
    db: SoakStore,
    knobs: Arc<Knobs>,
    sample_every: Duration,
    progress_every: Duration,
    started: Instant,
) {
    let names: Vec<String> = LAG_MEASURED.iter().map(|s| s.to_string()).collect();
    let mut last_progress = Instant::now();
    let mut tick = tokio::time::interval(sample_every);
    loop {
        tick.tick().await;
        let (replaced, running) = {
            let mut f = fleet.lock().await;
            let replaced = f.replace_exited();
            f.sample_all();
            (replaced, f.running())
        };
        if replaced > 0 {
            let t = started.elapsed().as_secs();
            eprintln!(
                "soak {:02}:{:02}:{:02} {replaced} daemon(s) exited by themselves; replaced",
                t / 3600,
                t / 60 % 60,
                t % 60
            );
        }
        if last_progress.elapsed() >= progress_every {
            last_progress = Instant::now();
            let backlog = tokio::time::timeout(Duration::from_secs(5), db.backlog(&names)).await;
            let t = started.elapsed().as_secs();
            let (rows, oldest) = match backlog {
                Ok(Ok(b)) => (b.0.to_string(), format!("{:.1} s", b.1)),
                _ => ("?".into(), "?".into()),
            };
            eprintln!(
                "soak {:02}:{:02}:{:02} appended {}, backlog {rows} rows, oldest healthy pending {oldest}, {running} daemons",
                t / 3600,
                t / 60 % 60,
                t % 60,
                knobs.appended.load(Ordering::Relaxed),
            );
        }
    }
}
