//! # vantage
//!
//! Keeps the perspectives (read models) of an event-sourced system current from a PostgreSQL
//! event store, dead-letters events that keep failing so one poison event never wedges a
//! stream, and gives operators a CLI over those dead letters.
//!
//! The crate is laid out along the path of one event:
//! - [`store`]: every SQL call (events, claims, dead letters, instances) and the migrations;
//! - [`pipeline`]: the drain stages, claim → DLQ filter → envelope → cooldown → apply;
//! - [`perspective`]: the [`Perspective`](perspective::Perspective) trait, typed Rust
//!   perspectives ([`TypedPerspective`](perspective::TypedPerspective)), SQL perspectives from
//!   configuration, the registry;
//! - [`daemon`]: the runtime, background loops and graceful shutdown;
//! - [`telemetry`]: metric names, logging, the small HTTP surface;
//! - [`dlq`]: the operator's actions on dead letters, shared by the CLI and the console;
//! - [`cli`]: the operator commands;
//! - [`console`]: the operator console in a browser;
//! - [`config`]: settings, defaults < file < environment < flags;
//! - [`throwaway`]: a disposable local PostgreSQL for the demo and the tests.
//!
//! ## As a library
//!
//! Read models written in Rust run in a binary of your own: implement
//! [`TypedPerspective`](perspective::TypedPerspective) (payloads deserialized with serde; one
//! that does not deserialize is dead-lettered at once) and add it to
//! [`DaemonBuilder`](daemon::DaemonBuilder) as [`Typed`](perspective::Typed)`(…)`. The
//! README's "Build your own daemon binary" walks through `examples/inventory.rs`.
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

pub mod bench;
pub mod cli;
pub mod config;
pub mod console;
pub mod daemon;
pub mod dlq;
pub mod perspective;
pub mod pipeline;
pub mod store;
pub mod telemetry;
pub mod testkit;
pub mod throwaway;
