//! The daemon: runtime, consumer loops, background loops, graceful shutdown.

use crate::cli::{exit, GlobalArgs};

/// `vantage run`.
pub async fn run_command(_global: &GlobalArgs) -> i32 {
    eprintln!("vantage run: not yet implemented");
    exit::FAILURE
}
