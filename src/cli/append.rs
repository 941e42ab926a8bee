//! `vantage append`.
use clap::Args;
use super::{exit, GlobalArgs};
/// Options of `vantage append`.
#[derive(Debug, Clone, Args)]
pub struct AppendArgs {
    /// Read JSON lines from this file instead of stdin.
    #[arg(long)]
    pub file: Option<std::path::PathBuf>,
}
/// Runs `vantage append`.
pub async fn run(_global: &GlobalArgs, _args: AppendArgs) -> i32 {
    eprintln!("vantage append: not yet implemented");
    exit::FAILURE
}
