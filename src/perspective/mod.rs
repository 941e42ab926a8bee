//! Perspectives: the [`Perspective`] trait, typed Rust perspectives, SQL perspectives from
//! configuration, the registry.
//!
//! A Rust perspective implements either
//! - [`TypedPerspective`]: its payloads arrive deserialized (serde) as its own `Event` type in
//!   a [`TypedEnvelope`]; a payload that does not deserialize is dead-lettered at once
//!   (`PermanentFailure`) with serde's error as its text. Run it as [`Typed`]`(perspective)`.
//!   This is the one to start with;
//! - or [`Perspective`]: payloads as raw JSON in an [`EventEnvelope`].
//!
//! Either way the handler gets the database side of the apply as an [`ApplyTx`]: the
//! PostgreSQL transaction that also completes the event's work row, or, on the in-memory store
//! ([`MemoryStore`](crate::store::MemoryStore), the [`testkit`](crate::testkit)), none.
//!
//! Both are added to a daemon with
//! [`DaemonBuilder::perspective`](crate::daemon::DaemonBuilder::perspective); the README's
//! "Build your own daemon binary" and `examples/inventory.rs` walk through one.

mod handler;
pub mod rebuild;
pub(crate) mod registry;
pub(crate) mod sql;
mod typed;
mod versioned;

pub use crate::sqlstate::is_conflict;
pub use handler::{ApplyError, ApplyTx, EventEnvelope, Perspective, NO_TRANSACTION};
pub(crate) use registry::{prepare_sql_perspectives, PerspectiveRegistry, RegistryError};
pub(crate) use sql::SqlPerspective;
pub use typed::{decode_event, PayloadError, Typed, TypedEnvelope, TypedPerspective};
pub(crate) use versioned::register_versions;
