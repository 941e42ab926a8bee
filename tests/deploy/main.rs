//! What ships beside the code, checked against it: the deploy kit (`deploy/`) with real
//! parsers, the operators' tools and a real Prometheus; and the README's library guide against
//! `examples/inventory.rs`.

#[path = "../support/mod.rs"]
mod support;

mod artifacts;
mod prometheus;
mod readme_library;
mod tools;
