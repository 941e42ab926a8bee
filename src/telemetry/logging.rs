//! Logging setup: `tracing` events as text or JSON lines on **stderr**.
//!
//! Never stdout: CLI commands print their results (tables, the JSON envelope) there, and a log
//! line in the middle would corrupt them. The filter is `log.level` unless `RUST_LOG` is set
//! (and not empty), in which case `RUST_LOG` wins (SPEC §5).

use tracing_subscriber::EnvFilter;

use super::recorder::TelemetryError;
use crate::config::{LogFormat, LogSettings};

/// The environment variable that overrides `log.level`.
pub const RUST_LOG: &str = "RUST_LOG";

/// Installs the global `tracing` subscriber: stderr, `settings.format`, filtered by `RUST_LOG`
/// when set, else by `settings.level`. Idempotent: if a subscriber is already installed (a
/// second daemon in the same test process), the existing one is kept and this returns `Ok`.
///
/// # Errors
/// [`TelemetryError::LogFilter`] if the chosen filter does not parse; the message names
/// `RUST_LOG` or `log.level`, whichever was used.
pub fn init(settings: &LogSettings) -> Result<(), TelemetryError> {
    let from_env = std::env::var(RUST_LOG)
        .ok()
        .filter(|v| !v.trim().is_empty());
    let filter = filter_for(settings, from_env.as_deref())?;
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    // `try_init` fails only when a global subscriber (or `log` logger) is already set: keep it.
    let _already_set = match settings.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
    };
    Ok(())
}

/// The filter to use: `rust_log` (the value of `RUST_LOG`, if set and not empty) wins over
/// `settings.level`.
fn filter_for(settings: &LogSettings, rust_log: Option<&str>) -> Result<EnvFilter, TelemetryError> {
    let (origin, value) = match rust_log {
        Some(v) => (RUST_LOG, v),
        None => ("log.level", settings.level.as_str()),
    };
    EnvFilter::builder()
        .parse(value)
        .map_err(|e| TelemetryError::LogFilter {
            origin,
            value: value.to_owned(),
            message: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(level: &str) -> LogSettings {
        LogSettings {
            format: LogFormat::Text,
            level: level.to_owned(),
        }
    }

    #[test]
    fn rust_log_overrides_the_configured_level() {
        let f = filter_for(&settings("info"), Some("vantage=trace")).expect("filter");
        assert_eq!(f.to_string(), "vantage=trace");
        let f = filter_for(&settings("warn,vantage=debug"), None).expect("filter");
        assert!(f.to_string().contains("vantage=debug"), "{f}");
    }

    #[test]
    fn bad_filters_name_their_origin() {
        let e = filter_for(&settings("info"), Some("vantage=notalevel")).unwrap_err();
        assert!(e.to_string().contains("RUST_LOG"), "{e}");
        let e = filter_for(&settings("vantage=notalevel"), None).unwrap_err();
        assert!(e.to_string().contains("log.level"), "{e}");
    }

    #[test]
    fn init_is_idempotent() {
        init(&settings("info")).expect("first");
        init(&LogSettings {
            format: LogFormat::Json,
            level: "debug".to_owned(),
        })
        .expect("second");
    }
}
