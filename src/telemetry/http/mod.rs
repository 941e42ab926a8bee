//! The daemon's small HTTP surface (docs/operations.md, "Logs and metrics"), on `http.listen`:
//!
//! - `GET /metrics`: Prometheus text from the process recorder ([`super::recorder`]);
//! - `GET /healthz`: liveness, 200 while every registered background loop is alive, i.e. has
//!   beaten recently and has not died (a Kubernetes liveness probe restarts the process
//!   otherwise);
//! - `GET /readyz`: readiness, 200 while the database is reachable, the migrations are current
//!   and the process is not shutting down; 503 with a short reason otherwise.
//!
//! The routes and their answers are in `probes`; binding and serving them in `server`; the
//! connection limits that keep slow clients from starving the probes, shared with the console,
//! in `bounded`.

pub(crate) mod bounded;
mod probes;
mod server;

pub use super::health::{Health, LoopHeartbeat, Unavailable};
pub(crate) use bounded::serve_router;
pub use bounded::{
    Limits, MAX_CONNECTIONS, MAX_REQUEST_BODY, REQUEST_BODY_TIMEOUT, REQUEST_HEAD_TIMEOUT,
};
pub use probes::{router, HttpState, METRICS_CONTENT_TYPE};
pub use server::{bind, serve, serve_on, serve_with};

#[cfg(test)]
mod test_support;
