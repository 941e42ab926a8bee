//! The one harness of every integration-test binary, included by each with
//! `#[path = "../support/mod.rs"] mod support;`.
//!
//! - [`database`]: a fresh, empty database per test, on `DATABASE_URL` or on one throwaway
//!   server per binary; the fast daemon configuration.
//! - [`env`]: [`Env`], the world a test starts from (a migrated database, a store, a directory
//!   for the configuration file, an instance id), and the CLI fixtures ([`seeded`]).
//! - [`cli`]: the real binary run the CLI way ([`Env::run`], [`Run`], prompts).
//! - [`golden`]: output compared with `tests/golden/`.
//! - [`process`]: the real binary run the operator's way: hard timeouts, a background
//!   [`process::Daemon`] with its log, raw HTTP probes.
//! - [`deploy`]: the files under `deploy/` and the operators' tools.
//! - [`browser`]: chromium through chromedriver, for the console.

// Every binary compiles all of it and uses a different part.
#![allow(dead_code, unused_imports)]

pub mod browser;
pub mod cli;
pub mod database;
pub mod deploy;
pub mod env;
pub mod golden;
pub mod process;

pub use cli::{base_command, finish, Prompting, Run};
pub use database::{
    fast_daemon_toml, fast_settings, fresh_database, throwaway_server, TestDatabase,
};
pub use env::{seeded, Env, ORDER_1, ORDER_2, ORDER_3, STREAM_A, STREAM_B};
pub use golden::{assert_golden, normalise};
