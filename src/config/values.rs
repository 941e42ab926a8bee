//! The value parsers the sections name in `deserialize_with`, and the value types they produce
//! (`LogFormat`, `QuarantineAfter`): each parser accepts what its key accepts and otherwise
//! fails with what it expected, which becomes the "expected …" part of the message. Scalars accept their string spelling too, because environment variables and
//! overrides are always strings.
//!
//! Every bound on a single value lives here (a duration of at most [`MAX_DURATION`], at most
//! [`MAX_CONSUMERS`] consumers, no system schema, a log filter the logger accepts); rules
//! across keys live in [`validate`](super::validate).

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use serde::de::{self, Deserialize, Deserializer, SeqAccess, Visitor};
use serde::Serialize;

use super::limits::{MAX_CONSUMERS, MAX_DURATION, MAX_DURATION_TEXT, MAX_SQL_INT};
use super::secret::DatabaseUrl;
use crate::connection::UrlProblem;

/// `log.format`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

impl LogFormat {
    /// The configuration spelling: `text` or `json`.
    pub fn as_str(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `perspectives[].quarantine_after`: pause the perspective once `dead_letters` of its events
/// were dead-lettered within `window` (counting only those since it was last resumed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuarantineAfter {
    /// N: at least 1.
    pub dead_letters: u32,
    /// DURATION: more than zero, at most [`MAX_DURATION`].
    pub window: Duration,
}

impl QuarantineAfter {
    /// The pause reason it records: `quarantined: 50 dead letters in 5m`.
    pub fn reason(&self) -> String {
        format!(
            "quarantined: {} dead letters in {}",
            self.dead_letters,
            humantime::format_duration(self.window)
        )
    }
}

impl fmt::Display for QuarantineAfter {
    /// As written in the configuration: `50 in 5m`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} in {}",
            self.dead_letters,
            humantime::format_duration(self.window)
        )
    }
}

/// A share written as a percentage (`"99.9%"`, `"0.1%"`): `[[slo]]` objectives and dead-letter
/// rates. Kept exactly, in parts per million (so `99.95%` stays 999 500, never a float that
/// prints as `99.94999`); at most four decimals of a percent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Percent {
    ppm: u32,
}

impl Percent {
    /// One million parts: 100 %.
    pub const WHOLE: u32 = 1_000_000;

    /// `ppm` parts per million (at most [`Percent::WHOLE`]).
    pub fn from_ppm(ppm: u32) -> Percent {
        Percent {
            ppm: ppm.min(Self::WHOLE),
        }
    }

    /// Parts per million.
    pub fn ppm(self) -> u32 {
        self.ppm
    }

    /// The rest to 100 %: the error budget of an objective.
    pub fn complement(self) -> Percent {
        Percent::from_ppm(Self::WHOLE - self.ppm)
    }

    /// As a ratio (`0.001` for 0.1 %), in the shortest exact decimal: what PromQL compares with.
    pub fn ratio(self) -> String {
        decimal(u64::from(self.ppm), 6)
    }

    /// Parses `"99.9%"`: digits, at most one point and four decimals, then `%`; 0 % to 100 %.
    pub fn parse(s: &str) -> Option<Percent> {
        let number = s.trim().strip_suffix('%')?.trim_end();
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        let digits = |d: &str| d.chars().all(|c| c.is_ascii_digit());
        if whole.is_empty() || whole.len() > 3 || !digits(whole) || !digits(fraction) {
            return None;
        }
        if fraction.len() > 4 || (number.contains('.') && fraction.is_empty()) {
            return None;
        }
        let ppm =
            whole.parse::<u32>().ok()? * 10_000 + format!("{fraction:0<4}").parse::<u32>().ok()?;
        (ppm <= Self::WHOLE).then_some(Percent { ppm })
    }
}

impl fmt::Display for Percent {
    /// `99.9%`: the shortest exact spelling.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}%", decimal(u64::from(self.ppm), 4))
    }
}

/// `value / 10^scale` in the shortest exact decimal (`decimal(1000, 6)` = `0.001`).
pub(crate) fn decimal(value: u64, scale: u32) -> String {
    let unit = 10u64.pow(scale);
    let (whole, fraction) = (value / unit, value % unit);
    if fraction == 0 {
        return whole.to_string();
    }
    let digits = format!("{fraction:0width$}", width = scale as usize);
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

/// Marks an error message as ours: what follows is the "expected" text. Anything else that
/// serde reports (unknown or missing fields, a table where a list belongs) is told apart by
/// [`messages`](super::messages) from its path.
pub(super) const EXPECTED: &str = "\u{1}expected ";

pub(super) fn expected<E: de::Error>(what: impl fmt::Display) -> E {
    E::custom(format_args!("{EXPECTED}{what}"))
}

/// Whatever a layer holds at a key, before the key's parser looks at it.
enum Scalar {
    Bool(bool),
    Int(i128),
    Float,
    Str(String),
    List(Vec<Scalar>),
    Other,
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ScalarVisitor)
    }
}

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a configuration value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Scalar, E> {
        Ok(Scalar::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Scalar, E> {
        Ok(Scalar::Int(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Scalar, E> {
        Ok(Scalar::Int(v.into()))
    }
    fn visit_i128<E>(self, v: i128) -> Result<Scalar, E> {
        Ok(Scalar::Int(v))
    }
    fn visit_u128<E>(self, v: u128) -> Result<Scalar, E> {
        // Beyond every bound either way.
        Ok(Scalar::Int(i128::try_from(v).unwrap_or(i128::MAX)))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Scalar, E> {
        Ok(Scalar::Float)
    }
    fn visit_str<E>(self, v: &str) -> Result<Scalar, E> {
        Ok(Scalar::Str(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Scalar, E> {
        Ok(Scalar::Str(v))
    }
    fn visit_unit<E>(self) -> Result<Scalar, E> {
        Ok(Scalar::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Scalar::List(items))
    }
    fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<Scalar, A::Error> {
        Ok(Scalar::Other)
    }
}

impl Scalar {
    fn integer(&self) -> Option<i128> {
        match self {
            Scalar::Int(n) => Some(*n),
            Scalar::Str(s) => s.trim().parse().ok(),
            _ => None,
        }
    }

    fn into_string(self) -> Option<String> {
        match self {
            Scalar::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// An integer in `min..=max`, from a TOML integer or its decimal string.
fn integer<'de, D: Deserializer<'de>>(
    d: D,
    min: u64,
    max: u64,
    over: impl FnOnce() -> String,
) -> Result<u64, D::Error> {
    let what = if min == 0 {
        "a non-negative integer"
    } else {
        "a positive integer"
    };
    match Scalar::deserialize(d)?.integer() {
        Some(n) if n >= i128::from(min) && n <= i128::from(max) => Ok(n as u64),
        Some(n) if n > i128::from(max) => Err(expected(format!("{what}{}", over()))),
        _ => Err(expected(what)),
    }
}

fn up_to_sql_int() -> String {
    format!(" up to {MAX_SQL_INT}")
}

pub(super) fn positive_u32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    integer(d, 1, MAX_SQL_INT, up_to_sql_int).map(|n| n as u32)
}

pub(super) fn non_negative_usize<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    integer(d, 0, MAX_SQL_INT, up_to_sql_int).map(|n| n as usize)
}

/// `worker.consumers`: each consumer is a claim loop with a database connection of its own.
pub(super) fn consumers<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    integer(d, 1, MAX_CONSUMERS as u64, || {
        format!(", at most {MAX_CONSUMERS} (each consumer is a claim loop with a database connection of its own)")
    })
    .map(|n| n as usize)
}

/// `worker.max_perspective_event_attempts`: a positive integer or `"off"`.
pub(super) mod attempts {
    use super::{expected, Deserialize, Deserializer, Scalar, MAX_SQL_INT};
    use serde::Serializer;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        const WHAT: &str = "a positive integer or \"off\"";
        match Scalar::deserialize(d)? {
            Scalar::Str(s) if s.trim().eq_ignore_ascii_case("off") => Ok(None),
            v => match v.integer() {
                Some(n) if n >= 1 && n <= i128::from(MAX_SQL_INT) => Ok(Some(n as u32)),
                _ => Err(expected(WHAT)),
            },
        }
    }

    pub fn serialize<S: Serializer>(v: &Option<u32>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(n) => s.serialize_u32(*n),
            None => s.serialize_str("off"),
        }
    }
}

/// Durations: a human string with a unit (`humantime`), at most [`MAX_DURATION`], so that
/// no multiple the daemon takes of one (a loop's liveness bound is three intervals) can
/// overflow. Written back through `humantime_serde`.
pub(super) mod duration {
    use super::{
        expected, Deserialize, Deserializer, Duration, Scalar, MAX_DURATION, MAX_DURATION_TEXT,
    };
    use serde::Serializer;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let parsed = match Scalar::deserialize(d)? {
            Scalar::Str(s) => humantime::parse_duration(s.trim()).ok(),
            _ => None,
        };
        match parsed {
            Some(value) if value <= MAX_DURATION => Ok(value),
            Some(_) => Err(expected(format!(
                "a duration of at most {MAX_DURATION_TEXT}"
            ))),
            None => Err(expected(
                "a duration with a unit, such as \"30s\", \"5m\" or \"250ms\"",
            )),
        }
    }

    pub fn serialize<S: Serializer>(v: &Duration, s: S) -> Result<S::Ok, S::Error> {
        humantime_serde::serialize(v, s)
    }
}

/// `perspectives[].quarantine_after`: `"N in DURATION"`, N a positive integer, DURATION a
/// duration with a unit, more than zero and at most [`MAX_DURATION`].
pub(super) mod quarantine_after {
    use super::{
        expected, Deserialize, Deserializer, QuarantineAfter, Scalar, MAX_DURATION,
        MAX_DURATION_TEXT, MAX_SQL_INT,
    };
    use serde::Serializer;

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<QuarantineAfter>, D::Error> {
        let parsed = Scalar::deserialize(d)?
            .into_string()
            .and_then(|s| parse(&s));
        match parsed {
            Some(q) => Ok(Some(q)),
            None => Err(expected(format_args!(
                "\"N in DURATION\", such as \"50 in 5m\": pause the perspective once N of its \
                 events (a positive integer up to {MAX_SQL_INT}) are dead-lettered within \
                 DURATION (more than zero, at most {MAX_DURATION_TEXT})"
            ))),
        }
    }

    fn parse(s: &str) -> Option<QuarantineAfter> {
        let mut words = s.split_whitespace();
        let dead_letters: u32 = words.next()?.parse().ok()?;
        if words.next() != Some("in") {
            return None;
        }
        let window = humantime::parse_duration(&words.collect::<Vec<_>>().join(" ")).ok()?;
        let fits = dead_letters >= 1
            && u64::from(dead_letters) <= MAX_SQL_INT
            && !window.is_zero()
            && window <= MAX_DURATION;
        fits.then_some(QuarantineAfter {
            dead_letters,
            window,
        })
    }

    pub fn serialize<S: Serializer>(v: &Option<QuarantineAfter>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(q) => s.collect_str(q),
            None => s.serialize_none(),
        }
    }
}

/// `slo[].objective` and `slo[].dead_letter_rate`: a percentage, `"99.9%"` (see [`Percent`]).
pub(super) mod percent {
    use super::{expected, Deserialize, Deserializer, Percent, Scalar};
    use serde::Serializer;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Percent>, D::Error> {
        match Scalar::deserialize(d)?
            .into_string()
            .and_then(|s| Percent::parse(&s))
        {
            Some(p) => Ok(Some(p)),
            None => Err(expected(
                "a percentage such as \"99.9%\" (a string, at most four decimals, from 0% to 100%)",
            )),
        }
    }

    pub fn serialize<S: Serializer>(v: &Option<Percent>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(p) => s.collect_str(p),
            None => s.serialize_none(),
        }
    }
}

/// `telemetry.sampling`: a percentage that must be there (see [`Percent`]).
pub(super) mod percent_required {
    use super::{Deserializer, Percent};
    use serde::Serializer;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Percent, D::Error> {
        super::percent::deserialize(d).map(|p| p.unwrap_or(Percent::from_ppm(Percent::WHOLE)))
    }

    pub fn serialize<S: Serializer>(v: &Percent, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(v)
    }
}

/// `telemetry.otlp_endpoint`: an `http://` or `https://` URL with a host (checked as
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is: [`otlp_endpoint_ok`]).
pub(super) fn otlp_endpoint<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let s = string(d).map_err(|_: D::Error| expected(OTLP_ENDPOINT))?;
    if otlp_endpoint_ok(&s) {
        Ok(Some(s.trim().to_owned()))
    } else {
        Err(expected(OTLP_ENDPOINT))
    }
}

/// What an OTLP endpoint must look like, for messages.
pub(crate) const OTLP_ENDPOINT: &str =
    "an http:// or https:// URL of an OTLP collector, such as \"http://127.0.0.1:4318\"";

/// Whether `s` is an OTLP/HTTP endpoint: `http` or `https`, with a host, no credentials in
/// it (they would be logged with the URL; use `OTEL_EXPORTER_OTLP_HEADERS`).
pub(crate) fn otlp_endpoint_ok(s: &str) -> bool {
    match url::Url::parse(s.trim()) {
        Ok(u) => {
            matches!(u.scheme(), "http" | "https")
                && u.host_str().is_some_and(|h| !h.is_empty())
                && u.username().is_empty()
                && u.password().is_none()
        }
        Err(_) => false,
    }
}

/// `telemetry.protocol`: `http/protobuf` or `http/json`.
pub(super) fn otlp_protocol<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<super::sections::OtlpProtocol, D::Error> {
    Scalar::deserialize(d)?
        .into_string()
        .and_then(|s| super::sections::OtlpProtocol::parse(&s))
        .ok_or_else(|| expected("\"http/protobuf\" or \"http/json\""))
}

/// `slo[].window`: the error budget's window, whole hours from [`MIN_SLO_WINDOW`] (the longest
/// alert window, 3 days) to [`MAX_SLO_WINDOW`] (a year). Longer than any other duration, so it
/// has its own parser.
pub(super) mod slo_window {
    use super::{expected, Deserialize, Deserializer, Duration, Scalar};
    use crate::config::limits::{MAX_SLO_WINDOW, MIN_SLO_WINDOW};
    use serde::Serializer;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let parsed = match Scalar::deserialize(d)? {
            Scalar::Str(s) => humantime::parse_duration(s.trim()).ok(),
            _ => None,
        };
        match parsed {
            Some(w)
                if w >= MIN_SLO_WINDOW
                    && w <= MAX_SLO_WINDOW
                    && w.as_secs() % 3600 == 0
                    && w.subsec_nanos() == 0 =>
            {
                Ok(w)
            }
            _ => Err(expected(
                "a duration of whole hours from 3d to 365d, such as \"30d\" or \"28d\" (at least \
                 the 3 days of the longest alert window)",
            )),
        }
    }

    pub fn serialize<S: Serializer>(v: &Duration, s: S) -> Result<S::Ok, S::Error> {
        humantime_serde::serialize(v, s)
    }
}

/// An optional duration (`slo[].lag`), parsed as [`duration`].
pub(super) mod optional_duration {
    use super::{Deserializer, Duration};
    use serde::Serializer;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        super::duration::deserialize(d).map(Some)
    }

    pub fn serialize<S: Serializer>(v: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(d) => humantime_serde::serialize(d, s),
            None => s.serialize_none(),
        }
    }
}

pub(super) fn boolean<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    match Scalar::deserialize(d)? {
        Scalar::Bool(b) => Ok(b),
        Scalar::Str(s) if s.trim().eq_ignore_ascii_case("true") => Ok(true),
        Scalar::Str(s) if s.trim().eq_ignore_ascii_case("false") => Ok(false),
        _ => Err(expected("true or false")),
    }
}

pub(super) fn string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Scalar::deserialize(d)?
        .into_string()
        .ok_or_else(|| expected("a string"))
}

pub(super) fn optional_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    string(d).map(Some)
}

pub(super) fn string_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    match Scalar::deserialize(d)? {
        Scalar::List(items) => items
            .into_iter()
            .map(Scalar::into_string)
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| expected("a list of strings")),
        _ => Err(expected("a list of strings")),
    }
}

/// A `[perspectives.sql]` statement: a string, its error at its own key.
struct Statement(String);

impl<'de> Deserialize<'de> for Statement {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        string(d).map(Statement)
    }
}

pub(super) fn statements<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    let map = BTreeMap::<String, Statement>::deserialize(d)?;
    Ok(map.into_iter().map(|(k, v)| (k, v.0)).collect())
}

pub(super) fn socket_addr<'de, D: Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    Scalar::deserialize(d)?
        .into_string()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| expected("an IP address and port, such as \"127.0.0.1:9464\""))
}

pub(super) fn log_format<'de, D: Deserializer<'de>>(d: D) -> Result<LogFormat, D::Error> {
    match Scalar::deserialize(d)?.into_string().as_deref() {
        Some("text") => Ok(LogFormat::Text),
        Some("json") => Ok(LogFormat::Json),
        _ => Err(expected("\"text\" or \"json\"")),
    }
}

/// A bare level must be a real one (catches `inof`, which the logger would take for a
/// target); anything else must be a filter the logger itself accepts, parsed by the same
/// parser `vantage run` uses, so `config check` and `run` agree.
pub(super) fn log_level<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    const LEVELS: &[&str] = &["trace", "debug", "info", "warn", "error", "off"];
    const WHAT: &str = "one of trace, debug, info, warn, error, off, or a filter directive such as \"info,vantage=debug\"";
    let s = string(d).map_err(|_: D::Error| expected(WHAT))?;
    let s = s.trim();
    let directive = s.contains('=') || s.contains(',');
    let valid = if directive {
        tracing_subscriber::EnvFilter::builder().parse(s).is_ok()
    } else {
        LEVELS.iter().any(|l| l.eq_ignore_ascii_case(s))
    };
    if valid {
        Ok(s.to_owned())
    } else {
        Err(expected(WHAT))
    }
}

/// `^[a-z_][a-z0-9_]*$`, at most 63 bytes (PostgreSQL's identifier limit): the schema is
/// spliced into SQL, so only what needs no quoting is accepted. And not a system schema:
/// PostgreSQL reserves `pg_*` (`pg_catalog`, `pg_toast`, `pg_temp_N`) and `information_schema`.
pub(super) fn schema<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let s = string(d)?;
    let mut chars = s.chars();
    let plain = matches!(chars.next(), Some('a'..='z' | '_'))
        && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'))
        && s.len() <= 63;
    if !plain {
        return Err(expected("a plain SQL identifier: lower-case letters, digits and _, not starting with a digit, at most 63 bytes"));
    }
    if s.starts_with("pg_") || s == "information_schema" {
        return Err(expected("a schema of vantage's own, not a system schema (information_schema, or any name starting with pg_: pg_catalog, pg_toast, pg_temp…)"));
    }
    Ok(s)
}

/// Empty = not configured (fall back to `PG*`). Otherwise a URL the PostgreSQL client
/// accepts, checked with the very parser the connection uses.
pub(super) fn database_url<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<DatabaseUrl>, D::Error> {
    let s = string(d)?;
    if s.trim().is_empty() {
        return Ok(None);
    }
    crate::connection::connect_options(&s).map_err(|problem| match problem {
        UrlProblem::NotPostgres => expected("a postgres:// or postgresql:// URL"),
        UrlProblem::Refused(reason) => expected(format!(
            "a postgres:// or postgresql:// URL the PostgreSQL client accepts ({reason})"
        )),
    })?;
    Ok(Some(DatabaseUrl::new(s)))
}
