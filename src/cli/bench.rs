//! `vantage bench`: seeds a backlog, drains it with the real daemon, measures the physical
//! limit of the same effects in the same run, runs the scale and shape checks, and prints the
//! report (stdout) ending with `limit:`, `vantage:` and `drain/limit ratio:` lines.
//!
//! It works in its own schema (`vantage_bench`, dropped and recreated) of the configured
//! database, or, with none configured, of a throwaway PostgreSQL started for the run (with
//! `pg_stat_statements` loaded, to count round trips). Build it with `--release`.

use std::io::Write;
use std::time::Duration;

use clap::Args;

use super::{exit, GlobalArgs};
use crate::bench::progress::Progress;
use crate::bench::{BenchConfig, BenchError, Check};
use crate::store::bench::BenchStore;
use crate::store::{Store, StoreOptions};
use crate::throwaway::ThrowawayPostgres;

/// Options of `vantage bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Events seeded for the main drain (N).
    #[arg(long, default_value_t = 200_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub events: u64,
    /// Streams they are spread over (S).
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub streams: u64,
    /// Perspectives each event fans out to (P).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub perspectives: u32,
    /// Consumer loops per daemon (K), and connections per instance of the limit runs.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub consumers: u64,
    /// Rows per claim (worker.batch_size), and per batch of the limit runs.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub batch_size: u32,
    /// Bytes of padding in each event's payload.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    pub payload_bytes: u32,
    /// Daemons run side by side (each with its own connections and instance id).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub instances: u64,
    /// Scale and shape checks to run: all, none, or a comma-separated list of claim-scale,
    /// dead-tuples, parked, perspectives, shapes, dead-letter, retries, statements, latency, rss,
    /// producers, held-append, versions, traces.
    #[arg(
        long,
        default_value = "all",
        value_delimiter = ',',
        value_name = "CHECKS"
    )]
    pub checks: Vec<String>,
    /// Rows of the large backlog of the claim-scale check.
    #[arg(long, default_value_t = 5_000_000, value_parser = clap::value_parser!(u64).range(10_000..))]
    pub large_backlog: u64,
    /// Unprunable dead tuples of the dead-tuples check.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(100..))]
    pub dead_tuples: u64,
    /// Give up on one drain after this long.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub drain_timeout: Duration,
    /// Run the main drain and the crash-safe limit this many times, alternating, and report
    /// the round with the median ratio (on a shared, noisy machine one pair can mislead).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub rounds: u32,
}

impl BenchArgs {
    /// The benchmark these options ask for, or the usage error.
    pub fn config(&self) -> Result<BenchConfig, String> {
        let mut checks = Vec::new();
        for name in &self.checks {
            match name.trim() {
                "all" => checks.extend(Check::ALL),
                "none" | "" => {}
                other => match Check::parse(other) {
                    Some(c) => checks.push(c),
                    None => {
                        let known: Vec<&str> = Check::ALL.iter().map(|c| c.name()).collect();
                        return Err(format!(
                            "unknown check {other:?}; expected all, none or some of {}",
                            known.join(", ")
                        ));
                    }
                },
            }
        }
        // Run order is the canonical one, each check once.
        checks.sort_by_key(|c| Check::ALL.iter().position(|a| a == c));
        checks.dedup();
        Ok(BenchConfig {
            events: self.events,
            streams: self.streams.min(self.events),
            perspectives: self.perspectives,
            consumers: self.consumers as usize,
            batch_size: self.batch_size,
            payload_bytes: self.payload_bytes,
            instances: self.instances as usize,
            checks,
            large_backlog: self.large_backlog,
            dead_tuples: self.dead_tuples,
            drain_timeout: self.drain_timeout,
            rounds: self.rounds,
            ..BenchConfig::default()
        })
    }
}

/// Runs `vantage bench`. Exit 0 with the report on stdout; 1 when a run fails or breaks a
/// rule it measures; 2 for a bad option or when no database is configured and none can be
/// started; 69 when the configured database is unreachable; 78 for invalid configuration.
pub async fn run(global: &GlobalArgs, args: BenchArgs) -> i32 {
    run_with(global, args, Progress::for_stderr()).await
}

/// [`run`] with a given progress display (tests pass [`Progress::hidden`]).
pub async fn run_with(global: &GlobalArgs, args: BenchArgs, progress: Progress) -> i32 {
    let mut config = match args.config() {
        Ok(c) => c,
        Err(message) => {
            eprintln!("vantage bench: {message}");
            return exit::USAGE;
        }
    };
    if cfg!(debug_assertions) {
        eprintln!(
            "vantage bench: this is a debug build; its figures mean little (build with --release)"
        );
    }
    let settings = match global.load_settings() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vantage bench: {e}");
            return exit::CONFIG;
        }
    };
    let (url, server) = match settings.database.url.as_ref() {
        Some(url) => {
            eprintln!(
                "vantage bench: using the configured database; schema \"{}\" there is dropped and recreated.",
                crate::store::bench::BENCH_SCHEMA
            );
            (url.expose().to_string(), None)
        }
        None => match start_throwaway().await {
            Ok(server) => (server.url(), Some(server)),
            Err(code) => return code,
        },
    };

    config.own_server = server.is_some();
    let code = match crate::bench::run(&url, config, progress).await {
        Ok(report) => {
            println!("{report}");
            exit::OK
        }
        Err(e) => {
            eprintln!("vantage bench: {e}");
            match e {
                BenchError::Store(ref s) if s.is_connection_error() => exit::UNAVAILABLE,
                _ => exit::FAILURE,
            }
        }
    };
    if let Some(server) = server {
        // Stopping waits for the server to exit: keep that off the async workers.
        let _ = tokio::task::spawn_blocking(move || drop(server)).await;
    }
    code
}

/// Starts a throwaway PostgreSQL with pg_stat_statements loaded (one restart after
/// `ALTER SYSTEM`), or says why not.
async fn start_throwaway() -> Result<ThrowawayPostgres, i32> {
    eprint!("No database configured (set DATABASE_URL to use yours): starting a throwaway PostgreSQL... ");
    let _ = std::io::stderr().flush();
    let server = match tokio::task::spawn_blocking(ThrowawayPostgres::start).await {
        Ok(Ok(server)) => server,
        Ok(Err(e)) => {
            eprintln!("failed.");
            eprintln!("vantage bench: {e}");
            return Err(exit::USAGE);
        }
        Err(e) => {
            eprintln!("failed.");
            eprintln!("vantage bench: the PostgreSQL launcher crashed: {e}");
            return Err(exit::FAILURE);
        }
    };
    // Round trips are counted from pg_stat_statements, which must be preloaded.
    let preload = async {
        let store = Store::connect(&StoreOptions::for_url(server.url())).await?;
        let result = BenchStore::new(store.clone())
            .preload_pg_stat_statements()
            .await;
        store.close().await;
        result
    }
    .await;
    match preload {
        Ok(()) => {
            let restart = {
                let url = server.url();
                let handle = tokio::task::spawn_blocking(move || {
                    let r = server.restart();
                    (server, r)
                });
                match handle.await {
                    Ok((server, Ok(()))) => Ok(server),
                    Ok((_, Err(e))) => Err(e.to_string()),
                    Err(e) => Err(format!("{e} ({url})")),
                }
            };
            match restart {
                Ok(server) => {
                    eprintln!(
                        "ready on 127.0.0.1:{}; it is removed when the bench exits.",
                        server.port()
                    );
                    Ok(server)
                }
                Err(e) => {
                    eprintln!("failed.");
                    eprintln!("vantage bench: restarting the throwaway PostgreSQL with pg_stat_statements: {e}");
                    Err(exit::FAILURE)
                }
            }
        }
        Err(e) => {
            eprintln!(
                "(round trips will not be counted: {e}) ready on 127.0.0.1:{}.",
                server.port()
            );
            Ok(server)
        }
    }
}
