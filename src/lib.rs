//! # vantage
//!
//! Keeps the perspectives (read models) of an event-sourced system current from a PostgreSQL
//! event store, dead-letters events that keep failing so one poison event never wedges a
//! stream, and gives operators a CLI over those dead letters.
//!
//! The crate is laid out along the path of one event:
//! - [`store`]: every SQL call (events, claims, dead letters, instances) and the migrations;
//!   the storage seam of the pipeline ([`WorkStore`](store::WorkStore)), with PostgreSQL
//!   ([`Store`](store::Store)) and in-memory ([`MemoryStore`](store::MemoryStore)) stores;
//! - `pipeline` (internal): the drain stages, claim → DLQ filter → envelope → cooldown → apply
//!   → settle, and the lease handle every change of a claimed row goes through;
//! - [`perspective`]: the [`Perspective`](perspective::Perspective) trait, typed Rust
//!   perspectives ([`TypedPerspective`](perspective::TypedPerspective)), SQL perspectives from
//!   configuration, the registry;
//! - [`daemon`]: the runtime, background loops and graceful shutdown;
//! - [`telemetry`]: metric names, logging, the small HTTP surface;
//! - `dlq`: the operator's actions on dead letters, shared by the CLI and the console;
//! - [`cli`]: the operator commands;
//! - `console`: the operator console in a browser;
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
//! [`ApplyTx`](perspective::ApplyTx), errors), [`daemon`] ([`DaemonBuilder`](daemon::DaemonBuilder)
//! and the handle it starts), [`config`] (`Settings`, `LoadOptions` and the sections),
//! [`testkit`], and from [`store`]: `Store`, `StoreOptions`, `NewEvent`, `AppendedEvent`,
//! `StoreError`, `MemoryStore`; [`cli::exit`] and [`cli::signals`] for a binary's exit codes and
//! signals; [`telemetry::metrics`] for metric names. The rest is public for the `vantage`
//! binary and this crate's integration tests (the operator commands, the statement-level
//! store functions) and may change in any release. The modules of the binary alone (`bench`,
//! `console`, `dlq`) and the pipeline are crate-private: integration tests reach what they
//! drive by hand (a pipeline pass, the console's router, the per-row statements) through the
//! hidden `internals` module.

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
