//! Telemetry: metric names (defined once), logging setup, the HTTP surface.

pub mod metrics;
