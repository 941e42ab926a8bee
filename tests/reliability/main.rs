//! The real `vantage` binary as an operator meets it (docs/operations.md, "Reliability and
//! security"): crashes, a PostgreSQL restart and poison events; `run` and `migrate`, their exit
//! codes and signals; bad configuration, input and statements refused before anything is
//! written; automatic quarantine. Every run has a hard timeout.
//!
//! The long checks of RELIABILITY.md print what they measured:
//! `cargo test --test reliability crashes:: -- --nocapture --test-threads=1`.

#[path = "../support/mod.rs"]
mod support;

mod bad_config;
mod bad_input;
mod bad_statements;
mod crashes;
mod quarantine;
mod run_command;
mod soak;
mod versions;
