//! The configuration sections: one struct per `[table]`, with the defaults of
//! docs/operations.md, "Configuration".
//!
//! Deserialized by serde (`deny_unknown_fields`, so a typo is an error, never a silent
//! default); each field names the parser of [`values`](super::values) that accepts it and
//! says what it expected otherwise. Serialized by serde too, for `vantage config check`: the
//! URL through its redacting `Serialize`, durations through `humantime_serde`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::console::ConsoleSettings;
use super::secret::DatabaseUrl;
use super::values::{self, LogFormat, Percent, QuarantineAfter};

/// The effective configuration of one vantage process.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// `[database]`
    pub database: DatabaseSettings,
    /// `[worker]`
    pub worker: WorkerSettings,
    /// `[cooldown]`
    pub cooldown: CooldownSettings,
    /// `[orphans]`
    pub orphans: OrphanSettings,
    /// `[http]`
    pub http: HttpSettings,
    /// `[console]`
    pub console: ConsoleSettings,
    /// `[log]`
    pub log: LogSettings,
    /// `[telemetry]`: traces (docs/operations.md, "Traces").
    pub telemetry: TelemetrySettings,
    /// `[[perspectives]]`: SQL perspectives, from the file only.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub perspectives: Vec<PerspectiveSettings>,
    /// `[[slo]]`: service-level objectives, from the file only; `vantage alerts render` turns
    /// them into Prometheus rules (docs/operations.md, "SLOs and alerts"). None configured =
    /// [`SloSettings::defaults`].
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub slo: Vec<SloSettings>,
}

/// `[database]`
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseSettings {
    /// `url`: `postgres://` or `postgresql://`. `None` = libpq `PG*` environment variables.
    #[serde(
        deserialize_with = "values::database_url",
        skip_serializing_if = "Option::is_none"
    )]
    pub url: Option<DatabaseUrl>,
    /// `schema` (default `vantage`): a plain lower-case SQL identifier, so it can be spliced
    /// into statements without quoting, and not a system schema.
    #[serde(deserialize_with = "values::schema")]
    pub schema: String,
    /// `max_connections` (default 10): at least `worker.consumers` + 2.
    #[serde(deserialize_with = "values::positive_u32")]
    pub max_connections: u32,
    /// `auto_migrate` (default true): apply migrations at daemon start.
    #[serde(deserialize_with = "values::boolean")]
    pub auto_migrate: bool,
    /// `connect_timeout` (default 30 s, more than zero): how long start-up retries an
    /// unreachable database.
    #[serde(with = "values::duration")]
    pub connect_timeout: Duration,
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: None,
            schema: "vantage".to_owned(),
            max_connections: 10,
            auto_migrate: true,
            connect_timeout: Duration::from_secs(30),
        }
    }
}

/// `[worker]`
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerSettings {
    /// `consumers` (default 4, at most [`MAX_CONSUMERS`](super::MAX_CONSUMERS)): concurrent
    /// consumer loops.
    #[serde(deserialize_with = "values::consumers")]
    pub consumers: usize,
    /// `batch_size` (default 500): most work rows claimed at once.
    #[serde(deserialize_with = "values::positive_u32")]
    pub batch_size: u32,
    /// `max_streams_per_claim` (default 100).
    #[serde(deserialize_with = "values::positive_u32")]
    pub max_streams_per_claim: u32,
    /// `lease` (default 60 s, at least 1 s).
    #[serde(with = "values::duration")]
    pub lease: Duration,
    /// `poll_interval` (default 1 s): fallback when no NOTIFY arrives.
    #[serde(with = "values::duration")]
    pub poll_interval: Duration,
    /// `max_perspective_event_attempts` (default 10): a row is dead-lettered on claim
    /// `max + 1`. `None` (`"off"`) = never dead-letter.
    #[serde(with = "values::attempts")]
    pub max_perspective_event_attempts: Option<u32>,
    /// `retry_backoff_base` (default 1 s): delay after the first failure.
    #[serde(with = "values::duration")]
    pub retry_backoff_base: Duration,
    /// `retry_backoff_max` (default 5 min): cap of the exponential backoff.
    #[serde(with = "values::duration")]
    pub retry_backoff_max: Duration,
    /// `shutdown_grace` (default 30 s): time given to in-flight applies at shutdown.
    #[serde(with = "values::duration")]
    pub shutdown_grace: Duration,
    /// `apply_timeout` (default 30 s, or half the lease when that is shorter; must be below
    /// the lease): the deadline of one apply. A timed-out apply is a retryable failure, charged
    /// like any other, so a hung handler cannot hold its lane forever.
    #[serde(with = "values::duration")]
    pub apply_timeout: Duration,
    /// `backfill_batch_size` (default 1000): the most events a new version's backfill looks at
    /// per transaction; a batch also ends after 50 ms (docs/versions.md, "Backfill").
    #[serde(deserialize_with = "values::positive_u32")]
    pub backfill_batch_size: u32,
}

/// Default of `worker.apply_timeout`, when the lease leaves room for it.
pub(super) const DEFAULT_APPLY_TIMEOUT: Duration = Duration::from_secs(30);

impl Default for WorkerSettings {
    fn default() -> Self {
        Self {
            consumers: 4,
            batch_size: 500,
            max_streams_per_claim: 100,
            lease: Duration::from_secs(60),
            poll_interval: Duration::from_secs(1),
            max_perspective_event_attempts: Some(10),
            retry_backoff_base: Duration::from_secs(1),
            retry_backoff_max: Duration::from_secs(5 * 60),
            shutdown_grace: Duration::from_secs(30),
            apply_timeout: DEFAULT_APPLY_TIMEOUT,
            backfill_batch_size: 1000,
        }
    }
}

/// `[cooldown]`: the cache of recently applied work ids (docs/pipeline.md, "The cooldown cache").
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CooldownSettings {
    /// `enabled` (default true).
    #[serde(deserialize_with = "values::boolean")]
    pub enabled: bool,
    /// `ttl` (default 5 min).
    #[serde(with = "values::duration")]
    pub ttl: Duration,
    /// `max_entries` (default 100 000; 0 only while the cache is disabled).
    #[serde(deserialize_with = "values::non_negative_usize")]
    pub max_entries: usize,
}

impl Default for CooldownSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            ttl: Duration::from_secs(5 * 60),
            max_entries: 100_000,
        }
    }
}

/// `[orphans]`: instance liveness (docs/pipeline.md, "Instances and orphans").
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct OrphanSettings {
    /// `heartbeat_interval` (default 10 s).
    #[serde(with = "values::duration")]
    pub heartbeat_interval: Duration,
    /// `stale_after` (default 30 s): an instance silent this long is dead.
    #[serde(with = "values::duration")]
    pub stale_after: Duration,
}

impl Default for OrphanSettings {
    fn default() -> Self {
        Self {
            heartbeat_interval: Duration::from_secs(10),
            stale_after: Duration::from_secs(30),
        }
    }
}

/// `[http]`
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpSettings {
    /// `listen` (default `127.0.0.1:9464`): `/metrics`, `/healthz`, `/readyz`.
    #[serde(deserialize_with = "values::socket_addr")]
    pub listen: SocketAddr,
}

impl Default for HttpSettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9464)),
        }
    }
}

/// `[log]`
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogSettings {
    /// `format` (default `text`).
    #[serde(deserialize_with = "values::log_format")]
    pub format: LogFormat,
    /// `level` (default `info`): a level or a `tracing` filter directive (checked with the
    /// logger's own parser); `RUST_LOG` overrides.
    #[serde(deserialize_with = "values::log_level")]
    pub level: String,
}

impl Default for LogSettings {
    fn default() -> Self {
        Self {
            format: LogFormat::Text,
            level: "info".to_owned(),
        }
    }
}

/// `[telemetry]`: OpenTelemetry traces over OTLP/HTTP, off unless an endpoint is set here or in
/// `OTEL_EXPORTER_OTLP_ENDPOINT` (the standard `OTEL_*` variables win over these keys, as every
/// environment variable wins over the file).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetrySettings {
    /// `otlp_endpoint` (default: none, traces off): the collector's base URL, `http://` or
    /// `https://`, such as `"http://127.0.0.1:4318"`; spans go to `/v1/traces` under it.
    #[serde(
        deserialize_with = "values::otlp_endpoint",
        skip_serializing_if = "Option::is_none"
    )]
    pub otlp_endpoint: Option<String>,
    /// `protocol` (default `http/protobuf`): or `http/json`.
    #[serde(deserialize_with = "values::otlp_protocol")]
    pub protocol: OtlpProtocol,
    /// `sampling` (default `100%`): the share of batches and of untraced work that is traced.
    /// Parent-based: an event whose producer's span was sampled is traced whatever this says,
    /// one whose producer's span was not is not.
    #[serde(with = "values::percent_required")]
    pub sampling: Percent,
    /// `service_name` (default `vantage`): the `service.name` of the spans.
    #[serde(deserialize_with = "values::string")]
    pub service_name: String,
}

impl Default for TelemetrySettings {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            protocol: OtlpProtocol::HttpProtobuf,
            sampling: Percent::from_ppm(Percent::WHOLE),
            service_name: "vantage".to_owned(),
        }
    }
}

/// How spans are encoded for the collector (`OTEL_EXPORTER_OTLP_PROTOCOL`'s values; gRPC is
/// not built in: a collector takes OTLP/HTTP on port 4318).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum OtlpProtocol {
    /// `http/protobuf`
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
    /// `http/json`
    #[serde(rename = "http/json")]
    HttpJson,
}

impl OtlpProtocol {
    /// As `OTEL_EXPORTER_OTLP_PROTOCOL` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            OtlpProtocol::HttpProtobuf => "http/protobuf",
            OtlpProtocol::HttpJson => "http/json",
        }
    }

    /// The protocol named `s` as `OTEL_EXPORTER_OTLP_PROTOCOL` spells it.
    pub fn parse(s: &str) -> Option<OtlpProtocol> {
        match s.trim() {
            "http/protobuf" => Some(OtlpProtocol::HttpProtobuf),
            "http/json" => Some(OtlpProtocol::HttpJson),
            _ => None,
        }
    }
}

/// One `[[perspectives]]` entry: a SQL perspective (docs/sql-contract.md, "SQL perspectives").
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PerspectiveSettings {
    /// `name`: unique, non-empty, no control characters.
    #[serde(deserialize_with = "values::string")]
    pub name: String,
    /// `events`: the subscribed event types; `"*"` = every type.
    #[serde(deserialize_with = "values::string_list")]
    pub events: Vec<String>,
    /// `[perspectives.sql]`: event type → statement. Every listed event has one, and no
    /// statement names an unlisted type; with `events` containing `"*"`, statements may name
    /// any type and the `"*"` statement, required, runs for the types without their own.
    #[serde(
        default,
        deserialize_with = "values::statements",
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub sql: BTreeMap<String, String>,
    /// `reset`: optional statement run by `vantage perspectives rebuild`.
    #[serde(
        default,
        deserialize_with = "values::optional_string",
        skip_serializing_if = "Option::is_none"
    )]
    pub reset: Option<String>,
    /// `quarantine_after`: optional `"N in DURATION"` (e.g. `"50 in 5m"`): when N of its events
    /// are dead-lettered within DURATION, the daemon pauses the perspective. `None` = never.
    #[serde(
        default,
        with = "values::quarantine_after",
        skip_serializing_if = "Option::is_none"
    )]
    pub quarantine_after: Option<QuarantineAfter>,
    /// `version`: which version of a versioned perspective this configuration defines (≥ 1,
    /// default 1). Bump it to build a changed definition beside the live one (docs/versions.md).
    #[serde(
        default = "first_version",
        deserialize_with = "values::positive_u32",
        skip_serializing_if = "is_first_version"
    )]
    pub version: u32,
    /// `read_schema`: makes the perspective versioned; readers query its `tables` in this schema,
    /// where views point at the live version.
    #[serde(
        default,
        deserialize_with = "values::optional_string",
        skip_serializing_if = "Option::is_none"
    )]
    pub read_schema: Option<String>,
    /// `tables`: the tables a versioned perspective owns (created by `setup` in each version's
    /// schema; exposed in `read_schema` by these names).
    #[serde(
        default,
        deserialize_with = "values::string_list",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub tables: Vec<String>,
    /// `setup`: SQL run once, in the version's own schema, when a version is first registered.
    #[serde(
        default,
        deserialize_with = "values::optional_string",
        skip_serializing_if = "Option::is_none"
    )]
    pub setup: Option<String>,
}

impl Default for PerspectiveSettings {
    fn default() -> Self {
        PerspectiveSettings {
            name: String::new(),
            events: Vec::new(),
            sql: BTreeMap::new(),
            reset: None,
            quarantine_after: None,
            version: first_version(),
            read_schema: None,
            tables: Vec::new(),
            setup: None,
        }
    }
}

impl PerspectiveSettings {
    /// Whether this perspective is versioned (`read_schema` is set).
    pub fn is_versioned(&self) -> bool {
        self.read_schema.is_some()
    }
}

fn first_version() -> u32 {
    1
}

fn is_first_version(v: &u32) -> bool {
    *v == 1
}

/// One `[[slo]]` entry: an objective for one perspective (or `"*"`, each perspective without an
/// SLO of the same kind of its own), of one of two kinds:
/// - **lag**: `lag` (append → applied within this; one of
///   [`APPEND_TO_APPLIED_BUCKETS`](crate::telemetry::metrics::APPEND_TO_APPLIED_BUCKETS)) for
///   `objective` (default 99.9 %) of the events;
/// - **dead-letter rate**: at most `dead_letter_rate` of the events that end (applied or
///   dead-lettered) are dead-lettered; the rate is the error budget, so no `objective`.
///
/// Exactly one of `lag` and `dead_letter_rate` is set; both kinds have a `window` (default 30
/// days) over which the budget is spent.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SloSettings {
    /// `name`: the `slo` label of its rules (default `lag-30s`, `dead-letters-0.1%`): letters,
    /// digits, `_`, `-`, `.`, `%`.
    #[serde(
        default,
        deserialize_with = "values::optional_string",
        skip_serializing_if = "Option::is_none"
    )]
    pub name: Option<String>,
    /// `perspective` (default `"*"`): one perspective's name, or `"*"` for each.
    #[serde(default = "every_perspective", deserialize_with = "values::string")]
    pub perspective: String,
    /// `lag`: makes this a lag SLO.
    #[serde(
        default,
        with = "values::optional_duration",
        skip_serializing_if = "Option::is_none"
    )]
    pub lag: Option<Duration>,
    /// `objective` (lag SLOs; default 99.9 %): the share of events applied within `lag`.
    #[serde(
        default,
        with = "values::percent",
        skip_serializing_if = "Option::is_none"
    )]
    pub objective: Option<Percent>,
    /// `dead_letter_rate`: makes this a dead-letter-rate SLO.
    #[serde(
        default,
        with = "values::percent",
        skip_serializing_if = "Option::is_none"
    )]
    pub dead_letter_rate: Option<Percent>,
    /// `window` (default 30 days): the error budget's window.
    #[serde(default = "thirty_days", with = "values::slo_window")]
    pub window: Duration,
}

/// What an [`SloSettings`] promises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SloKind {
    /// `lag`: events applied within `lag` of their append, for `objective` of them.
    Lag {
        /// The threshold.
        lag: Duration,
        /// The share of events that must make it.
        objective: Percent,
    },
    /// `dead_letter_rate`: at most this share of the events is dead-lettered.
    DeadLetterRate(Percent),
}

/// The default `objective` of a lag SLO.
pub const DEFAULT_SLO_OBJECTIVE_PPM: u32 = 999_000;

impl SloSettings {
    /// The SLOs used when none is configured: every perspective applies 99.9 % of its events
    /// within 30 s, and dead-letters at most 0.1 % of them, over 30 days. The shipped
    /// `deploy/prometheus/vantage-slo.yaml` is these, rendered.
    pub fn defaults() -> Vec<SloSettings> {
        let base = SloSettings {
            name: None,
            perspective: every_perspective(),
            lag: None,
            objective: None,
            dead_letter_rate: None,
            window: thirty_days(),
        };
        vec![
            SloSettings {
                lag: Some(Duration::from_secs(30)),
                ..base.clone()
            },
            SloSettings {
                dead_letter_rate: Some(Percent::from_ppm(1_000)),
                ..base
            },
        ]
    }

    /// Its kind. A validated entry has exactly one of `lag` and `dead_letter_rate`; were both
    /// set, `lag` wins.
    pub fn kind(&self) -> SloKind {
        match (self.lag, self.dead_letter_rate) {
            (Some(_), _) | (None, None) => SloKind::Lag {
                lag: self.lag.unwrap_or_default(),
                objective: self
                    .objective
                    .unwrap_or(Percent::from_ppm(DEFAULT_SLO_OBJECTIVE_PPM)),
            },
            (None, Some(rate)) => SloKind::DeadLetterRate(rate),
        }
    }

    /// The error budget: the share of events allowed to miss (`1 - objective`, or the
    /// dead-letter rate).
    pub fn budget(&self) -> Percent {
        match self.kind() {
            SloKind::Lag { objective, .. } => objective.complement(),
            SloKind::DeadLetterRate(rate) => rate,
        }
    }

    /// Its `slo` label: `name`, or `lag-30s` / `dead-letters-0.1%`.
    pub fn name(&self) -> String {
        if let Some(name) = &self.name {
            return name.clone();
        }
        match self.kind() {
            SloKind::Lag { lag, .. } => format!("lag-{}", humantime::format_duration(lag)),
            SloKind::DeadLetterRate(rate) => format!("dead-letters-{rate}"),
        }
    }

    /// Whether it covers each perspective (`perspective = "*"`).
    pub fn is_every_perspective(&self) -> bool {
        self.perspective == "*"
    }
}

fn every_perspective() -> String {
    "*".to_owned()
}

fn thirty_days() -> Duration {
    Duration::from_secs(30 * 24 * 60 * 60)
}
