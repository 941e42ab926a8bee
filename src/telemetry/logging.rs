//! Logging setup: `tracing` events as text or JSON lines, on **stderr** unless the caller gives
//! another writer.
//!
//! Never stdout: CLI commands print their results (tables, the JSON envelope) there, and a log
//! line in the middle would corrupt them. The filter is `log.level` unless `RUST_LOG` is set
//! (and not empty), in which case `RUST_LOG` wins (docs/operations.md, "Configuration").
//!
//! Text lines are coloured only when they go to a terminal and `NO_COLOR` is unset or empty
//! (<https://no-color.org>): a file, a pipe or the journal gets plain text. JSON lines never
//! carry colour.

use std::ffi::OsStr;
use std::io::IsTerminal;

use tracing::Subscriber;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use super::recorder::TelemetryError;
use super::traces::{self, TraceSettings};
use crate::config::{LogFormat, LogSettings};

/// The environment variable that overrides `log.level`.
pub const RUST_LOG: &str = "RUST_LOG";
/// The environment variable that turns colour off when set to anything but the empty string.
pub const NO_COLOR: &str = "NO_COLOR";

/// Installs the global `tracing` subscriber on stderr, without traces: see [`init_with_writer`].
///
/// # Errors
/// As [`init_with_writer`].
pub fn init(settings: &LogSettings) -> Result<(), TelemetryError> {
    init_with_writer(
        settings,
        None,
        std::io::stderr,
        std::io::stderr().is_terminal(),
    )
}

/// Installs the global `tracing` subscriber: lines in `settings.format` through `writer`,
/// filtered by `RUST_LOG` when set, else by `settings.level`. `terminal` says whether the
/// writer's target is a terminal (ask it with [`std::io::IsTerminal`]); text lines are coloured
/// only when it is and `NO_COLOR` does not say otherwise ([`colour`]). With `traces`, the spans
/// of [`traces::TARGET`] are exported as OpenTelemetry spans too ([`traces::layer`]); the log
/// filter does not apply to them, nor they to the log lines.
///
/// Idempotent: if a subscriber is already installed (a second daemon in the same test
/// process), the existing one is kept and this returns `Ok`.
///
/// # Errors
/// [`TelemetryError::LogFilter`] if the chosen filter does not parse; the message names
/// `RUST_LOG` or `log.level`, whichever was used. [`TelemetryError::Traces`] if the trace
/// exporter cannot be built.
pub fn init_with_writer<W>(
    settings: &LogSettings,
    traces: Option<&TraceSettings>,
    writer: W,
    terminal: bool,
) -> Result<(), TelemetryError>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let from_env = std::env::var(RUST_LOG)
        .ok()
        .filter(|v| !v.trim().is_empty());
    let filter = filter_for(settings, from_env.as_deref())?;
    let ansi = colour(terminal, std::env::var_os(NO_COLOR).as_deref());
    let provider = traces.map(traces::provider).transpose()?;
    let otel = provider.as_ref().map(traces::layer);
    let installed = tracing_subscriber::registry()
        .with(fmt_layer(settings.format, filter, writer, ansi))
        .with(otel)
        .try_init();
    // `try_init` fails only when a global subscriber (or `log` logger) is already set: keep it.
    if let (Ok(()), Some(provider)) = (installed, provider) {
        traces::remember(provider);
    }
    Ok(())
}

/// Whether text lines may carry ANSI colour: only on a terminal, and only when `no_color`
/// (the value of `NO_COLOR`) is unset or empty.
pub fn colour(terminal: bool, no_color: Option<&OsStr>) -> bool {
    terminal && !matches!(no_color, Some(v) if !v.is_empty())
}

/// The log lines' layer: `format` through `writer`, only what `filter` lets through. JSON lines
/// are never coloured: `ansi` only applies to text.
fn fmt_layer<S, W>(
    format: LogFormat,
    filter: EnvFilter,
    writer: W,
    ansi: bool,
) -> Box<dyn Layer<S> + Send + Sync>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let layer = tracing_subscriber::fmt::layer().with_writer(writer);
    match format {
        LogFormat::Text => layer
            .with_ansi(ansi)
            .fmt_fields(EscapedFields)
            .with_filter(filter)
            .boxed(),
        LogFormat::Json => layer
            .with_ansi(false)
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_filter(filter)
            .boxed(),
    }
}

/// A subscriber of log lines alone (the tests' own, not the global one).
#[cfg(test)]
fn subscriber<W>(
    format: LogFormat,
    filter: EnvFilter,
    writer: W,
    ansi: bool,
) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    Box::new(tracing_subscriber::registry().with(fmt_layer(format, filter, writer, ansi)))
}

/// The filter to use: `rust_log` (the value of `RUST_LOG`, if set and not empty) wins over
/// `settings.level`.
/// The text format's fields, as tracing's default formatter writes them (`message` bare, then
/// ` name=value`), with every value escaped ([`crate::text::one_line`]): a CR, LF or escape
/// sequence in an error text or a payload cannot forge or hide a log line.
struct EscapedFields;

impl<'writer> tracing_subscriber::fmt::FormatFields<'writer> for EscapedFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        writer: tracing_subscriber::fmt::format::Writer<'writer>,
        fields: R,
    ) -> std::fmt::Result {
        let mut visitor = EscapingVisitor {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct EscapingVisitor<'writer> {
    writer: tracing_subscriber::fmt::format::Writer<'writer>,
    first: bool,
    result: std::fmt::Result,
}

impl tracing::field::Visit for EscapingVisitor<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.record_debug(field, &format_args!("{value}"));
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if self.result.is_err() || field.name().starts_with("log.") {
            return;
        }
        let text = format!("{value:?}");
        let text = crate::text::one_line(&text);
        let separator = if self.first { "" } else { " " };
        self.first = false;
        self.result = if field.name() == "message" {
            write!(self.writer, "{separator}{text}")
        } else {
            write!(self.writer, "{separator}{}={text}", field.name())
        };
    }
}

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
    use std::sync::{Arc, Mutex};

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
        init_with_writer(&settings("warn"), None, std::io::sink, false).expect("third");
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(!colour(false, None));
        // https://no-color.org: set and not empty.
        assert!(!colour(true, Some(OsStr::new("1"))));
        assert!(!colour(true, Some(OsStr::new("false"))));
        assert!(colour(true, Some(OsStr::new(""))));
        assert!(!colour(false, Some(OsStr::new(""))));
    }

    /// Collects what the subscriber writes.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// One WARN event with a field through a fresh subscriber (not the global one).
    fn logged(format: LogFormat, ansi: bool) -> String {
        let out = Captured::default();
        let writer = out.clone();
        let filter = filter_for(&settings("info"), None).expect("filter");
        let subscriber = subscriber(format, filter, move || writer.clone(), ansi);
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(perspective = "p", "event dead-lettered");
        });
        let bytes = out.0.lock().expect("lock").clone();
        String::from_utf8(bytes).expect("utf-8")
    }

    #[test]
    fn text_is_coloured_only_when_asked_and_json_never() {
        let plain = logged(LogFormat::Text, false);
        assert!(
            plain.contains("WARN") && plain.contains("event dead-lettered"),
            "{plain}"
        );
        assert!(!plain.contains('\x1b'), "{plain:?}");
        let coloured = logged(LogFormat::Text, true);
        assert!(coloured.contains("\x1b["), "{coloured:?}");
        let json = logged(LogFormat::Json, true);
        assert!(!json.contains('\x1b'), "{json:?}");
        let line: serde_json::Value = serde_json::from_str(json.trim()).expect("one JSON line");
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["fields"]["perspective"], "p");
    }
}

#[cfg(test)]
mod escaping_tests {
    //! Issue 19, defect 6: a value with CR/LF or escape sequences cannot forge a log line.
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn text_logs_escape_field_values_and_messages() {
        let out = Captured::default();
        let writer = out.clone();
        let settings = LogSettings {
            format: LogFormat::Text,
            level: "info".to_owned(),
        };
        let filter = filter_for(&settings, None).expect("filter");
        let subscriber = subscriber(LogFormat::Text, filter, move || writer.clone(), false);
        let forged = "boom\r\n2026-01-01T00:00:00Z  INFO vantage::console::audit: console action actor=admin \u{1b}[2J";
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(error = %forged, detail = ?forged, "apply failed; the event is parked");
            tracing::info!("message with {forged}");
        });
        let text = String::from_utf8(out.0.lock().expect("lock").clone()).expect("utf-8");
        assert_eq!(text.lines().count(), 2, "{text}");
        assert!(!text.contains('\r') && !text.contains('\u{1b}'), "{text:?}");
        assert!(text.contains("boom\\r\\n2026"), "{text}");
    }
}
