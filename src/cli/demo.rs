//! `vantage demo`.
use clap::Args;

use super::{exit, GlobalArgs};

/// Options of `vantage demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Exit after the drain instead of running until Ctrl-C.
    #[arg(long)]
    pub once: bool,
}

/// Runs `vantage demo`.
pub async fn run(_global: &GlobalArgs, _args: DemoArgs) -> i32 {
    eprintln!("vantage demo: not yet implemented");
    exit::FAILURE
}
