//! The SQL contract (docs/sql-contract.md): the functions and tables of `migrations/`, called
//! the way the daemon and the CLI call them, one test per rule; and the harness every binary
//! shares, checked on its own.
//!
//! `cargo test --test sql_contract` runs them; `cargo test --test sql_contract rules::` only
//! the contract.

#[path = "../support/mod.rs"]
mod support;

mod harness;
mod rules;
