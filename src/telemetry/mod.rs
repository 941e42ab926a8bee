//! Telemetry: metric names (defined once), logging setup, the HTTP surface.

pub mod http;
pub mod logging;
pub mod metrics;
pub mod recorder;
