//! `vantage soak`: several daemons drain a steady producer through scripted phases of load
//! and faults, then the read model proves that nothing was lost, doubled or reordered
//! (docs/cli.md, "vantage soak"; RELIABILITY.md, "Soak").
//!
//! It works in its own schema (`vantage_soak`, dropped and recreated) of the configured
//! database, or, with none configured, of a throwaway PostgreSQL started for the run (the only
//! kind the pg-restart phase restarts). The report goes to stdout (text, or the JSON envelope
//! with `--json`), progress lines to stderr. Exit 0 only when every enforced check holds.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};

use super::{exit, output, GlobalArgs};
use crate::soak::{Phase, Profile, SoakConfig, SoakError};
use crate::throwaway::{ThrowawayPostgres, DEFAULT_MAX_CONNECTIONS};

/// `--profile`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ProfileArg {
    /// ≤ 3 minutes, every phase once at 200 events/s; enforces correctness, reports the bars.
    Short,
    /// 60 minutes at 1 000 events/s; also enforces the bars (RSS slope, recovery, fds, connections).
    Release,
}

/// Options of `vantage soak`.
#[derive(Debug, Clone, Args)]
pub struct SoakArgs {
    /// Defaults and bars: short (CI) or release (the published run).
    #[arg(long, value_enum, default_value = "release")]
    pub profile: ProfileArg,
    /// Time of all phases together, each an equal share (default: 60m release, 2m short).
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub duration: Option<Duration>,
    /// Phases, in order: all, or a comma-separated list of steady, load, sigkill, pg-restart,
    /// terminate, blackhole, idle-xact, rr-readers, idle-conns, poison-burst, operator.
    #[arg(
        long,
        default_value = "all",
        value_delimiter = ',',
        value_name = "PHASES"
    )]
    pub phases: Vec<String>,
    /// Events per second of the producer (default: 1000 release, 200 short).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub rate: Option<u64>,
    /// Daemon processes (default 3).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=32))]
    pub daemons: Option<u64>,
    /// Streams the producer spreads over (default: 2000 release, 400 short).
    #[arg(long, value_parser = clap::value_parser!(u64).range(10..=1_000_000))]
    pub streams: Option<u64>,
    /// How long each fault lasts, at most 60 % of its phase; the rest of the phase is its
    /// recovery window (default: 60s release, 60 % of the phase short).
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub fault: Option<Duration>,
    /// Memory samples before this are left out of the RSS slope (default: 10m release, 20s short).
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub warmup: Option<Duration>,
    /// The report as the JSON envelope on stdout.
    #[arg(long)]
    pub json: bool,
}

impl SoakArgs {
    /// The soak these options ask for, or the usage error.
    pub fn config(&self) -> Result<SoakConfig, String> {
        let profile = match self.profile {
            ProfileArg::Short => Profile::Short,
            ProfileArg::Release => Profile::Release,
        };
        let mut config = SoakConfig::for_profile(profile);
        let mut phases = Vec::new();
        for name in &self.phases {
            match name.trim() {
                "all" => phases.extend(Phase::ALL),
                other => match Phase::parse(other) {
                    Some(p) => phases.push(p),
                    None => {
                        let known: Vec<&str> = Phase::ALL.iter().map(|p| p.name()).collect();
                        return Err(format!(
                            "unknown phase {other:?}; expected all or some of {}",
                            known.join(", ")
                        ));
                    }
                },
            }
        }
        if phases.is_empty() {
            return Err("no phase to run".into());
        }
        config.phases = phases;
        if let Some(d) = self.duration {
            config.duration = d;
        }
        if config.phase_time() < Duration::from_secs(2) {
            return Err(format!(
                "--duration {} gives each of {} phases less than 2 s",
                humantime::format_duration(config.duration),
                config.phases.len()
            ));
        }
        if let Some(r) = self.rate {
            config.rate = r;
        }
        if let Some(d) = self.daemons {
            config.daemons = d as usize;
        }
        if let Some(s) = self.streams {
            config.streams = s as usize;
        }
        if let Some(f) = self.fault {
            if f.is_zero() {
                return Err("--fault must be longer than 0 s".into());
            }
            config.fault = Some(f);
        }
        if let Some(w) = self.warmup {
            config.warmup = w;
        }
        Ok(config)
    }
}

/// Runs `vantage soak`. Exit 0 when every enforced check holds; 1 when one does not or the run
/// broke down; 2 for a bad option or when no database is configured and none can be started;
/// 69 when the configured database is unreachable; 78 for invalid configuration; 130 when
/// interrupted (SIGINT, SIGTERM).
pub async fn run(global: &GlobalArgs, args: SoakArgs) -> i32 {
    let config = match args.config() {
        Ok(c) => c,
        Err(message) => {
            eprintln!("vantage soak: {message}");
            return exit::USAGE;
        }
    };
    let settings = match global.load_settings() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vantage soak: {e}");
            return exit::CONFIG;
        }
    };
    let (url, server) = match settings.database.url.as_ref() {
        Some(url) => {
            eprintln!(
                "vantage soak: using the configured database; schema \"{}\" there is dropped and recreated (the pg-restart phase is skipped).",
                crate::store::soak::SOAK_SCHEMA
            );
            (url.expose().to_string(), None)
        }
        None => {
            // Room for the idle-conns phase beside the daemons, the harness and the operator.
            let per_daemon = config.consumers as u32 + 6;
            let max = (config.idle_connections as u32 + per_daemon * config.daemons as u32 + 60)
                .max(DEFAULT_MAX_CONNECTIONS);
            eprint!("No database configured (set DATABASE_URL to use yours): starting a throwaway PostgreSQL... ");
            let _ = std::io::stderr().flush();
            match tokio::task::spawn_blocking(move || {
                ThrowawayPostgres::start_with_max_connections(max)
            })
            .await
            {
                Ok(Ok(server)) => {
                    eprintln!(
                        "ready on 127.0.0.1:{} (max_connections {max}); it is removed when the soak exits.",
                        server.port()
                    );
                    (server.url(), Some(Arc::new(server)))
                }
                Ok(Err(e)) => {
                    eprintln!("failed.");
                    eprintln!("vantage soak: {e}");
                    return exit::USAGE;
                }
                Err(e) => {
                    eprintln!("failed.");
                    eprintln!("vantage soak: the PostgreSQL launcher crashed: {e}");
                    return exit::FAILURE;
                }
            }
        }
    };
    let dir = match tempfile::Builder::new()
        .prefix(&format!("vantage-soak-{}-", std::process::id()))
        .tempdir()
    {
        Ok(d) => d,
        Err(e) => {
            eprintln!("vantage soak: creating a directory for the daemons' files: {e}");
            return exit::FAILURE;
        }
    };

    let soak = crate::soak::run(&url, server.clone(), config, dir.path().to_path_buf());
    // Ctrl-C or SIGTERM abandons the run: dropping it kills the daemons (and the server below).
    let result = tokio::select! {
        r = soak => Some(r),
        _ = stop_signal() => None,
    };
    let Some(result) = result else {
        eprintln!("vantage soak: interrupted; daemons stopped, no verdict");
        let kept = dir.keep();
        eprintln!(
            "vantage soak: the daemons' configurations and logs are kept in {}",
            kept.display()
        );
        if let Some(server) = server {
            let _ = tokio::task::spawn_blocking(move || drop(server)).await;
        }
        return exit::FORCED;
    };
    let code = match result {
        Ok(report) => {
            let passed = report.passed();
            if args.json {
                let status = if passed {
                    output::Status::Pass
                } else {
                    output::Status::Fail
                };
                let data = serde_json::to_value(&report).unwrap_or_default();
                println!("{}", output::envelope(status, data));
            } else {
                println!("{report}");
            }
            if passed {
                exit::OK
            } else {
                exit::FAILURE
            }
        }
        Err(e) => {
            if args.json {
                let failure = output::Failure::failed(e.to_string());
                println!(
                    "{}",
                    output::envelope(output::Status::Error, failure.envelope_data())
                );
            }
            eprintln!("vantage soak: {e}");
            match e {
                SoakError::Store(ref s) if s.is_connection_error() => exit::UNAVAILABLE,
                _ => exit::FAILURE,
            }
        }
    };
    if code == exit::OK {
        drop(dir);
    } else {
        let kept = dir.keep();
        eprintln!(
            "vantage soak: the daemons' configurations and logs are kept in {}",
            kept.display()
        );
    }
    if let Some(server) = server {
        // Stopping waits for the server to exit: keep that off the async workers.
        let _ = tokio::task::spawn_blocking(move || drop(server)).await;
    }
    code
}

/// The first SIGINT or SIGTERM.
async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        // Without handlers the default action (exit) stands; never resolve.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
    }
}
