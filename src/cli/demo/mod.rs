//! `vantage demo`: the newcomer's first command (docs/cli.md, "The two commands").
//!
//! 1. Uses the configured database, or starts a [`ThrowawayPostgres`] when none is configured.
//! 2. Loads the demo perspectives from `config/demo.toml` (or the copy built into the binary),
//!    migrates, creates the read model tables in schema `demo` (idempotent).
//! 3. Starts the daemon in-process, with HTTP on `http.listen` (or a free port when it is busy).
//! 4. Appends a deterministic sample of orders — one stream per order, expected versions
//!    honoured — including a few `OrderPaid` events whose amount `revenue_by_day` cannot parse.
//! 5. Shows live progress on stderr until nothing is pending and the poison events are
//!    dead-lettered.
//! 6. Prints the dead letters, a few rows of the read model, the metrics URL and `vantage dlq`
//!    commands to try (stdout).
//! 7. Changes a read model without downtime (`versions`): builds version 2 of `order_status`
//!    beside version 1 while notes keep coming, cuts over, shows the new column and prints the
//!    rollback command; then keeps running until Ctrl-C (`--once`: exits).
//!
//! One file per part: `config` (what `config/demo.toml` and the usual layers say, and the
//! read model DDL of `config/demo.sql`), `sample` (the seeded order generator), `producer`
//! (appending it as an application would), `drain` (waiting for the daemon, with
//! `progress` on stderr), `report` (what is printed at the end, with the commands of
//! `cli_hint`), `versions` (the last act) and `signals` (Ctrl-C).

mod args;
mod cli_hint;
mod config;
mod console;
mod drain;
mod producer;
mod progress;
mod report;
mod sample;
mod signals;
mod versions;

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;

use tokio_util::sync::CancellationToken;

pub use self::args::DemoArgs;
use self::args::{store_failure, Addresses};
use self::config::{DatabaseSource, DemoConfig, READ_MODEL_DDL};
use self::console::DemoConsole;
use self::drain::produce_and_drain;
use self::producer::PRODUCERS;
use self::progress::init_logging;
use self::signals::watch_signals;
use super::{exit, GlobalArgs};
use crate::config::DatabaseUrl;
use crate::daemon::DaemonBuilder;
use crate::store::{Store, StoreOptions};
use crate::throwaway::ThrowawayPostgres;

/// Runs `vantage demo`. Exit 0 after the demo (and, without `--once`, after Ctrl-C); 1 when
/// the drain fails or times out; 2 when no database is configured and none can be started;
/// 69 when the configured database is unreachable; 78 for invalid configuration.
pub async fn run(global: &GlobalArgs, args: DemoArgs) -> i32 {
    let demo = match DemoConfig::load(global) {
        Ok(d) => d,
        Err(message) => {
            eprintln!("vantage demo: {message}");
            return exit::CONFIG;
        }
    };
    let tty = std::io::stderr().is_terminal();
    let traces = match crate::telemetry::traces::from_process_env(&demo.settings.telemetry) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("vantage demo: {e}");
            return exit::CONFIG;
        }
    };
    if let Err(message) = init_logging(&demo.settings.log, traces.as_ref(), tty) {
        eprintln!("vantage demo: {message}");
        return exit::CONFIG;
    }
    let interrupt = match watch_signals(tty) {
        Ok(token) => token,
        Err(e) => {
            eprintln!("vantage demo: cannot install the signal handlers: {e}");
            return exit::FAILURE;
        }
    };

    let mut demo = demo;
    let server = if demo.settings.database.url.is_none() {
        eprint!(
            "No database configured (set DATABASE_URL to use yours): starting a throwaway PostgreSQL... "
        );
        let _ = std::io::stderr().flush();
        match tokio::task::spawn_blocking(ThrowawayPostgres::start).await {
            Ok(Ok(server)) => {
                eprintln!(
                    "ready on 127.0.0.1:{}; it is removed when the demo exits.",
                    server.port()
                );
                demo.settings.database.url = Some(DatabaseUrl::new(server.url()));
                demo.database = DatabaseSource::Throwaway(server.url());
                Some(server)
            }
            Ok(Err(e)) => {
                eprintln!("failed.");
                eprintln!("vantage demo: {e}");
                return exit::USAGE;
            }
            Err(e) => {
                eprintln!("failed.");
                eprintln!("vantage demo: the PostgreSQL launcher crashed: {e}");
                return exit::FAILURE;
            }
        }
    } else {
        None
    };

    let code = if interrupt.is_cancelled() {
        if args.once {
            exit::FAILURE
        } else {
            exit::OK
        }
    } else {
        run_demo(&demo, &args, &interrupt, tty).await
    };

    if let Some(server) = server {
        // Stopping the server waits for it to exit: keep that off the async workers.
        let _ = tokio::task::spawn_blocking(move || drop(server)).await;
    }
    code
}

async fn run_demo(
    demo: &DemoConfig,
    args: &DemoArgs,
    interrupt: &CancellationToken,
    tty: bool,
) -> i32 {
    let settings = &demo.settings;
    let options = StoreOptions::from_settings(&settings.database);
    let store = match Store::connect(&options).await {
        Ok(store) => store,
        Err(e) => return store_failure("cannot connect to the database", &e),
    };
    let code = with_store(demo, args, interrupt, tty, &store, &options).await;
    store.close().await;
    code
}

async fn with_store(
    demo: &DemoConfig,
    args: &DemoArgs,
    interrupt: &CancellationToken,
    tty: bool,
    store: &Store,
    options: &StoreOptions,
) -> i32 {
    let settings = &demo.settings;
    match store.migrate().await {
        Ok(applied) if applied.is_empty() => eprintln!(
            "Schema \"{}\" on {} is up to date (no migration to apply).",
            store.schema(),
            store.target()
        ),
        Ok(applied) => {
            let list: Vec<String> = applied
                .iter()
                .map(|m| format!("{} ({})", m.version, m.description))
                .collect();
            eprintln!(
                "Migrated schema \"{}\" on {}: applied {}.",
                store.schema(),
                store.target(),
                list.join(", ")
            );
        }
        Err(e) => return store_failure("migration failed", &e),
    }
    if let Err(e) = sqlx::raw_sql(READ_MODEL_DDL).execute(store.pool()).await {
        eprintln!("vantage demo: cannot create the read model tables in schema \"demo\": {e}");
        return exit::FAILURE;
    }
    let names = demo.perspective_names();
    eprintln!(
        "Read model tables ready in schema \"demo\"; perspectives: {}.",
        names.join(", ")
    );

    let listen = settings.http.listen;
    let (listener, http_addr) = match crate::telemetry::http::bind(listen).await {
        Ok(bound) => bound,
        Err(first) => match crate::telemetry::http::bind(SocketAddr::new(listen.ip(), 0)).await {
            Ok((listener, addr)) => {
                eprintln!("{listen} is not available ({first}); serving HTTP on {addr} instead.");
                (listener, addr)
            }
            Err(e) => {
                eprintln!("vantage demo: {e}");
                return exit::FAILURE;
            }
        },
    };

    let daemon = match DaemonBuilder::new(settings.clone())
        .store(store.clone())
        .http_listener(listener)
        .shutdown_on(interrupt.clone())
        .start()
        .await
    {
        Ok(daemon) => daemon,
        Err(e) => {
            eprintln!("vantage demo: the daemon could not start: {e}");
            return e.exit_code();
        }
    };
    eprintln!(
        "Daemon running in this process ({} consumer loop{}); metrics on http://{http_addr}/metrics",
        settings.worker.consumers,
        if settings.worker.consumers == 1 { "" } else { "s" }
    );

    let console = DemoConsole::start(settings, store).await;
    if let Some(c) = &console {
        eprintln!(
            "Console on http://{}/ (dead letters, perspectives and lag in a browser)",
            c.addr
        );
    }
    let addrs = Addresses {
        http: http_addr,
        console: console.as_ref().map(|c| c.addr),
    };

    // The producer is another application: its own connections.
    let producer_options = StoreOptions {
        max_connections: PRODUCERS as u32,
        ..options.clone()
    };
    let mut versioned = None;
    let code = match Store::connect(&producer_options).await {
        Ok(producer) => {
            let mut code = produce_and_drain(demo, args, interrupt, tty, &producer, addrs).await;
            if code.is_none() && !interrupt.is_cancelled() {
                match versions::change_a_read_model(demo, store, interrupt, args.timeout).await {
                    Ok(daemon) => versioned = Some(daemon),
                    Err(c) => code = Some(c),
                }
            }
            producer.close().await;
            code
        }
        Err(e) => Some(store_failure("cannot connect the producer", &e)),
    };

    let code = match code {
        Some(code) => code,
        None => {
            // Finished: keep running until Ctrl-C unless --once.
            if !args.once {
                eprintln!("The daemon keeps running. Press Ctrl-C to stop.");
                interrupt.cancelled().await;
            }
            exit::OK
        }
    };
    if let Some(console) = console {
        console.stop().await;
    }
    if let Some(d) = versioned {
        if let Err(e) = d.shutdown().await {
            eprintln!("vantage demo: shutdown of the order_status daemon: {e}");
        }
    }
    if let Err(e) = daemon.shutdown().await {
        eprintln!("vantage demo: shutdown: {e}");
        return if code == exit::OK {
            e.exit_code()
        } else {
            code
        };
    }
    if code == exit::OK {
        eprintln!("Stopped.");
    }
    code
}
