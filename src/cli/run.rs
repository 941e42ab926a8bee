//! `vantage run`: the daemon in the foreground until SIGTERM or SIGINT.
//!
//! The signal handlers are installed before anything slow, so a stop while the daemon still
//! connects or migrates is a clean exit with a log line (see [`super::signals`]).

use super::signals;
use super::{exit, GlobalArgs};
use crate::daemon::{DaemonBuilder, DaemonError};

/// Runs `vantage run`; returns its exit code (docs/cli.md, "Exit codes"; [`exit`]).
pub async fn run(global: &GlobalArgs) -> i32 {
    let settings = match global.load_settings() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vantage: {e}");
            return exit::CONFIG;
        }
    };
    let traces = match crate::telemetry::traces::from_process_env(&settings.telemetry) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("vantage: {e}");
            return exit::CONFIG;
        }
    };
    let stop = match signals::start_service(&settings.log, traces.as_ref()) {
        Ok(token) => token,
        Err(code) => return code,
    };
    let daemon = match DaemonBuilder::new(settings).shutdown_on(stop).start().await {
        Ok(d) => d,
        Err(DaemonError::Stopped) => {
            tracing::info!("stopped during start-up, before any work was claimed");
            return exit::OK;
        }
        Err(e) => {
            tracing::error!(error = %e, "vantage could not start");
            eprintln!("vantage: {e}");
            return e.exit_code();
        }
    };
    match daemon.wait().await {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("vantage: {e}");
            e.exit_code()
        }
    }
}
