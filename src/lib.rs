//! # vantage
//!
//! Keeps the perspectives (read models) of an event-sourced system current from a PostgreSQL
//! event store, dead-letters events that keep failing so one poison event never wedges a
//! stream, and gives operators a CLI over those dead letters.
//!
//! The crate is laid out along the path of one event:
//! - [`store`]: every SQL call (events, claims, dead letters, instances) and the migrations;
//!   for a library user the PostgreSQL handle ([`Store`](store::Store)) and the in-memory store
//!   the testkit runs on ([`MemoryStore`](store::MemoryStore));
//! - `pipeline` (internal): the drain stages, claim → DLQ filter → envelope → cooldown → apply
//!   → settle, and the lease handle every change of a claimed row goes through;
//! - [`perspective`]: the [`Perspective`](perspective::Perspective) trait, typed Rust
//!   perspectives ([`TypedPerspective`](perspective::TypedPerspective)), their envelopes and
//!   errors (the registry and SQL perspectives from configuration are internal);
//! - [`daemon`]: the runtime, background loops and graceful shutdown;
//! - [`telemetry`]: the metric names (logging, health and the HTTP surface are internal);
//! - `dlq` (internal): the operator's actions on dead letters, shared by the CLI and the console;
//! - [`cli`]: the operator commands;
//! - `console` (internal): the operator console in a browser;
//! - [`config`]: settings, defaults < file < environment < flags;
//! - [`throwaway`]: a disposable local PostgreSQL for the demo and the tests;
//! - [`testkit`]: perspectives driven by hand on the in-memory store, for unit tests.
//!
//! ## As a library
//!
//! Read models written in Rust run in a binary of your own: implement
//! [`TypedPerspective`](perspective::TypedPerspective) (payloads deserialized with serde; one
//! that does not deserialize is dead-lettered at once) and add it to
//! [`DaemonBuilder`](daemon::DaemonBuilder) as [`Typed`](perspective::Typed)`(…)`. The
//! README's "Build your own daemon binary" walks through `examples/inventory.rs`. Test it
//! without PostgreSQL on the [`testkit`].
//!
//! ```no_run
//! # use async_trait::async_trait;
//! # use vantage::perspective::{ApplyError, ApplyTx, TypedEnvelope, TypedPerspective};
//! # #[derive(serde::Deserialize)]
//! # enum InventoryEvent { ItemReceived { sku: String } }
//! # struct InventoryLevels;
//! # #[async_trait]
//! # impl TypedPerspective for InventoryLevels {
//! #     type Event = InventoryEvent;
//! #     fn name(&self) -> &str { "inventory_levels" }
//! #     fn event_types(&self) -> Vec<String> { vec!["ItemReceived".into()] }
//! #     async fn apply(&self, _: &TypedEnvelope<InventoryEvent>, _: &mut ApplyTx<'_>)
//! #         -> Result<(), ApplyError> { Ok(()) }
//! # }
//! use vantage::config::{LoadOptions, Settings};
//! use vantage::daemon::DaemonBuilder;
//! use vantage::perspective::Typed;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let settings = Settings::load(&LoadOptions::default())?; // defaults < file < VANTAGE__…, and DATABASE_URL
//! let daemon = DaemonBuilder::new(settings)
//!     .perspective(Typed(InventoryLevels))
//!     .start()
//!     .await?;
//! daemon.wait().await?;
//! # Ok(())
//! # }
//! ```
//!
//! ## What is API
//!
//! For a library user, and under semver from 1.0: [`perspective`] (the traits, envelopes,
//! [`ApplyTx`](perspective::ApplyTx), errors, [`decode_event`](perspective::decode_event),
//! [`is_conflict`](perspective::is_conflict)), [`daemon`] ([`DaemonBuilder`](daemon::DaemonBuilder)
//! and the [`RunningDaemon`](daemon::RunningDaemon) it starts), [`config`] (`Settings`,
//! `LoadOptions`, the sections and their bounds), [`testkit`], [`throwaway`], and from
//! [`store`]: `Store` (connect, migrate, append, register a perspective, read the open dead
//! letters, the pool), `StoreOptions`, `NewEvent`, `AppendedEvent`, `InstanceId`, `StoreError`,
//! `MemoryStore`, `MemoryWork`; [`cli::exit`] and [`cli::signals`] for a binary's exit codes and
//! signals, and [`cli::Cli`]/[`cli::run`] for a binary that is vantage's command line;
//! [`telemetry::metrics`] for metric names.
//!
//! Everything else is crate-private. The crate's integration tests reach what they drive by
//! hand (a pipeline pass, the console's router, the per-row statements, the store's operator
//! methods through `internals::store::StoreInternals`) through the hidden `internals` module,
//! which is not API and may change in any release.

#![deny(missing_docs)]
pub(crate) mod bench;
pub mod cli;
pub mod config;
mod connection;
pub(crate) mod console;
pub mod daemon;
pub(crate) mod dlq;
pub mod perspective;
pub(crate) mod pipeline;
mod present;
pub(crate) mod soak;
mod sqlstate;
mod statement;
pub mod store;
pub mod telemetry;
pub mod testkit;
pub(crate) mod text;
pub mod throwaway;

#[cfg(test)]
mod model;

/// Not API: the crate's internals its own integration tests reach. Anything here may change in
/// any release.
#[doc(hidden)]
pub mod internals;
