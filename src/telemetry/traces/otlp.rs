//! The OTLP/HTTP export for `http/protobuf`: a span processor that encodes every span into the
//! body of the next request as it ends, with prost's wire-format primitives, and a thread of its
//! own that posts the bodies.
//!
//! Why not opentelemetry-otlp's exporter behind the SDK's batch processor (still used for
//! `http/json`): with every event traced, a busy drain exports tens of thousands of spans a
//! second. That exporter first copies each span into generated message structs (every key
//! formatted into a new `String`, every value cloned), then has prost walk them twice (lengths,
//! then bytes), then frees them: about 16 000 instructions a span (callgrind). And the batch
//! processor moves each span's data through a channel to its thread, to be freed there. Here a
//! span is written once, where it ends, into a buffer the thread takes a whole batch of at a
//! time; the apply spans ([`super::apply`]) are written from their flat record, never becoming
//! the SDK's span data at all. The encoding is checked against the reference one
//! (opentelemetry-proto's) field for field in the tests.
//!
//! It batches as the SDK's processor does, and reads the same variables: a request every
//! `OTEL_BSP_SCHEDULE_DELAY` ms (5 000), or as soon as `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` spans
//! (512) are waiting; at most `OTEL_BSP_MAX_QUEUE_SIZE` spans wait (16 384 here: see
//! [`super::MAX_QUEUED_SPANS`]), beyond which spans are dropped and counted as failed, never
//! the drain slowed. Like opentelemetry-otlp, it honours `OTEL_EXPORTER_OTLP_TRACES_HEADERS` (or
//! `OTEL_EXPORTER_OTLP_HEADERS`: `key=value` pairs, comma-separated, values percent-encoded) and
//! `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT` (or `OTEL_EXPORTER_OTLP_TIMEOUT`, milliseconds; 10 s by
//! default).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{Link, SpanContext, SpanId, SpanKind, Status, TraceState};
use opentelemetry::{Array, Context, InstrumentationScope, KeyValue, Value};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{SpanData, SpanProcessor};
use opentelemetry_sdk::Resource;
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};

use super::apply::{Attr, Ended, NAME_PREFIX};

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

/// Posts request bodies to the collector.
struct Poster {
    client: reqwest::blocking::Client,
    endpoint: String,
    headers: reqwest::header::HeaderMap,
}

impl Poster {
    /// A poster to `endpoint` (the full `…/v1/traces` URL), configured by the process's
    /// `OTEL_EXPORTER_OTLP_*` headers and timeout variables.
    fn new(endpoint: &str) -> Result<Poster, BuildError> {
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
        Ok(Poster {
            client,
            endpoint: endpoint.to_owned(),
            headers,
        })
    }

    fn post(&self, body: Vec<u8>) -> OTelSdkResult {
        // On the queue's own thread, outside any runtime: the blocking send is the simplest
        // correct thing there (as opentelemetry-otlp does).
        let result = self
            .client
            .post(&self.endpoint)
            .headers(self.headers.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/x-protobuf")
            .body(body)
            .send();
        match result {
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
        }
    }
}

/// How the queue batches (the `OTEL_BSP_*` variables, read as the SDK reads them).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub(crate) max_queue: usize,
    pub(crate) max_batch: usize,
    pub(crate) delay: Duration,
}

impl Limits {
    /// From `env`, with `max_queue` unless `OTEL_BSP_MAX_QUEUE_SIZE` says otherwise.
    pub(crate) fn from_env(env: impl Fn(&str) -> Option<String>, max_queue: usize) -> Limits {
        let number = |name: &str| env(name).and_then(|v| v.trim().parse::<u64>().ok());
        let max_queue = number("OTEL_BSP_MAX_QUEUE_SIZE").map_or(max_queue, |n| n as usize);
        let max_batch = number("OTEL_BSP_MAX_EXPORT_BATCH_SIZE").map_or(512, |n| n as usize);
        Limits {
            max_queue: max_queue.max(1),
            // (as the SDK: a batch is never larger than the queue)
            max_batch: max_batch.clamp(1, max_queue.max(1)),
            delay: Duration::from_millis(number("OTEL_BSP_SCHEDULE_DELAY").unwrap_or(5_000)),
        }
    }
}

/// The `http/protobuf` span processor (see the module's text).
#[derive(Debug)]
pub(crate) struct Queue {
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct Shared {
    state: Mutex<State>,
    /// The thread waits on it for a full batch, a flush or the end.
    wake: Condvar,
    /// Flushes and the end wait on it for the thread.
    done: Condvar,
    resource: Resource,
    /// The scope of the apply spans (and of every span of vantage's tracer).
    scope: InstrumentationScope,
    limits: Limits,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct State {
    /// The bodies being written, one per scope; the first is `Shared::scope`'s.
    open: Vec<Chunk>,
    /// Whole batches waiting for the thread.
    ready: VecDeque<Chunk>,
    /// Spans in `open` and `ready`.
    queued: usize,
    flush_asked: u64,
    flush_done: u64,
    stop: bool,
    stopped: bool,
    /// Bodies already posted, kept for their capacity.
    spare: Vec<Vec<u8>>,
    /// The size of the last whole batch: a new body is given about as much room, so it does
    /// not grow by copies while spans are written into it.
    batch_bytes: usize,
}

impl State {
    fn new_body(&mut self) -> Vec<u8> {
        self.spare
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(self.batch_bytes + self.batch_bytes / 8))
    }
}

/// The encoded spans of one scope: each a `Span` at tag 2 of a `ScopeSpans`.
struct Chunk {
    scope: InstrumentationScope,
    spans: usize,
    body: Vec<u8>,
}

impl Queue {
    /// A queue posting to `endpoint` (the full `…/v1/traces` URL) the spans of `resource`,
    /// those of the apply spans' `scope` among them, and the thread that posts.
    pub(crate) fn new(
        endpoint: &str,
        resource: Resource,
        scope: InstrumentationScope,
        limits: Limits,
    ) -> Result<Queue, BuildError> {
        let poster = Poster::new(endpoint)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                open: vec![Chunk {
                    scope: scope.clone(),
                    spans: 0,
                    body: Vec::new(),
                }],
                ..State::default()
            }),
            wake: Condvar::new(),
            done: Condvar::new(),
            resource,
            scope,
            limits,
        });
        let thread = std::thread::Builder::new()
            .name("vantage-otlp".to_owned())
            .spawn({
                let shared = Arc::clone(&shared);
                move || shared.run(&poster)
            })
            .map_err(|e| BuildError {
                origin: "the OTLP exporter".to_owned(),
                value: endpoint.to_owned(),
                expected: format!("a thread to export from: {e}"),
            })?;
        Ok(Queue {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// An ended apply span, written into the next body.
    pub(crate) fn push_apply(&self, span: &Ended) {
        self.shared.push(None, |buf| apply_span(buf, 2, span));
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while encoding leaves nothing half-done that matters: the state stays usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes one span of `scope` (`None`: the apply spans' own) with `write`, unless the queue
    /// is full or ended.
    fn push(&self, scope: Option<&InstrumentationScope>, write: impl FnOnce(&mut Vec<u8>)) {
        let mut state = self.lock();
        if state.stop {
            return;
        }
        if state.queued >= self.limits.max_queue {
            drop(state);
            super::dropped(1);
            return;
        }
        let at = match scope {
            None => 0,
            Some(scope) => match state.open.iter().position(|c| c.scope == *scope) {
                Some(at) => at,
                None => {
                    let body = state.new_body();
                    state.open.push(Chunk {
                        scope: scope.clone(),
                        spans: 0,
                        body,
                    });
                    state.open.len() - 1
                }
            },
        };
        state.queued += 1;
        let chunk = &mut state.open[at];
        write(&mut chunk.body);
        chunk.spans += 1;
        if chunk.spans >= self.limits.max_batch {
            state.batch_bytes = state.open[at].body.len();
            let full = self.take_open(&mut state, at);
            state.ready.push_back(full);
            self.wake.notify_one();
        }
    }

    /// The open chunk at `at`, replaced by an empty one if it is the apply spans' scope's.
    fn take_open(&self, state: &mut State, at: usize) -> Chunk {
        if at == 0 {
            let body = state.new_body();
            std::mem::replace(
                &mut state.open[0],
                Chunk {
                    scope: self.scope.clone(),
                    spans: 0,
                    body,
                },
            )
        } else {
            state.open.remove(at)
        }
    }

    /// The thread: waits for a whole batch, the delay, a flush or the end, then posts what is
    /// waiting, one request per chunk.
    fn run(&self, poster: &Poster) {
        let mut due = Instant::now() + self.limits.delay;
        loop {
            let (chunks, flush, stop) = {
                let mut state = self.lock();
                loop {
                    let now = Instant::now();
                    if !state.ready.is_empty()
                        || state.flush_asked > state.flush_done
                        || state.stop
                        || now >= due
                    {
                        break;
                    }
                    state = self
                        .wake
                        .wait_timeout(state, due - now)
                        .map_or_else(|e| e.into_inner().0, |(s, _)| s);
                }
                let flush = state.flush_asked;
                let everything = flush > state.flush_done || state.stop || Instant::now() >= due;
                if everything {
                    due = Instant::now() + self.limits.delay;
                    for at in (0..state.open.len()).rev() {
                        if state.open[at].spans > 0 {
                            let chunk = self.take_open(&mut state, at);
                            state.ready.push_back(chunk);
                        }
                    }
                }
                let chunks: Vec<Chunk> = state.ready.drain(..).collect();
                state.queued -= chunks.iter().map(|c| c.spans).sum::<usize>();
                (chunks, flush, state.stop)
            };
            for chunk in chunks {
                let mut body = Vec::with_capacity(chunk.body.len() + 512);
                request(
                    &self.resource,
                    &[(&chunk.scope, chunk.body.as_slice())],
                    &mut body,
                );
                super::counted(&poster.post(body), chunk.spans as u64);
                let mut spare = chunk.body;
                spare.clear();
                let mut state = self.lock();
                if state.spare.len() < 4 {
                    state.spare.push(spare);
                }
            }
            let mut state = self.lock();
            state.flush_done = state.flush_done.max(flush);
            if stop {
                state.stopped = true;
            }
            self.done.notify_all();
            if stop {
                return;
            }
        }
    }

    /// Waits until `done` says so of the state, or `timeout` passes: whether it did.
    fn wait_for(&self, timeout: Duration, done: impl Fn(&State) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock();
        while !done(&state) {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            state = self
                .done
                .wait_timeout(state, deadline - now)
                .map_or_else(|e| e.into_inner().0, |(s, _)| s);
        }
        true
    }
}

/// How long a flush waits for the thread: the export's own timeout bounds each request.
const FLUSH_WAIT: Duration = Duration::from_secs(60);

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        let scope = &span.instrumentation_scope;
        let scope = (*scope != self.shared.scope).then_some(scope);
        self.shared.push(scope, |buf| self::span(buf, 2, &span));
    }

    fn force_flush(&self) -> OTelSdkResult {
        let asked = {
            let mut state = self.shared.lock();
            if state.stopped {
                return Ok(());
            }
            state.flush_asked += 1;
            state.flush_asked
        };
        self.shared.wake.notify_one();
        if self
            .shared
            .wait_for(FLUSH_WAIT, |s| s.flush_done >= asked || s.stopped)
        {
            Ok(())
        } else {
            Err(OTelSdkError::Timeout(FLUSH_WAIT))
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        {
            let mut state = self.shared.lock();
            if state.stopped {
                return Ok(());
            }
            state.stop = true;
        }
        self.shared.wake.notify_one();
        if !self.shared.wait_for(timeout, |s| s.stopped) {
            return Err(OTelSdkError::Timeout(timeout));
        }
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
        Ok(())
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        // Not waited for: the provider's shutdown is what exports the last spans.
        self.shared.lock().stop = true;
        self.shared.wake.notify_one();
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

// ---- The encoding: opentelemetry/proto/collector/trace/v1 and the messages it nests. ----

const LEN: WireType = WireType::LengthDelimited;

/// A nested message (or any length-delimited field) at `tag`, written by `body` right after
/// its key: its length is known only once it is written, so `room` bytes are set aside for it
/// (1 for a message that is usually under 128 bytes, 2 for one usually under 16 KiB) and the
/// body is moved when its length needs another size.
fn message_in(buf: &mut Vec<u8>, tag: u32, room: usize, body: impl FnOnce(&mut Vec<u8>)) {
    encode_key(tag, LEN, buf);
    let at = buf.len();
    buf.extend_from_slice(&[0u8; 2][..room]);
    body(buf);
    let len = buf.len() - at - room;
    let mut prefix = [0u8; 10];
    let n = {
        let mut rest = &mut prefix[..];
        encode_varint(len as u64, &mut rest);
        10 - rest.len()
    };
    if n == room {
        buf[at..at + n].copy_from_slice(&prefix[..n]);
    } else if n < room {
        buf.copy_within(at + room.., at + n);
        buf.truncate(buf.len() - (room - n));
        buf[at..at + n].copy_from_slice(&prefix[..n]);
    } else {
        buf.splice(at..at + room, prefix[..n].iter().copied());
    }
}

/// A message usually under 128 bytes (see [`message_in`]).
fn message(buf: &mut Vec<u8>, tag: u32, body: impl FnOnce(&mut Vec<u8>)) {
    message_in(buf, tag, 1, body);
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
        Value::I64(i) => any_i64(buf, *i),
        Value::F64(f) => {
            encode_key(4, WireType::SixtyFourBit, buf);
            buf.extend_from_slice(&f.to_bits().to_le_bytes());
        }
        Value::Array(array) => message(buf, 5, |buf| array_value(buf, array)),
        // (Value is non-exhaustive: a kind added later is sent as its text.)
        other => bytes_field(buf, 1, other.to_string().as_bytes()),
    }
}

fn any_i64(buf: &mut Vec<u8>, i: i64) {
    encode_key(3, WireType::Varint, buf);
    // int64: a negative number is its two's complement, ten bytes.
    encode_varint(i as u64, buf);
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

/// A `Span.Link` at tag 13.
fn link(buf: &mut Vec<u8>, link: &Link) {
    link_to(
        buf,
        &link.span_context,
        &link.attributes,
        link.dropped_attributes_count,
    );
}

fn link_to(buf: &mut Vec<u8>, cx: &SpanContext, attrs: &[KeyValue], dropped: u32) {
    message(buf, 13, |buf| {
        bytes_field(buf, 1, &cx.trace_id().to_bytes());
        bytes_field(buf, 2, &cx.span_id().to_bytes());
        trace_state(buf, 3, cx.trace_state());
        attributes(buf, 4, attrs);
        uint(buf, 5, u64::from(dropped));
        fixed32(buf, 6, flags(cx.trace_flags().to_u8(), cx.is_remote()));
    });
}

/// The `Status` at tag 15: always present, as the reference exporter sends it (an empty one
/// means unset).
fn status(buf: &mut Vec<u8>, status: &Status) {
    message(buf, 15, |buf| {
        let (description, code) = match status {
            Status::Unset => ("", 0),
            Status::Ok => ("", 1),
            Status::Error { description } => (description.as_ref(), 2),
        };
        string(buf, 2, description);
        uint(buf, 3, code);
    });
}

/// One `Span` at `tag` of its `ScopeSpans`.
fn span(buf: &mut Vec<u8>, tag: u32, s: &SpanData) {
    message_in(buf, tag, 2, |buf| {
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
        for l in s.links.iter() {
            link(buf, l);
        }
        uint(buf, 14, u64::from(s.links.dropped_count));
        status(buf, &s.status);
        fixed32(
            buf,
            16,
            flags(cx.trace_flags().to_u8(), s.parent_span_is_remote),
        );
    });
}

/// One apply span at `tag` of its `ScopeSpans`, from its record: the same bytes as [`span`]
/// writes for the span data the record stands for ([`Ended::span_data`]; a test holds them
/// equal), without making it. Written field by field with the lengths counted beforehand: this
/// runs once per traced event.
pub(super) fn apply_span(buf: &mut Vec<u8>, tag: u32, s: &Ended) {
    let r = &s.record;
    // (The fixed part is under 400 bytes; the texts come on top, the error text twice at most.)
    buf.reserve(400 + 2 * r.text_len() + status_len(&s.status));
    message_in(buf, tag, 2, |buf| {
        let cx = &r.context;
        buf.extend_from_slice(&[key(1, LEN), 16]);
        buf.extend_from_slice(&cx.trace_id().to_bytes());
        buf.extend_from_slice(&[key(2, LEN), 8]);
        buf.extend_from_slice(&cx.span_id().to_bytes());
        trace_state(buf, 3, cx.trace_state());
        if r.parent != SpanId::INVALID {
            buf.extend_from_slice(&[key(4, LEN), 8]);
            buf.extend_from_slice(&r.parent.to_bytes());
        }
        let perspective = r.perspective();
        buf.push(key(5, LEN));
        varint(buf, (NAME_PREFIX.len() + perspective.len()) as u64);
        buf.extend_from_slice(NAME_PREFIX.as_bytes());
        buf.extend_from_slice(perspective.as_bytes());
        buf.extend_from_slice(&[
            key(6, WireType::Varint),
            span_kind(&SpanKind::Consumer) as u8,
        ]);
        buf.push(key(7, WireType::SixtyFourBit));
        buf.extend_from_slice(&nanos(r.start).to_le_bytes());
        buf.push(key(8, WireType::SixtyFourBit));
        buf.extend_from_slice(&nanos(s.end).to_le_bytes());
        let mut uuid = [0u8; uuid::fmt::Hyphenated::LENGTH];
        for (name, value) in s.attributes(&mut uuid) {
            attribute(buf, name, &value);
        }
        for cx in r.links.iter().flatten() {
            link_to(buf, cx, &[], 0);
        }
        status(buf, &s.status);
        // (tag 16 takes two bytes of key)
        buf.extend_from_slice(&[0x85, 0x01]);
        buf.extend_from_slice(&flags(cx.trace_flags().to_u8(), r.parent_is_remote).to_le_bytes());
    });
}

/// The key of `tag` (under 16) with `wire` type: one byte.
const fn key(tag: u32, wire: WireType) -> u8 {
    (tag << 3) as u8 | wire as u8
}

fn varint(buf: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        buf.push(value as u8 | 0x80);
        value >>= 7;
    }
    buf.push(value as u8);
}

/// A `KeyValue` at tag 9 of a span, with a string or an int value: the lengths are counted,
/// not reserved and moved.
fn attribute(buf: &mut Vec<u8>, name: &str, value: &Attr<'_>) {
    let any = match value {
        Attr::Str(text) => 1 + encoded_len_varint(text.len() as u64) + text.len(),
        Attr::I64(i) => 1 + encoded_len_varint(*i as u64),
    };
    let kv = 1
        + encoded_len_varint(name.len() as u64)
        + name.len()
        + 1
        + encoded_len_varint(any as u64)
        + any;
    buf.push(key(9, LEN));
    varint(buf, kv as u64);
    buf.push(key(1, LEN));
    varint(buf, name.len() as u64);
    buf.extend_from_slice(name.as_bytes());
    buf.push(key(2, LEN));
    varint(buf, any as u64);
    match value {
        Attr::Str(text) => {
            buf.push(key(1, LEN));
            varint(buf, text.len() as u64);
            buf.extend_from_slice(text.as_bytes());
        }
        Attr::I64(i) => {
            buf.push(key(3, WireType::Varint));
            // int64: a negative number is its two's complement, ten bytes.
            varint(buf, *i as u64);
        }
    }
}

fn status_len(status: &Status) -> usize {
    match status {
        Status::Error { description } => description.len(),
        _ => 0,
    }
}

fn length_delimited_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

/// An `ExportTraceServiceRequest` from `resource`: one `ResourceSpans`, one `ScopeSpans` per
/// `(scope, spans)`, the spans already encoded (each a `Span` at tag 2). The lengths of the
/// enclosing messages are counted first, so the spans are copied once.
fn request(resource: &Resource, scopes: &[(&InstrumentationScope, &[u8])], out: &mut Vec<u8>) {
    let mut head = Vec::new();
    for (key, value) in resource.iter() {
        key_value(&mut head, 1, key.as_str(), value);
    }
    let resource_schema = resource.schema_url().unwrap_or("");
    let scope_heads: Vec<(Vec<u8>, &str)> = scopes
        .iter()
        .map(|(scope, _)| {
            let mut h = Vec::new();
            string(&mut h, 1, scope.name());
            string(&mut h, 2, scope.version().unwrap_or(""));
            attributes(&mut h, 3, scope.attributes());
            (h, scope.schema_url().unwrap_or(""))
        })
        .collect();
    let schema_len = |tag, s: &str| {
        if s.is_empty() {
            0
        } else {
            length_delimited_len(tag, s.len())
        }
    };
    let scope_lens: Vec<usize> = scope_heads
        .iter()
        .zip(scopes)
        .map(|((h, schema), (_, spans))| {
            length_delimited_len(1, h.len()) + spans.len() + schema_len(3, schema)
        })
        .collect();
    let resource_spans_len = length_delimited_len(1, head.len())
        + scope_lens
            .iter()
            .map(|&l| length_delimited_len(2, l))
            .sum::<usize>()
        + schema_len(3, resource_schema);
    encode_key(1, LEN, out);
    encode_varint(resource_spans_len as u64, out);
    bytes_field(out, 1, &head);
    for (((h, schema), (_, spans)), len) in scope_heads.iter().zip(scopes).zip(&scope_lens) {
        encode_key(2, LEN, out);
        encode_varint(*len as u64, out);
        bytes_field(out, 1, h);
        out.extend_from_slice(spans);
        string(out, 3, schema);
    }
    string(out, 3, resource_schema);
}

/// An `ExportTraceServiceRequest` of `batch` from `resource`: one `ResourceSpans`, one
/// `ScopeSpans` per instrumentation scope, in the order the scopes first appear.
#[cfg(test)]
pub(crate) fn encode_request(batch: &[SpanData], resource: &Resource, buf: &mut Vec<u8>) {
    if batch.is_empty() {
        return;
    }
    let mut scopes: Vec<(&InstrumentationScope, Vec<u8>)> = Vec::new();
    for s in batch {
        let at = match scopes
            .iter()
            .position(|(scope, _)| **scope == s.instrumentation_scope)
        {
            Some(at) => at,
            None => {
                scopes.push((&s.instrumentation_scope, Vec::new()));
                scopes.len() - 1
            }
        };
        span(&mut scopes[at].1, 2, s);
    }
    let scopes: Vec<(&InstrumentationScope, &[u8])> =
        scopes.iter().map(|(s, b)| (*s, b.as_slice())).collect();
    request(resource, &scopes, buf);
}

/// The request body of apply spans `spans` from `resource` and `scope`, as the queue posts it.
#[cfg(test)]
pub(crate) fn encode_applies(
    spans: &[Ended],
    resource: &Resource,
    scope: &InstrumentationScope,
    buf: &mut Vec<u8>,
) {
    let mut body = Vec::new();
    for s in spans {
        apply_span(&mut body, 2, s);
    }
    request(resource, &[(scope, body.as_slice())], buf);
}

#[cfg(test)]
mod tests;
