//! `vantage dlq`.
use clap::Subcommand;
use super::{exit, GlobalArgs};
/// `vantage dlq` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum DlqCommand {
    /// List open dead letters.
    List,
}
/// Runs `vantage dlq`.
pub async fn run(_global: &GlobalArgs, _cmd: DlqCommand) -> i32 {
    eprintln!("vantage dlq: not yet implemented");
    exit::FAILURE
}
