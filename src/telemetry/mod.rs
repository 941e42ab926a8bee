//! Telemetry: metric names (defined once), logging setup, health state, the HTTP surface.

pub mod health;
pub mod http;
pub mod logging;
pub mod metrics;
pub mod recorder;
