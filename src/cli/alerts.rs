//! `vantage alerts`: Prometheus rules from the configuration.

use clap::Subcommand;

use super::{exit, GlobalArgs};

/// `vantage alerts` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum AlertsCommand {
    /// Print the Prometheus recording and alerting rules of the configured SLOs (or of the
    /// default SLOs when none is configured) as a rule file on stdout.
    Render,
}

/// Runs `vantage alerts`.
///
/// `render` prints the rule file (YAML; docs/operations.md, "SLOs and alerts") on stdout and
/// exits 0; an invalid configuration prints the error, which names the key, on stderr and exits
/// 78. It never connects to the database, so it runs wherever the configuration file is.
pub async fn run(global: &GlobalArgs, cmd: AlertsCommand) -> i32 {
    match cmd {
        AlertsCommand::Render => match global.load_settings() {
            Ok(settings) => {
                print!("{}", crate::telemetry::slo::render(&settings.slo));
                exit::OK
            }
            Err(e) => {
                eprintln!("{e}");
                exit::CONFIG
            }
        },
    }
}
