//! `vantage config`.

use clap::Subcommand;

use super::{exit, GlobalArgs};

/// `vantage config` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum ConfigCommand {
    /// Validate the configuration and print it with secrets redacted.
    Check,
}

/// Runs `vantage config`.
///
/// `check` prints the effective configuration (every layer merged) as TOML on stdout, the
/// database password replaced by `***`, and exits 0; an invalid configuration prints the error,
/// which names the key, on stderr and exits 78. It never connects to the database.
pub async fn run(global: &GlobalArgs, cmd: ConfigCommand) -> i32 {
    match cmd {
        ConfigCommand::Check => match global.load_settings() {
            Ok(settings) => {
                print!("{}", settings.redacted_toml());
                exit::OK
            }
            Err(e) => {
                eprintln!("{e}");
                exit::CONFIG
            }
        },
    }
}
