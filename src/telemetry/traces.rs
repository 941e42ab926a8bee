//! Traces: OpenTelemetry spans through `tracing`, exported over OTLP/HTTP, off unless an
//! endpoint is configured (`[telemetry]`, or the standard `OTEL_*` variables, which win).
//!
//! Only spans of the target [`TARGET`] are exported, at `TRACE` level: with traces off, no
//! layer wants them, so `tracing` never builds them (a callsite check, not an allocation per
//! event), and no log line changes. The spans themselves are the pipeline's
//! (`pipeline/spans.rs`): claims, batches, dead-letter moves, and the apply of each event
//! whose metadata carries a W3C `traceparent` ([`parent_of`]).
//!
//! A claim that found nothing is not exported ([`QuietIdle`]): an idle daemon polls every
//! `worker.poll_interval` per consumer, and a trace of each poll would only bill the operator.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{
    Link, SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState,
    TracerProvider,
};
use opentelemetry::{Context, InstrumentationScope, KeyValue, Value};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SamplingDecision, SamplingResult,
    SdkTracerProvider, ShouldSample, SimpleSpanProcessor, SpanExporter, SpanProcessor,
};
use opentelemetry_sdk::Resource;
use tracing::Subscriber;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use super::metrics as m;
use super::recorder::TelemetryError;
use crate::config::{OtlpProtocol, Percent, TelemetrySettings};

/// The `tracing` target of every span that is exported.
pub const TARGET: &str = "vantage::otel";

/// The claim span's attribute with the number of rows claimed (0 = not exported).
pub const CLAIMED: &str = "vantage.claimed";

/// The name of a claim's span.
pub const CLAIM_SPAN: &str = "vantage.claim";

/// The longest `traceparent` (or `tracestate`) read from an event's metadata: a valid
/// `traceparent` is 55 characters and W3C caps `tracestate` at 512; anything longer is a
/// producer's mistake (or an attack), and is ignored, not parsed.
pub const MAX_HEADER: usize = 512;

/// The trace configuration in effect: where spans go and which are kept.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceSettings {
    /// The full URL spans are posted to (`…/v1/traces`).
    pub endpoint: String,
    /// How they are encoded.
    pub protocol: OtlpProtocol,
    /// Which traces are kept.
    pub sampler: SamplerChoice,
    /// `service.name`.
    pub service_name: String,
}

/// Which traces are kept (`OTEL_TRACES_SAMPLER`'s values).
#[derive(Clone, Debug, PartialEq)]
pub enum SamplerChoice {
    /// `always_on`
    AlwaysOn,
    /// `always_off`
    AlwaysOff,
    /// `traceidratio` with its ratio (0 to 1).
    Ratio(f64),
    /// `parentbased_*`: a span with a parent follows it; a root span asks the inner choice.
    ParentBased(Box<SamplerChoice>),
}

impl SamplerChoice {
    fn sampler(&self) -> Sampler {
        match self {
            SamplerChoice::AlwaysOn => Sampler::AlwaysOn,
            SamplerChoice::AlwaysOff => Sampler::AlwaysOff,
            SamplerChoice::Ratio(r) => Sampler::TraceIdRatioBased(*r),
            SamplerChoice::ParentBased(root) => Sampler::ParentBased(Box::new(root.sampler())),
        }
    }

    /// `telemetry.sampling` as a sampler: parent-based, all roots at 100 %.
    fn from_percent(p: Percent) -> SamplerChoice {
        let root = if p.ppm() >= Percent::WHOLE {
            SamplerChoice::AlwaysOn
        } else {
            SamplerChoice::Ratio(f64::from(p.ppm()) / f64::from(Percent::WHOLE))
        };
        SamplerChoice::ParentBased(Box::new(root))
    }
}

/// The trace configuration of `settings` and the environment `env` (a variable's value by
/// name): `None` when traces are off. The standard variables win over the file's keys:
/// `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn traces off;
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as it is) or `OTEL_EXPORTER_OTLP_ENDPOINT` (a base
/// URL, `/v1/traces` appended) turn them on; `OTEL_EXPORTER_OTLP_PROTOCOL`,
/// `OTEL_TRACES_SAMPLER` (+ `OTEL_TRACES_SAMPLER_ARG`) and `OTEL_SERVICE_NAME` override
/// `protocol`, `sampling` and `service_name`.
///
/// # Errors
/// [`TelemetryError::Traces`] naming the variable or key whose value cannot be used.
pub fn resolve(
    settings: &TelemetrySettings,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<TraceSettings>, TelemetryError> {
    let var = |name: &str| {
        env(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    };
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    match var("OTEL_TRACES_EXPORTER").as_deref() {
        None | Some("otlp") => {}
        Some("none") => return Ok(None),
        Some(other) => return Err(bad("OTEL_TRACES_EXPORTER", other, "\"otlp\" or \"none\"")),
    }
    let endpoint = if let Some(full) = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
        check_endpoint("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &full)?;
        full
    } else if let Some(base) = var("OTEL_EXPORTER_OTLP_ENDPOINT") {
        check_endpoint("OTEL_EXPORTER_OTLP_ENDPOINT", &base)?;
        traces_url(&base)
    } else if let Some(base) = &settings.otlp_endpoint {
        check_endpoint("telemetry.otlp_endpoint", base)?;
        traces_url(base)
    } else {
        return Ok(None);
    };
    let protocol = match var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .map(|v| ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", v))
        .or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL").map(|v| ("OTEL_EXPORTER_OTLP_PROTOCOL", v)))
    {
        None => settings.protocol,
        Some((name, v)) => OtlpProtocol::parse(&v).ok_or_else(|| {
            bad(
                name,
                &v,
                "\"http/protobuf\" or \"http/json\" (this build exports OTLP over HTTP, port 4318; gRPC is not built in)",
            )
        })?,
    };
    let sampler = match var("OTEL_TRACES_SAMPLER") {
        None => SamplerChoice::from_percent(settings.sampling),
        Some(name) => sampler_named(&name, var("OTEL_TRACES_SAMPLER_ARG").as_deref())?,
    };
    let service_name = var("OTEL_SERVICE_NAME").unwrap_or_else(|| settings.service_name.clone());
    if protocol == OtlpProtocol::HttpProtobuf {
        otlp::headers_and_timeout(&env).map_err(|e| TelemetryError::Traces {
            origin: e.origin,
            value: e.value,
            expected: e.expected,
        })?;
    }
    Ok(Some(TraceSettings {
        endpoint,
        protocol,
        sampler,
        service_name,
    }))
}

/// [`resolve`] with the process environment.
///
/// # Errors
/// As [`resolve`].
pub fn from_process_env(
    settings: &TelemetrySettings,
) -> Result<Option<TraceSettings>, TelemetryError> {
    resolve(settings, |name| std::env::var(name).ok())
}

fn bad(origin: &str, value: &str, expected: &str) -> TelemetryError {
    TelemetryError::Traces {
        origin: origin.to_owned(),
        value: crate::text::one_line(&crate::text::cap_at(value, 200)).into_owned(),
        expected: expected.to_owned(),
    }
}

fn check_endpoint(origin: &str, value: &str) -> Result<(), TelemetryError> {
    if crate::config::otlp_endpoint_ok(value) {
        Ok(())
    } else {
        Err(bad(
            origin,
            &without_credentials(value),
            crate::config::OTLP_ENDPOINT,
        ))
    }
}

/// `value` with whatever stands between `://` and `@` replaced: a URL with credentials in it
/// is refused, and its password must not reach the message that says so.
fn without_credentials(value: &str) -> String {
    match (value.find("://"), value.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***{}", &value[..scheme + 3], &value[at..])
        }
        _ => value.to_owned(),
    }
}

/// The traces URL under a base endpoint, as the OTLP specification says: `/v1/traces`
/// appended to its path.
fn traces_url(base: &str) -> String {
    format!("{}/v1/traces", base.trim().trim_end_matches('/'))
}

fn sampler_named(name: &str, arg: Option<&str>) -> Result<SamplerChoice, TelemetryError> {
    let ratio = || -> Result<f64, TelemetryError> {
        match arg {
            None => Ok(1.0),
            Some(a) => a
                .parse::<f64>()
                .ok()
                .filter(|r| (0.0..=1.0).contains(r))
                .ok_or_else(|| {
                    bad(
                        "OTEL_TRACES_SAMPLER_ARG",
                        a,
                        "a ratio from 0 to 1, such as 0.25",
                    )
                }),
        }
    };
    let parent = |root| Ok(SamplerChoice::ParentBased(Box::new(root)));
    match name {
        "always_on" => Ok(SamplerChoice::AlwaysOn),
        "always_off" => Ok(SamplerChoice::AlwaysOff),
        "traceidratio" => Ok(SamplerChoice::Ratio(ratio()?)),
        "parentbased_always_on" => parent(SamplerChoice::AlwaysOn),
        "parentbased_always_off" => parent(SamplerChoice::AlwaysOff),
        "parentbased_traceidratio" => parent(SamplerChoice::Ratio(ratio()?)),
        other => Err(bad(
            "OTEL_TRACES_SAMPLER",
            other,
            "always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off or parentbased_traceidratio",
        )),
    }
}

/// The configured sampler, except that a claim that found nothing is never kept: it is a poll,
/// not work (the claim span records [`CLAIMED`] before the span is started, so the decision
/// sees it).
#[derive(Clone, Debug)]
pub struct QuietIdle(Sampler);

impl QuietIdle {
    /// Wraps the sampler `choice` describes.
    pub fn new(choice: &SamplerChoice) -> QuietIdle {
        QuietIdle(choice.sampler())
    }
}

impl ShouldSample for QuietIdle {
    fn should_sample(
        &self,
        parent_context: Option<&Context>,
        trace_id: TraceId,
        name: &str,
        span_kind: &SpanKind,
        attributes: &[KeyValue],
        links: &[Link],
    ) -> SamplingResult {
        let idle = name == CLAIM_SPAN
            && attributes
                .iter()
                .any(|kv| kv.key.as_str() == CLAIMED && kv.value == Value::I64(0));
        if idle {
            return SamplingResult {
                decision: SamplingDecision::Drop,
                attributes: Vec::new(),
                trace_state: Default::default(),
            };
        }
        self.0
            .should_sample(parent_context, trace_id, name, span_kind, attributes, links)
    }
}

/// The traces of this process, once installed, for [`flush`].
static PROVIDER: OnceLock<Traces> = OnceLock::new();

/// A tracer provider, and where the apply spans its [`layer`] starts go (they are made without
/// the SDK's span object: `traces/apply.rs` says why). Derefs to the SDK's provider, whose
/// `force_flush` and `shutdown` reach the apply spans too.
pub struct Traces {
    provider: SdkTracerProvider,
    applies: Arc<Applies>,
}

impl std::ops::Deref for Traces {
    type Target = SdkTracerProvider;

    fn deref(&self) -> &SdkTracerProvider {
        &self.provider
    }
}

/// The name of vantage's tracer (its spans' instrumentation scope).
const TRACER: &str = "vantage";

fn scope() -> InstrumentationScope {
    InstrumentationScope::builder(TRACER).build()
}

/// A processor shared between the provider and the apply spans.
#[derive(Debug)]
struct Shared(Arc<dyn SpanProcessor>);

impl SpanProcessor for Shared {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &Context) {
        self.0.on_start(span, cx);
    }

    fn on_end(&self, span: opentelemetry_sdk::trace::SpanData) {
        self.0.on_end(span);
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    // (The resource was given to the processor before it was shared.)
}

/// The provider of `processor` (given `resource` already) sampling as `sampler` says, with
/// the apply spans going to `applies` (`None`: made into span data for `processor`).
fn traces_with(
    processor: Arc<dyn SpanProcessor>,
    applies: Option<apply::Sink>,
    sampler: &SamplerChoice,
    resource: Resource,
) -> Traces {
    let applies = applies.unwrap_or_else(|| apply::Sink::Processor {
        processor: Arc::clone(&processor),
        scope: scope(),
    });
    Traces {
        provider: SdkTracerProvider::builder()
            .with_span_processor(Shared(processor))
            .with_sampler(QuietIdle::new(sampler))
            .with_resource(resource)
            .build(),
        applies: Arc::new(Applies::new(sampler, applies)),
    }
}

/// A tracer provider exporting to the OTLP collector of `settings` in batches, from a thread of
/// its own (`OTEL_BSP_*` tune the batches; `OTEL_EXPORTER_OTLP_HEADERS` and `…_TIMEOUT` are
/// honoured).
///
/// # Errors
/// [`TelemetryError::Traces`] if the exporter cannot be built.
pub fn provider(settings: &TraceSettings) -> Result<Traces, TelemetryError> {
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    // reqwest is built without a TLS provider of its own: use ring, which sqlx uses already.
    // Err = one is installed already, which is as good.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let resource = resource(&settings.service_name);
    match settings.protocol {
        // Ours: the reference encoder and the SDK's batch processor cost the drain too much
        // per span (otlp.rs says why).
        OtlpProtocol::HttpProtobuf => {
            let limits = otlp::Limits::from_env(|name| std::env::var(name).ok(), MAX_QUEUED_SPANS);
            let queue = otlp::Queue::new(&settings.endpoint, resource.clone(), scope(), limits)
                .map_err(|e| TelemetryError::Traces {
                    origin: e.origin,
                    value: e.value,
                    expected: e.expected,
                })?;
            let queue = Arc::new(queue);
            Ok(traces_with(
                queue.clone(),
                Some(apply::Sink::Encoded(queue)),
                &settings.sampler,
                resource,
            ))
        }
        OtlpProtocol::HttpJson => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_endpoint(settings.endpoint.clone())
                .with_protocol(Protocol::HttpJson)
                .build()
                .map_err(|e| TelemetryError::Traces {
                    origin: "the OTLP exporter".to_owned(),
                    value: settings.endpoint.clone(),
                    expected: e.to_string(),
                })?;
            // The SDK's default queue (2 048 spans) fills in a fraction of a second when
            // every event of a busy drain is traced; a span that finds it full is dropped.
            // `OTEL_BSP_MAX_QUEUE_SIZE` still decides when set.
            let mut batches = BatchConfigBuilder::default();
            if std::env::var_os("OTEL_BSP_MAX_QUEUE_SIZE").is_none() {
                batches = batches.with_max_queue_size(MAX_QUEUED_SPANS);
            }
            let mut processor = BatchSpanProcessor::builder(Counted(exporter))
                .with_batch_config(batches.build())
                .build();
            processor.set_resource(&resource);
            Ok(traces_with(
                Arc::new(processor),
                None,
                &settings.sampler,
                resource,
            ))
        }
    }
}

/// Spans waiting for export at most, unless `OTEL_BSP_MAX_QUEUE_SIZE` says otherwise: the
/// SDK's default (2 048) fills in a fraction of a second when every event of a busy drain is
/// traced. 16 384 spans are about 5 MiB encoded.
pub const MAX_QUEUED_SPANS: usize = 16_384;

/// Spans the exporter of this process sent, and spans whose export failed.
static EXPORTED: AtomicU64 = AtomicU64::new(0);
static FAILED: AtomicU64 = AtomicU64::new(0);

/// (spans exported, spans whose export failed) by this process so far: the bench compares
/// them with the spans it expected, so a drop (a full queue) cannot pass for low overhead.
pub fn exported() -> (u64, u64) {
    (
        EXPORTED.load(Ordering::Relaxed),
        FAILED.load(Ordering::Relaxed),
    )
}

/// When the last export failure was logged (seconds since the Unix epoch; 0 = never).
static LAST_FAILURE_LOGGED: AtomicU64 = AtomicU64::new(0);

/// One WARN line per minute at most for failing exports: a collector that is down must not
/// flood the log (every batch fails), nor go unnoticed.
fn warn_export_failed(error: &opentelemetry_sdk::error::OTelSdkError, spans: u64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let last = LAST_FAILURE_LOGGED.load(Ordering::Relaxed);
    if now.saturating_sub(last) >= 60
        && LAST_FAILURE_LOGGED
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        let error = error.to_string();
        tracing::warn!(
            spans,
            error = %crate::text::cap_at(&error, 512),
            "could not export spans to the OTLP collector; they are dropped (vantage_trace_spans_failed_total counts them; this line repeats at most once a minute)"
        );
    }
}

/// Counts `spans` exported, or failed with `result`'s error ([`exported`], and the metrics).
fn counted(result: &opentelemetry_sdk::error::OTelSdkResult, spans: u64) {
    match result {
        Ok(()) => {
            EXPORTED.fetch_add(spans, Ordering::Relaxed);
            metrics::counter!(m::TRACE_SPANS_EXPORTED_TOTAL).increment(spans);
        }
        Err(error) => {
            FAILED.fetch_add(spans, Ordering::Relaxed);
            metrics::counter!(m::TRACE_SPANS_FAILED_TOTAL).increment(spans);
            warn_export_failed(error, spans);
        }
    }
}

/// Counts `spans` dropped by a full queue as failed.
fn dropped(spans: u64) {
    counted(
        &Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure(format!(
            "the queue of spans waiting for export is full ({MAX_QUEUED_SPANS} unless OTEL_BSP_MAX_QUEUE_SIZE says otherwise): the collector is slower than the drain"
        ))),
        spans,
    );
}

/// An exporter that counts what it exports ([`exported`], and the metrics).
#[derive(Debug)]
struct Counted<E>(E);

impl<E: SpanExporter> SpanExporter for Counted<E> {
    fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> impl std::future::Future<Output = opentelemetry_sdk::error::OTelSdkResult> + Send {
        let n = batch.len() as u64;
        let export = self.0.export(batch);
        async move {
            let result = export.await;
            counted(&result, n);
            result
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        self.0.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.0.set_resource(resource);
    }
}

/// A tracer provider that hands every finished span to `exporter` at once (tests, with the
/// SDK's in-memory exporter), sampling as `sampler` says.
pub fn provider_with<E: SpanExporter + 'static>(exporter: E, sampler: &SamplerChoice) -> Traces {
    let resource = resource("vantage");
    let mut processor = SimpleSpanProcessor::new(exporter);
    processor.set_resource(&resource);
    traces_with(Arc::new(processor), None, sampler, resource)
}

fn resource(service_name: &str) -> Resource {
    Resource::builder()
        .with_service_name(service_name.to_owned())
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build()
}

/// The `tracing` layer that turns the spans of [`TARGET`] into OpenTelemetry spans of
/// `traces` (nothing else: log lines stay log lines).
pub fn layer<S>(traces: &Traces) -> impl Layer<S> + Send + Sync
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
{
    tracing_opentelemetry::layer()
        .with_tracer(traces.provider.tracer(TRACER))
        // Each of these is work per span that a trace viewer does not need from us.
        .with_location(false)
        .with_threads(false)
        .with_level(false)
        .with_target(false)
        .with_tracked_inactivity(false)
        // Entering a span would start it (and decide its sampling) at once; nothing of ours
        // reads OpenTelemetry's current context, which is what activation is for.
        .with_context_activation(false)
        .with_filter(Targets::new().with_target(TARGET, tracing::Level::TRACE))
        .and_then(
            ApplyLayer(Arc::clone(&traces.applies))
                .with_filter(Targets::new().with_target(TARGET, tracing::Level::TRACE)),
        )
}

/// Where the apply spans of [`layer`]'s provider go, found through the current `tracing`
/// dispatcher: the pipeline records each event's apply span itself, not through `tracing`,
/// because with every event traced the layer's own bookkeeping per span (a registry entry,
/// field visitors, a builder kept in the span's extensions) was most of tracing's cost on the
/// drain's path. A layer that does nothing; its filter keeps it out of every callsite's
/// interest, so it changes nothing for log lines.
struct ApplyLayer(Arc<Applies>);

impl<S: Subscriber> Layer<S> for ApplyLayer {}

impl Applies {
    /// Those of the current dispatcher's trace layer, if it has one, with the span context of
    /// the current span (the batch's) when it is exported. One look at the dispatcher for both:
    /// this runs once per traced event.
    pub(crate) fn current() -> Option<(Arc<Applies>, Option<SpanContext>)> {
        tracing::dispatcher::get_default(|d| {
            let applies = Arc::clone(&d.downcast_ref::<ApplyLayer>()?.0);
            let batch = d
                .current_span()
                .id()
                .and_then(|id| tracing_opentelemetry::get_otel_context(id, d))
                .map(|cx| cx.span().span_context().clone())
                .filter(SpanContext::is_valid);
            Some((applies, batch))
        })
    }
}

/// Remembers `traces` as the process's, for [`flush`] (the first one wins).
pub(crate) fn remember(traces: Traces) {
    let _ = PROVIDER.set(traces);
}

/// Exports the spans still queued and stops the exporter, waiting at most `timeout`: call it
/// before the process exits. Nothing to do when traces are off.
pub fn flush(timeout: Duration) {
    if let Some(provider) = PROVIDER.get() {
        if let Err(error) = provider.shutdown_with_timeout(timeout) {
            eprintln!("vantage: could not export the last spans: {error}");
        }
    }
}

/// Reads `traceparent` and `tracestate` from an event's metadata (a JSON object).
struct MetadataCarrier<'a>(&'a serde_json::Map<String, serde_json::Value>);

impl Extractor for MetadataCarrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .get(key)
            .and_then(serde_json::Value::as_str)
            .filter(|v| v.len() <= MAX_HEADER)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

/// The producer's span context of an event whose `metadata` carries a valid W3C `traceparent`
/// (and optionally `tracestate`); `None` otherwise (absent, too long, malformed, or all zeros).
///
/// Read once per traced event on the drain's path, so read by hand, strictly as W3C writes it
/// (`VV-<32 hex>-<16 hex>-FF`, lowercase): the SDK's propagator, splitting into a vector and
/// parsing each part, cost about 2 800 instructions an event. `tracestate`, when present, is
/// the SDK's to parse.
pub fn parent_of(metadata: &serde_json::Value) -> Option<Context> {
    parent_span_context(metadata).map(|span| Context::new().with_remote_span_context(span))
}

/// [`parent_of`]'s span context, without a `Context` around it (which costs an allocation an
/// event).
pub(crate) fn parent_span_context(metadata: &serde_json::Value) -> Option<SpanContext> {
    let map = metadata.as_object()?;
    let carrier = MetadataCarrier(map);
    let (trace_id, span_id, flags) = traceparent(carrier.get("traceparent")?)?;
    let state = carrier
        .get("tracestate")
        .map(|s| s.parse::<TraceState>().unwrap_or_default())
        .unwrap_or_default();
    let span = SpanContext::new(trace_id, span_id, flags, true, state);
    span.is_valid().then_some(span)
}

/// A W3C `traceparent`: version, trace id, parent id and flags (only `sampled` is kept, as
/// the standard says of flags it does not define). Version `ff` is invalid; a version above 00
/// may carry more after a `-`, which is ignored.
fn traceparent(header: &str) -> Option<(TraceId, SpanId, TraceFlags)> {
    let h = header.trim().as_bytes();
    if h.len() < 55 || h[2] != b'-' || h[35] != b'-' || h[52] != b'-' {
        return None;
    }
    let version = hex(&h[0..2])?;
    let rest_ok = if version == 0 {
        h.len() == 55
    } else {
        h.len() == 55 || h[55] == b'-'
    };
    if version == 0xff || !rest_ok {
        return None;
    }
    let trace = u128::from(hex(&h[3..19])?) << 64 | u128::from(hex(&h[19..35])?);
    let span = hex(&h[36..52])?;
    let flags = hex(&h[53..55])? as u8;
    Some((
        TraceId::from_bytes(trace.to_be_bytes()),
        SpanId::from_bytes(span.to_be_bytes()),
        TraceFlags::new(flags) & TraceFlags::SAMPLED,
    ))
}

/// Up to 16 lowercase hex digits (as W3C writes them), by table: this runs on 48 digits per
/// traced event.
fn hex(digits: &[u8]) -> Option<u64> {
    const fn table() -> [u8; 256] {
        let mut t = [0xff; 256];
        let mut c = 0;
        while c < 256 {
            t[c] = match c as u8 {
                b'0'..=b'9' => c as u8 - b'0',
                b'a'..=b'f' => c as u8 - b'a' + 10,
                _ => 0xff,
            };
            c += 1;
        }
        t
    }
    static DIGITS: [u8; 256] = table();
    let (mut value, mut bad) = (0u64, 0u8);
    for &c in digits {
        let d = DIGITS[usize::from(c)];
        bad |= d;
        value = value << 4 | u64::from(d & 0x0f);
    }
    // (a digit is under 16; anything else set the high bits)
    (bad < 16).then_some(value)
}

/// Writes the W3C `traceparent` (and `tracestate`, if any) of `cx` into `metadata`, for a
/// producer: `vantage append` and the demo. Does nothing if `cx` has no valid span.
pub fn inject(cx: &Context, metadata: &mut serde_json::Map<String, serde_json::Value>) {
    struct Into<'a>(&'a mut serde_json::Map<String, serde_json::Value>);
    impl Injector for Into<'_> {
        fn set(&mut self, key: &str, value: String) {
            self.0
                .insert(key.to_owned(), serde_json::Value::String(value));
        }
    }
    if cx.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(cx, &mut Into(metadata));
    }
}

/// A `traceparent` given on a command line: the W3C format, checked.
///
/// # Errors
/// A message saying what the format is.
pub fn parse_traceparent(value: &str) -> Result<String, String> {
    let mut map = HashMap::new();
    map.insert("traceparent".to_owned(), value.trim().to_owned());
    let cx = TraceContextPropagator::new().extract(&map);
    if cx.span().span_context().is_valid() {
        Ok(value.trim().to_owned())
    } else {
        Err("expected a W3C traceparent: 00-<32 hex trace id>-<16 hex span id>-<2 hex flags>, not all zeros".to_owned())
    }
}

mod apply;
mod otlp;

pub(crate) use apply::{Applies, ApplyEvent, ApplyRecord};

#[cfg(test)]
mod tests;
