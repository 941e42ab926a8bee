//! The `vantage` command line: one module per command group.
//!
//! `main.rs` only parses and calls [`run()`]; every command returns its exit code.

pub(crate) mod alerts;
pub(crate) mod append;
pub(crate) mod bench;
pub(crate) mod config_cmd;
pub(crate) mod console;
pub(crate) mod demo;
pub(crate) mod dlq;
pub mod exit;
pub(crate) mod migrate;
pub(crate) mod output;
pub(crate) mod perspectives;
pub(crate) mod run;
pub mod signals;
pub(crate) mod soak;
pub(crate) mod status;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::config::{ConfigError, LoadOptions, Settings};

/// Keeps event-sourced perspectives current from PostgreSQL, and manages their dead letters.
#[derive(Debug, Parser)]
#[command(name = "vantage", version, about, propagate_version = true)]
pub struct Cli {
    /// Global options.
    #[command(flatten)]
    pub global: GlobalArgs,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command takes.
#[derive(Debug, Clone, Args)]
pub struct GlobalArgs {
    /// Configuration file (default: config/vantage.toml if present).
    #[arg(long, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Database URL (overrides the file, DATABASE_URL and VANTAGE__DATABASE__URL).
    #[arg(long, global = true, value_name = "URL")]
    pub database_url: Option<String>,
}

impl GlobalArgs {
    /// Loads the settings these options point at.
    pub fn load_settings(&self) -> Result<Settings, ConfigError> {
        Settings::load(&LoadOptions {
            config_path: self.config.clone(),
            database_url: self.database_url.clone(),
            overrides: Vec::new(),
        })
    }
}

/// Commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon in the foreground (SIGTERM/SIGINT shut it down gracefully).
    Run,
    /// Apply the database migrations, print what was applied, and exit.
    Migrate,
    /// The newcomer's first command: a local database, sample orders, a drain, dead letters.
    Demo(demo::DemoArgs),
    /// Append events from JSON lines (stdin or --file); all or nothing.
    Append(append::AppendArgs),
    /// Per perspective: pending, leased, parked, dead-lettered, oldest pending age; instances.
    Status(status::StatusArgs),
    /// The perspective registry.
    #[command(subcommand)]
    Perspectives(perspectives::PerspectivesCommand),
    /// Dead-lettered events: list, inspect, replay, purge, requeue.
    #[command(subcommand)]
    Dlq(dlq::DlqCommand),
    /// Configuration.
    #[command(subcommand)]
    Config(config_cmd::ConfigCommand),
    /// Measure the drain against the physical limit of the same effects, in one run (build with --release).
    Bench(bench::BenchArgs),
    /// Daemons through phases of load and faults, then proof that nothing was lost, doubled or reordered (RELIABILITY.md, "Soak").
    Soak(soak::SoakArgs),
    /// The operator console in a browser: overview, dead letters, detail (docs/cli.md, "The console").
    Console(console::ConsoleArgs),
    /// Prometheus rules from the configured SLOs (docs/operations.md, "SLOs and alerts").
    #[command(subcommand)]
    Alerts(alerts::AlertsCommand),
}

/// Reports a command line clap could not parse. Under `--json` the error is the usual envelope
/// on stdout (scripts read stdout, not clap's text); otherwise clap prints its message. Help
/// and version print as usual.
pub fn parse_error(e: clap::Error) -> i32 {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            exit::OK
        }
        _ if std::env::args_os().any(|a| a == "--json") => {
            // clap's first paragraph, on one line: "the following required arguments were not
            // provided: <POSITION>" (its first line alone would cut the names off).
            let rendered = e.render().to_string();
            let message = rendered
                .split("\n\n")
                .next()
                .unwrap_or("invalid command line")
                .lines()
                .map(str::trim)
                .collect::<Vec<_>>()
                .join(" ")
                .trim_start_matches("error: ")
                .to_string();
            output::Ui::new(true).finish(Err(output::Failure::usage(message)))
        }
        _ => {
            let _ = e.print();
            exit::USAGE
        }
    }
}

/// Runs a parsed command line; returns the process exit code.
pub async fn run(cli: Cli) -> i32 {
    match cli.command {
        Command::Run => run::run(&cli.global).await,
        Command::Migrate => migrate::run(&cli.global).await,
        Command::Demo(args) => demo::run(&cli.global, args).await,
        Command::Append(args) => append::run(&cli.global, args).await,
        Command::Status(args) => status::run(&cli.global, args).await,
        Command::Perspectives(cmd) => perspectives::run(&cli.global, cmd).await,
        Command::Dlq(cmd) => dlq::run(&cli.global, cmd).await,
        Command::Config(cmd) => config_cmd::run(&cli.global, cmd).await,
        Command::Bench(args) => bench::run(&cli.global, args).await,
        Command::Soak(args) => soak::run(&cli.global, args).await,
        Command::Console(args) => console::run(&cli.global, args).await,
        Command::Alerts(cmd) => alerts::run(&cli.global, cmd).await,
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// clap checks every subcommand's arguments only when that subcommand is parsed; this
    /// checks them all (a `--version` option clashing with the version flag, two arguments with
    /// one name).
    #[test]
    fn every_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }

    /// `bench --help` lists every check (it is written by hand, and once missed one).
    #[test]
    fn bench_help_names_every_check() {
        let mut cli = super::Cli::command();
        let bench = cli.find_subcommand_mut("bench").expect("a bench command");
        let help = bench
            .render_long_help()
            .to_string()
            .replace(char::is_whitespace, "");
        for check in crate::bench::Check::ALL {
            assert!(
                help.contains(check.name()),
                "bench --help misses {}",
                check.name()
            );
        }
    }
}
