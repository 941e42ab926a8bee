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
pub async fn run(_global: &GlobalArgs, _cmd: ConfigCommand) -> i32 {
    eprintln!("vantage config: not yet implemented");
    exit::FAILURE
}
