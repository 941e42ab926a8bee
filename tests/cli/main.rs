//! The operator commands through the built binary (docs/cli.md): `vantage dlq`, triage,
//! `status`, `perspectives`, `append`, `config check`, usage errors, `demo`, and `perspectives
//! rebuild` against a running daemon. Outputs that must not drift are golden files under
//! `tests/golden/` (`UPDATE_GOLDEN=1` rewrites them after review).

#[path = "../support/mod.rs"]
mod support;

mod append_edges;
mod demo;
mod dlq;
mod golden;
mod other;
mod rebuild;
mod traces;
mod triage;
mod usage_errors;
mod versions;
