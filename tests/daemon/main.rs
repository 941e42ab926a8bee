//! The daemon and its pipeline in-process, against a real PostgreSQL (docs/pipeline.md): the
//! drain, the hardening defects, typed perspectives, one behavioural suite on both stores, and
//! a smoke run of the benchmark harness.

#[path = "../support/mod.rs"]
mod support;

mod behaviour;
mod bench_smoke;
mod drain;
mod hardening;
mod samples;
mod typed_perspective;
