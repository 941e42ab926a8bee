//! `vantage status`.
use clap::Args;
use super::{exit, GlobalArgs};
/// Options of `vantage status`.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}
/// Runs `vantage status`.
pub async fn run(_global: &GlobalArgs, _args: StatusArgs) -> i32 {
    eprintln!("vantage status: not yet implemented");
    exit::FAILURE
}
