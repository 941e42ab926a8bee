//! What `vantage demo` is given and where it serves: shared by its stages (drain, report).

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

use crate::cli::exit;
use crate::store::StoreError;

/// Options of `vantage demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Exit after the drain instead of running until Ctrl-C.
    #[arg(long)]
    pub once: bool,
    /// Orders in the sample (one stream each, 2 to 4 events).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(10..=1_000_000))]
    pub orders: u32,
    /// Customers placing them.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub customers: u32,
    /// Give up (exit 1) if the sample is not drained within this time.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub timeout: Duration,
}

/// Where the demo serves HTTP: the daemon's metrics and probes, and the console.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Addresses {
    /// `/metrics`, `/healthz`, `/readyz`.
    pub(crate) http: SocketAddr,
    /// The operator console, when it could be started.
    pub(crate) console: Option<SocketAddr>,
}

pub(crate) fn store_failure(what: &str, e: &StoreError) -> i32 {
    eprintln!("vantage demo: {what}: {e}");
    exit::for_store_error(e)
}
