//! Telemetry: the names of the metrics vantage exports ([`metrics`]), for dashboards and alert
//! rules. Logging setup, health state, the recorder and the HTTP surface (`/metrics`,
//! `/healthz`, `/readyz`) are the daemon's own, configured through [`crate::config`]; `slo`
//! turns `[[slo]]` into the Prometheus rules `vantage alerts render` prints.

pub(crate) mod health;
pub(crate) mod http;
pub(crate) mod logging;
pub mod metrics;
pub(crate) mod recorder;
pub(crate) mod slo;
pub mod traces;
