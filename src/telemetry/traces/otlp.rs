//! The OTLP/HTTP exporter for `http/protobuf`: spans encoded straight from the SDK's
//! [`SpanData`] into one request body, with prost's wire-format primitives.
//!
//! Why not opentelemetry-otlp's own (still used for `http/json`): with every event traced, a
//! busy drain exports tens of thousands of spans a second, and that exporter first copies each
//! span into generated message structs (every key formatted into a new `String`, every value
//! cloned), then has prost walk them twice (lengths, then bytes), then frees them: about
//! 16 000 instructions a span on the export thread (callgrind), three quarters of what tracing
//! cost the drain. Writing the few OTLP messages vantage sends directly costs a small fraction
//! of that (see BENCHMARKS.md). The encoding is checked against the reference one
//! (opentelemetry-proto's) field for field in the tests.
//!
//! Like opentelemetry-otlp, it honours `OTEL_EXPORTER_OTLP_TRACES_HEADERS` (or
//! `OTEL_EXPORTER_OTLP_HEADERS`: `key=value` pairs, comma-separated, values percent-encoded) and
//! `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT` (or `OTEL_EXPORTER_OTLP_TIMEOUT`, milliseconds; 10 s by
//! default).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{SpanId, SpanKind, Status, TraceState};
use opentelemetry::{Array, KeyValue, Value};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use opentelemetry_sdk::Resource;
use prost::encoding::{encode_key, encode_varint, WireType};

/// The `http/protobuf` OTLP exporter (see the module's text).
#[derive(Debug)]
pub(crate) struct ProtobufExporter {
    client: reqwest::blocking::Client,
    endpoint: String,
    headers: reqwest::header::HeaderMap,
    resource: Resource,
}

/// Why an exporter could not be built: the variable (or setting) and what is wrong with it.
#[derive(Debug)]
pub(crate) struct BuildError {
    pub(crate) origin: String,
    pub(crate) value: String,
    pub(crate) expected: String,
}

/// The headers and the timeout the `OTEL_EXPORTER_OTLP_*` variables of `env` ask for (see
/// the module's text). [`super::resolve`] calls it too, so a malformed one stops `config
/// check` and `run` alike, before anything starts.
pub(crate) fn headers_and_timeout(
    env: impl Fn(&str) -> Option<String>,
) -> Result<(reqwest::header::HeaderMap, Duration), BuildError> {
    let var = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    let (headers_var, headers) = [
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
        "OTEL_EXPORTER_OTLP_HEADERS",
    ]
    .into_iter()
    .find_map(|name| var(name).map(|v| (name, v)))
    .unwrap_or(("", String::new()));
    let headers = parse_headers(&headers).map_err(|expected| BuildError {
        origin: headers_var.to_owned(),
        value: "(not shown: it may hold a secret)".to_owned(),
        expected,
    })?;
    let timeout = match [
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        "OTEL_EXPORTER_OTLP_TIMEOUT",
    ]
    .into_iter()
    .find_map(|name| var(name).map(|v| (name, v)))
    {
        None => Duration::from_secs(10),
        Some((name, v)) => v
            .trim()
            .parse::<u64>()
            .map(Duration::from_millis)
            .map_err(|_| BuildError {
                origin: name.to_owned(),
                value: v.clone(),
                expected: "a whole number of milliseconds".to_owned(),
            })?,
    };
    Ok((headers, timeout))
}

impl ProtobufExporter {
    /// An exporter posting to `endpoint` (the full `…/v1/traces` URL), configured by the
    /// process's `OTEL_EXPORTER_OTLP_*` headers and timeout variables.
    pub(crate) fn new(endpoint: &str) -> Result<ProtobufExporter, BuildError> {
        let (headers, timeout) = headers_and_timeout(|name| std::env::var(name).ok())?;
        // Built on a thread of its own: reqwest's blocking client starts a runtime, which
        // must not happen inside the caller's (the daemon builds this from async code).
        let client = std::thread::spawn(move || {
            reqwest::blocking::Client::builder()
                .timeout(timeout)
                .user_agent(concat!("vantage/", env!("CARGO_PKG_VERSION")))
                .build()
        })
        .join()
        .map_err(|_| BuildError {
            origin: "the OTLP exporter".to_owned(),
            value: endpoint.to_owned(),
            expected: "an HTTP client (building it panicked)".to_owned(),
        })?
        .map_err(|e| BuildError {
            origin: "the OTLP exporter".to_owned(),
            value: endpoint.to_owned(),
            expected: format!("an HTTP client: {e}"),
        })?;
        Ok(ProtobufExporter {
            client,
            endpoint: endpoint.to_owned(),
            headers,
            resource: Resource::builder_empty().build(),
        })
    }
}

/// `key=value,key2=value2`, values (and keys) percent-decoded, as the OTLP exporter
/// specification says.
fn parse_headers(text: &str) -> Result<reqwest::header::HeaderMap, String> {
    use reqwest::header::{HeaderName, HeaderValue};
    let mut map = reqwest::header::HeaderMap::new();
    for pair in text.split(',').filter(|p| !p.trim().is_empty()) {
        let (key, value) = pair
            .split_once('=')
            .ok_or_else(|| "key=value pairs separated by commas".to_owned())?;
        let key = percent_decode(key.trim())?;
        let value = percent_decode(value.trim())?;
        let name = HeaderName::from_bytes(key.as_bytes())
            .map_err(|_| "header names that HTTP allows".to_owned())?;
        let value = HeaderValue::from_str(&value)
            .map_err(|_| "header values that HTTP allows".to_owned())?;
        map.append(name, value);
    }
    Ok(map)
}

fn percent_decode(text: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| "percent-encoding with two hex digits after each %".to_owned())?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "UTF-8 once percent-decoded".to_owned())
}

impl SpanExporter for ProtobufExporter {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let mut body = Vec::with_capacity(batch.len() * 400 + 256);
        encode_request(&batch, &self.resource, &mut body);
        drop(batch);
        // The batch processor calls this from a thread of its own, outside any runtime: the
        // blocking send is the simplest correct thing there (as opentelemetry-otlp does).
        let result = self
            .client
            .post(&self.endpoint)
            .headers(self.headers.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/x-protobuf")
            .body(body)
            .send();
        let result = match result {
            Ok(response) if response.status().is_success() => Ok(()),
            Ok(response) => Err(OTelSdkError::InternalFailure(format!(
                "the collector answered {} to {}",
                response.status(),
                self.endpoint
            ))),
            Err(error) => Err(OTelSdkError::InternalFailure(format!(
                "cannot post spans to {}: {error}",
                self.endpoint
            ))),
        };
        std::future::ready(result)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.resource = resource.clone();
    }
}

// ---- The encoding: opentelemetry/proto/collector/trace/v1 and the messages it nests. ----

const LEN: WireType = WireType::LengthDelimited;

/// A nested message (or any length-delimited field) at `tag`, written by `body` right after
/// its key: its length is known only once it is written, so one byte is set aside for it (the
/// common case, under 128 bytes) and the body is moved along in the rare longer case.
fn message(buf: &mut Vec<u8>, tag: u32, body: impl FnOnce(&mut Vec<u8>)) {
    encode_key(tag, LEN, buf);
    let at = buf.len();
    buf.push(0);
    body(buf);
    let len = buf.len() - at - 1;
    if len < 0x80 {
        buf[at] = len as u8;
    } else {
        let mut prefix = [0u8; 10];
        let mut rest = &mut prefix[..];
        encode_varint(len as u64, &mut rest);
        let n = 10 - rest.len();
        buf.splice(at..=at, prefix[..n].iter().copied());
    }
}

fn bytes_field(buf: &mut Vec<u8>, tag: u32, bytes: &[u8]) {
    encode_key(tag, LEN, buf);
    encode_varint(bytes.len() as u64, buf);
    buf.extend_from_slice(bytes);
}

/// A proto3 string: left out when empty, as its default.
fn string(buf: &mut Vec<u8>, tag: u32, text: &str) {
    if !text.is_empty() {
        bytes_field(buf, tag, text.as_bytes());
    }
}

fn uint(buf: &mut Vec<u8>, tag: u32, value: u64) {
    if value != 0 {
        encode_key(tag, WireType::Varint, buf);
        encode_varint(value, buf);
    }
}

fn fixed64(buf: &mut Vec<u8>, tag: u32, value: u64) {
    if value != 0 {
        encode_key(tag, WireType::SixtyFourBit, buf);
        buf.extend_from_slice(&value.to_le_bytes());
    }
}

fn fixed32(buf: &mut Vec<u8>, tag: u32, value: u32) {
    if value != 0 {
        encode_key(tag, WireType::ThirtyTwoBit, buf);
        buf.extend_from_slice(&value.to_le_bytes());
    }
}

fn nanos(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// `AnyValue`'s body: exactly one member of its `oneof`, written even when it is a default.
fn any_value(buf: &mut Vec<u8>, value: &Value) {
    match value {
        Value::String(s) => bytes_field(buf, 1, s.as_str().as_bytes()),
        Value::Bool(b) => {
            encode_key(2, WireType::Varint, buf);
            encode_varint(u64::from(*b), buf);
        }
        Value::I64(i) => {
            encode_key(3, WireType::Varint, buf);
            // int64: a negative number is its two's complement, ten bytes.
            encode_varint(*i as u64, buf);
        }
        Value::F64(f) => {
            encode_key(4, WireType::SixtyFourBit, buf);
            buf.extend_from_slice(&f.to_bits().to_le_bytes());
        }
        Value::Array(array) => message(buf, 5, |buf| array_value(buf, array)),
        // (Value is non-exhaustive: a kind added later is sent as its text.)
        other => bytes_field(buf, 1, other.to_string().as_bytes()),
    }
}

/// `ArrayValue`'s body: each element an `AnyValue` at tag 1.
fn array_value(buf: &mut Vec<u8>, array: &Array) {
    let mut each = |v: Value| message(buf, 1, |buf| any_value(buf, &v));
    match array {
        Array::Bool(v) => v.iter().for_each(|x| each(Value::Bool(*x))),
        Array::I64(v) => v.iter().for_each(|x| each(Value::I64(*x))),
        Array::F64(v) => v.iter().for_each(|x| each(Value::F64(*x))),
        Array::String(v) => v.iter().for_each(|x| each(Value::String(x.clone()))),
        other => each(Value::String(other.to_string().into())),
    }
}

fn key_value(buf: &mut Vec<u8>, tag: u32, key: &str, value: &Value) {
    message(buf, tag, |buf| {
        string(buf, 1, key);
        message(buf, 2, |buf| any_value(buf, value));
    });
}

fn attributes<'a>(buf: &mut Vec<u8>, tag: u32, kvs: impl IntoIterator<Item = &'a KeyValue>) {
    for kv in kvs {
        key_value(buf, tag, kv.key.as_str(), &kv.value);
    }
}

fn trace_state(buf: &mut Vec<u8>, tag: u32, state: &TraceState) {
    if *state != TraceState::NONE {
        string(buf, tag, &state.header());
    }
}

/// `flags`: the W3C trace flags, and whether the parent (or the linked span) is remote, as the
/// reference exporter sets them.
fn flags(trace_flags: u8, remote: bool) -> u32 {
    const HAS_IS_REMOTE: u32 = 0x100;
    const IS_REMOTE: u32 = 0x200;
    u32::from(trace_flags) | HAS_IS_REMOTE | if remote { IS_REMOTE } else { 0 }
}

fn span_kind(kind: &SpanKind) -> u64 {
    match kind {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    }
}

/// One `Span` at `tag` of its `ScopeSpans`.
fn span(buf: &mut Vec<u8>, tag: u32, s: &SpanData) {
    message(buf, tag, |buf| {
        let cx = &s.span_context;
        bytes_field(buf, 1, &cx.trace_id().to_bytes());
        bytes_field(buf, 2, &cx.span_id().to_bytes());
        trace_state(buf, 3, cx.trace_state());
        if s.parent_span_id != SpanId::INVALID {
            bytes_field(buf, 4, &s.parent_span_id.to_bytes());
        }
        string(buf, 5, &s.name);
        uint(buf, 6, span_kind(&s.span_kind));
        fixed64(buf, 7, nanos(s.start_time));
        fixed64(buf, 8, nanos(s.end_time));
        attributes(buf, 9, &s.attributes);
        uint(buf, 10, u64::from(s.dropped_attributes_count));
        for event in s.events.iter() {
            message(buf, 11, |buf| {
                fixed64(buf, 1, nanos(event.timestamp));
                string(buf, 2, &event.name);
                attributes(buf, 3, &event.attributes);
                uint(buf, 4, u64::from(event.dropped_attributes_count));
            });
        }
        uint(buf, 12, u64::from(s.events.dropped_count));
        for link in s.links.iter() {
            message(buf, 13, |buf| {
                let cx = &link.span_context;
                bytes_field(buf, 1, &cx.trace_id().to_bytes());
                bytes_field(buf, 2, &cx.span_id().to_bytes());
                trace_state(buf, 3, cx.trace_state());
                attributes(buf, 4, &link.attributes);
                uint(buf, 5, u64::from(link.dropped_attributes_count));
                fixed32(buf, 6, flags(cx.trace_flags().to_u8(), cx.is_remote()));
            });
        }
        uint(buf, 14, u64::from(s.links.dropped_count));
        // Always present, as the reference exporter sends it (an empty one means unset).
        message(buf, 15, |buf| {
            let (description, code) = match &s.status {
                Status::Unset => ("", 0),
                Status::Ok => ("", 1),
                Status::Error { description } => (description.as_ref(), 2),
            };
            string(buf, 2, description);
            uint(buf, 3, code);
        });
        fixed32(
            buf,
            16,
            flags(cx.trace_flags().to_u8(), s.parent_span_is_remote),
        );
    });
}

/// An `ExportTraceServiceRequest` of `batch` from `resource`: one `ResourceSpans`, one
/// `ScopeSpans` per instrumentation scope, in the order the scopes first appear.
pub(crate) fn encode_request(batch: &[SpanData], resource: &Resource, buf: &mut Vec<u8>) {
    if batch.is_empty() {
        return;
    }
    message(buf, 1, |buf| {
        message(buf, 1, |buf| {
            for (key, value) in resource.iter() {
                key_value(buf, 1, key.as_str(), value);
            }
        });
        let mut scopes: Vec<&opentelemetry::InstrumentationScope> = Vec::new();
        for s in batch {
            if !scopes.contains(&&s.instrumentation_scope) {
                scopes.push(&s.instrumentation_scope);
            }
        }
        for scope in scopes {
            message(buf, 2, |buf| {
                message(buf, 1, |buf| {
                    string(buf, 1, scope.name());
                    string(buf, 2, scope.version().unwrap_or(""));
                    attributes(buf, 3, scope.attributes());
                });
                for s in batch.iter().filter(|s| s.instrumentation_scope == *scope) {
                    span(buf, 2, s);
                }
                string(buf, 3, scope.schema_url().unwrap_or(""));
            });
        }
        string(buf, 3, resource.schema_url().unwrap_or(""));
    });
}

#[cfg(test)]
mod tests;
