//! `vantage console`: serves the operator console (docs/cli.md, "The console";
//! `crate::console`) on `console.listen` until SIGTERM or SIGINT.
//!
//! Exit codes: 0 after a stop by signal; 78 invalid configuration (a non-loopback
//! `console.listen` without authentication among them) or an address that cannot be bound;
//! 2 when the database cannot be reached or is not migrated (as the other operator commands);
//! 1 an unexpected failure of the server.

use clap::Args;

use super::output::{self, Failure};
use super::signals;
use super::{exit, GlobalArgs};
use crate::console::{self, ConsoleState};

/// Options of `vantage console`.
#[derive(Debug, Clone, Default, Args)]
pub struct ConsoleArgs {
    /// Address to listen on (overrides console.listen).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,
}

/// Runs `vantage console`; returns its exit code.
pub async fn run(global: &GlobalArgs, args: ConsoleArgs) -> i32 {
    let overrides = args
        .listen
        .map(|listen| vec![("console.listen".to_owned(), listen)])
        .unwrap_or_default();
    let settings = match crate::config::Settings::load(&crate::config::LoadOptions {
        config_path: global.config.clone(),
        database_url: global.database_url.clone(),
        overrides,
    }) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("vantage: {e}");
            return exit::CONFIG;
        }
    };
    // Bound first: an address in use or not ours fails at once, before any connection.
    let listen = settings.console.listen;
    let (listener, local) = match console::bind(listen).await {
        Ok(bound) => bound,
        Err(e) => {
            eprintln!("vantage: cannot listen on console.listen = {listen}: {e}");
            return exit::CONFIG;
        }
    };
    let stop = match signals::start_service(&settings.log, None) {
        Ok(token) => token,
        Err(code) => return code,
    };
    // A stop while still connecting is a clean exit, not a wait for the connect timeout.
    let connected = tokio::select! {
        connected = output::connect(&settings) => connected,
        () = stop.cancelled() => return exit::OK,
    };
    let store = match connected {
        Ok(store) => store.with_statement_timeout(console::STATEMENT_TIMEOUT),
        Err(Failure { message, code, .. }) => {
            eprintln!("{message}");
            return code;
        }
    };
    let state = ConsoleState::new(store.clone(), &settings);
    println!("vantage console on http://{local}/");
    tracing::info!(address = %local, read_only = settings.console.read_only,
        authentication = settings.console.authentication_configured(), "console listening");
    let served = console::serve(listener, state, stop).await;
    store.close().await;
    match served {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("vantage: the console stopped: {e}");
            exit::FAILURE
        }
    }
}
