//! `vantage perspectives`.
use clap::Subcommand;
use super::{exit, GlobalArgs};
/// `vantage perspectives` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum PerspectivesCommand {
    /// List registered perspectives.
    List,
}
/// Runs `vantage perspectives`.
pub async fn run(_global: &GlobalArgs, _cmd: PerspectivesCommand) -> i32 {
    eprintln!("vantage perspectives: not yet implemented");
    exit::FAILURE
}
