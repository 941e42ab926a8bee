//! # vantage
//!
//! Keeps the perspectives (read models) of an event-sourced system current from a PostgreSQL
//! event store, dead-letters events that keep failing so one poison event never wedges a
//! stream, and gives operators a CLI over those dead letters.
//!
//! The crate is laid out along the path of one event:
//! - [`store`]: every SQL call (events, claims, dead letters, instances) and the migrations;
//! - [`pipeline`]: the drain stages, claim → DLQ filter → envelope → cooldown → apply;
//! - [`perspective`]: the `Perspective` trait, SQL perspectives from configuration, the registry;
//! - [`daemon`]: the runtime, background loops and graceful shutdown;
//! - [`telemetry`]: metric names, logging, the small HTTP surface;
//! - [`dlq`]: the operator's actions on dead letters, shared by the CLI and the console;
//! - [`cli`]: the operator commands;
//! - [`console`]: the operator console in a browser;
//! - [`config`]: settings, defaults < file < environment < flags;
//! - [`throwaway`]: a disposable local PostgreSQL for the demo and the tests.

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
pub mod throwaway;
