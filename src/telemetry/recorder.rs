//! The process-wide `metrics` recorder, rendered as Prometheus text by `GET /metrics`.
//!
//! [`install`] sets it up once per process and hands out the same [`PrometheusHandle`] on every
//! later call, because tests start several daemons in one process (their counters are then
//! shared: process-global by nature). The exporter's own HTTP listener is never started; the
//! daemon's axum server ([`super::http`]) serves the text from the handle.
//!
//! Also home of [`TelemetryError`], the error of the whole `telemetry` module.

use std::io;
use std::net::SocketAddr;
use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use super::metrics as names;

/// Upper bounds (seconds) of the latency histograms: 0.5 ms … 10 s, roughly ×2.5 per step.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Errors of logging setup, the metrics recorder and the HTTP server.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The global metrics recorder could not be installed (normally because another library in
    /// this process installed a different one first).
    #[error("cannot install the Prometheus metrics recorder: {0}")]
    Recorder(String),
    /// A log filter does not parse.
    #[error("invalid log filter {origin} = {value:?}: {message}; expected a level (error, warn, info, debug, trace) or tracing directives such as \"info,vantage=debug\"")]
    LogFilter {
        /// Where it came from: `RUST_LOG` or `log.level`.
        origin: &'static str,
        /// The filter as given.
        value: String,
        /// The parser's complaint.
        message: String,
    },
    /// A trace setting (a `[telemetry]` key or an `OTEL_*` variable) cannot be used.
    #[error("invalid {origin} = {value:?}: expected {expected}")]
    Traces {
        /// The key or variable.
        origin: String,
        /// Its value (one line, at most 200 characters).
        value: String,
        /// What would do.
        expected: String,
    },
    /// The HTTP listener could not be bound.
    #[error("cannot listen on {addr} (http.listen): {source}; is another process using that port, or is the address not local?")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// The HTTP server failed while running.
    #[error("the HTTP server (/metrics, /healthz, /readyz) failed: {0}")]
    Serve(#[source] io::Error),
}

/// The outcome of the one installation attempt of this process.
static INSTALLED: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();

/// Installs the global Prometheus recorder (first call) and returns its handle; later calls
/// return the same handle. On first installation it also registers help text and units for
/// every metric (`metrics::describe_all`), gives the latency histograms explicit buckets
/// ([`LATENCY_BUCKETS`], and [`APPEND_TO_APPLIED_BUCKETS`](names::APPEND_TO_APPLIED_BUCKETS)
/// for append → applied; rendered as real Prometheus histograms, `_bucket`/`_sum`/`_count`),
/// and sets `vantage_build_info{version="<crate version>"}` to 1.
///
/// # Errors
/// [`TelemetryError::Recorder`] if another recorder was installed in this process first; every
/// later call returns the same error.
pub fn install() -> Result<PrometheusHandle, TelemetryError> {
    INSTALLED
        .get_or_init(install_once)
        .clone()
        .map_err(TelemetryError::Recorder)
}

fn install_once() -> Result<PrometheusHandle, String> {
    let handle = PrometheusBuilder::new()
        .set_buckets(LATENCY_BUCKETS)
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(names::APPLY_DURATION_SECONDS.to_owned()),
                LATENCY_BUCKETS,
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(names::CLAIM_DURATION_SECONDS.to_owned()),
                LATENCY_BUCKETS,
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(names::APPEND_TO_APPLIED_SECONDS.to_owned()),
                names::APPEND_TO_APPLIED_BUCKETS,
            )
        })
        .and_then(PrometheusBuilder::install_recorder)
        .map_err(|e| e.to_string())?;
    names::describe_all();
    metrics::gauge!(names::BUILD_INFO, names::LABEL_VERSION => env!("CARGO_PKG_VERSION")).set(1.0);
    Ok(handle)
}

/// The current Prometheus text of this process, installing the recorder if needed. Meant for
/// tests and diagnostics; the daemon serves the same text on `GET /metrics`.
///
/// # Panics
/// If the recorder cannot be installed (another recorder was installed in this process).
pub fn render() -> String {
    match install() {
        Ok(handle) => handle.render(),
        Err(e) => panic!("{e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn install_is_idempotent_and_sets_build_info() {
        let first = install().expect("install");
        let second = install().expect("second install");
        metrics::counter!(names::LEASES_RELEASED_TOTAL).increment(1);
        let a = first.render();
        let b = second.render();
        assert!(a.contains(&format!(
            "{}{{{}=\"{}\"}} 1",
            names::BUILD_INFO,
            names::LABEL_VERSION,
            env!("CARGO_PKG_VERSION")
        )));
        assert!(a.contains(names::LEASES_RELEASED_TOTAL));
        assert!(b.contains(names::LEASES_RELEASED_TOTAL));
        assert!(render().contains(names::BUILD_INFO));
    }

    #[test]
    fn latency_histograms_have_explicit_buckets() {
        install().expect("install");
        metrics::histogram!(names::CLAIM_DURATION_SECONDS).record(0.003);
        let text = render();
        assert!(
            text.contains(&format!(
                "{}_bucket{{le=\"0.005\"}}",
                names::CLAIM_DURATION_SECONDS
            )),
            "{text}"
        );
        assert!(text.contains(&format!(
            "# TYPE {} histogram",
            names::CLAIM_DURATION_SECONDS
        )));
        assert!(text.contains(&format!("# HELP {} ", names::CLAIM_DURATION_SECONDS)));
    }

    #[test]
    fn append_to_applied_has_the_slo_buckets_and_shows_before_its_first_event() {
        install().expect("install");
        names::register_zeroes(&["recorder_test_zero".to_owned()]);
        metrics::histogram!(names::APPEND_TO_APPLIED_SECONDS, names::LABEL_PERSPECTIVE => "recorder_test_late")
            .record(42.0);
        let text = render();
        // Registered, never recorded: every bucket at 0.
        assert!(
            text.contains(&format!(
                "{}_count{{perspective=\"recorder_test_zero\"}} 0",
                names::APPEND_TO_APPLIED_SECONDS
            )),
            "{text}"
        );
        // The SLO thresholds are rendered as written in the rules (`le="30"`, not `30.0`).
        for (le, n) in [("30", 0), ("60", 1), ("3600", 1), ("+Inf", 1)] {
            assert!(
                text.contains(&format!(
                    "{}_bucket{{perspective=\"recorder_test_late\",le=\"{le}\"}} {n}",
                    names::APPEND_TO_APPLIED_SECONDS
                )),
                "le={le}: {text}"
            );
        }
    }
}
