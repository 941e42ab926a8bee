//! Settings.
//!
//! Layers, lowest to highest precedence:
//! 1. built-in defaults ([`Settings::default`], the values of SPEC §5);
//! 2. the TOML file: `--config PATH`, else [`DEFAULT_CONFIG_PATH`] if it exists, else none;
//! 3. `DATABASE_URL` (for `database.url` only);
//! 4. environment variables `VANTAGE__SECTION__KEY`, e.g. `VANTAGE__WORKER__CONSUMERS=8`;
//! 5. explicit overrides (CLI flags): [`LoadOptions::overrides`], then [`LoadOptions::database_url`].
//!
//! Every layer is merged first and validated once, so a bad value is reported the same way
//! whichever layer it came from, and the message says which layer that was.
//!
//! Environment variables and overrides can set the scalar keys of the sections only;
//! `[[perspectives]]` come from the file alone (a list of tables has no sane spelling as
//! environment variables). Unknown keys are errors everywhere, so a typo never silently
//! falls back to a default. An empty environment variable counts as unset.
//!
//! When no `database.url` is configured at all it stays `None`, and the storage layer builds
//! its connection from libpq's `PG*` environment variables (`PGHOST`, `PGPORT`, `PGUSER`,
//! `PGPASSWORD`, `PGDATABASE`, … through sqlx's `PgConnectOptions::new()`).
//!
//! The database password never leaves this module in clear text except through
//! [`DatabaseUrl::expose`]: `Debug`, `Display`, [`Settings::redacted_toml`] and every
//! [`ConfigError`] redact it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use config::{Map, Source, Value, ValueKind};

/// The file read when no `--config` is given, relative to the working directory (only if it
/// exists).
pub const DEFAULT_CONFIG_PATH: &str = "config/vantage.toml";

/// Environment variables `VANTAGE__SECTION__KEY` set `section.key`.
const ENV_PREFIX: &str = "VANTAGE";
const ENV_SEPARATOR: &str = "__";
/// Honoured for `database.url`, below `VANTAGE__DATABASE__URL`.
const DATABASE_URL_VAR: &str = "DATABASE_URL";

/// Largest value accepted for counts and seconds: they end up in SQL `int` parameters.
const MAX_SQL_INT: u64 = i32::MAX as u64;

const DATABASE_KEYS: &[&str] = &[
    "url",
    "schema",
    "max_connections",
    "auto_migrate",
    "connect_timeout",
];
const WORKER_KEYS: &[&str] = &[
    "consumers",
    "batch_size",
    "max_streams_per_claim",
    "lease",
    "poll_interval",
    "max_perspective_event_attempts",
    "retry_backoff_base",
    "retry_backoff_max",
    "shutdown_grace",
    "apply_timeout",
];
const COOLDOWN_KEYS: &[&str] = &["enabled", "ttl", "max_entries"];
const ORPHANS_KEYS: &[&str] = &["heartbeat_interval", "stale_after"];
const HTTP_KEYS: &[&str] = &["listen"];
const LOG_KEYS: &[&str] = &["format", "level"];
const PERSPECTIVE_KEYS: &[&str] = &["name", "events", "sql", "reset"];

/// The scalar sections, with their keys: the only things the environment and overrides can set.
const SECTIONS: &[(&str, &[&str])] = &[
    ("database", DATABASE_KEYS),
    ("worker", WORKER_KEYS),
    ("cooldown", COOLDOWN_KEYS),
    ("orphans", ORPHANS_KEYS),
    ("http", HTTP_KEYS),
    ("log", LOG_KEYS),
];
const ROOT_KEYS: &[&str] = &[
    "database",
    "worker",
    "cooldown",
    "orphans",
    "http",
    "log",
    "perspectives",
];

// ---------------------------------------------------------------------------------------------
// Settings

/// The effective configuration of one vantage process.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
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
    /// `[log]`
    pub log: LogSettings,
    /// `[[perspectives]]`: SQL perspectives, from the file only.
    pub perspectives: Vec<PerspectiveSettings>,
}

/// `[database]`
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseSettings {
    /// `url`: `postgres://` or `postgresql://`. `None` = libpq `PG*` environment variables.
    pub url: Option<DatabaseUrl>,
    /// `schema` (default `vantage`): a plain lower-case SQL identifier, so it can be spliced
    /// into statements without quoting.
    pub schema: String,
    /// `max_connections` (default 10).
    pub max_connections: u32,
    /// `auto_migrate` (default true): apply migrations at daemon start.
    pub auto_migrate: bool,
    /// `connect_timeout` (default 30 s): how long start-up retries an unreachable database.
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSettings {
    /// `consumers` (default 4): concurrent consumer loops.
    pub consumers: usize,
    /// `batch_size` (default 500): most work rows claimed at once.
    pub batch_size: u32,
    /// `max_streams_per_claim` (default 100).
    pub max_streams_per_claim: u32,
    /// `lease` (default 60 s, at least 1 s).
    pub lease: Duration,
    /// `poll_interval` (default 1 s): fallback when no NOTIFY arrives.
    pub poll_interval: Duration,
    /// `max_perspective_event_attempts` (default 10): a row is dead-lettered on claim
    /// `max + 1`. `None` (`"off"`) = never dead-letter.
    pub max_perspective_event_attempts: Option<u32>,
    /// `retry_backoff_base` (default 1 s): delay after the first failure.
    pub retry_backoff_base: Duration,
    /// `retry_backoff_max` (default 5 min): cap of the exponential backoff.
    pub retry_backoff_max: Duration,
    /// `shutdown_grace` (default 30 s): time given to in-flight applies at shutdown.
    pub shutdown_grace: Duration,
    /// `apply_timeout` (default 30 s, or half the lease when that is shorter; must be below
    /// the lease): the deadline of one apply. A timed-out apply is a retryable failure, charged
    /// like any other, so a hung handler cannot hold its lane forever.
    pub apply_timeout: Duration,
}

/// Default of `worker.apply_timeout`, when the lease leaves room for it.
const DEFAULT_APPLY_TIMEOUT: Duration = Duration::from_secs(30);

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
        }
    }
}

/// `[cooldown]`: the cache of recently applied work ids (SPEC §1.3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CooldownSettings {
    /// `enabled` (default true).
    pub enabled: bool,
    /// `ttl` (default 5 min).
    pub ttl: Duration,
    /// `max_entries` (default 100 000).
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

/// `[orphans]`: instance liveness (SPEC §1.5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrphanSettings {
    /// `heartbeat_interval` (default 10 s).
    pub heartbeat_interval: Duration,
    /// `stale_after` (default 30 s): an instance silent this long is dead.
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpSettings {
    /// `listen` (default `127.0.0.1:9464`): `/metrics`, `/healthz`, `/readyz`.
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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogSettings {
    /// `format` (default `text`).
    pub format: LogFormat,
    /// `level` (default `info`): a level or a `tracing` filter directive; `RUST_LOG` overrides.
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

/// `log.format`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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

/// One `[[perspectives]]` entry: a SQL perspective (SPEC §3.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PerspectiveSettings {
    /// `name`: unique, non-empty.
    pub name: String,
    /// `events`: the subscribed event types; `"*"` = every type.
    pub events: Vec<String>,
    /// `[perspectives.sql]`: event type → statement. Every listed event has one, and no
    /// statement names an unlisted type; with `events` containing `"*"`, statements may name
    /// any type and the `"*"` statement, required, runs for the types without their own.
    pub sql: BTreeMap<String, String>,
    /// `reset`: optional statement run by `vantage perspectives rebuild`.
    pub reset: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// DatabaseUrl

/// A database URL whose `Debug` and `Display` hide the password, so it cannot be logged by
/// accident. [`expose`](Self::expose) returns the real string for the connection only.
#[derive(Clone, PartialEq, Eq)]
pub struct DatabaseUrl(String);

impl DatabaseUrl {
    /// Wraps a URL. Validation (scheme, syntax) happens when settings are loaded.
    pub fn new(url: impl Into<String>) -> Self {
        Self(url.into())
    }

    /// The real URL, password included: pass it to the connection and nowhere else.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with the password (userinfo or `password=` query parameter) replaced by `***`.
    /// A string that does not parse as a URL is hidden entirely, since where its secret sits
    /// cannot be known.
    pub fn redacted(&self) -> String {
        const HIDDEN: &str = "<unparseable database url>";
        let Ok(mut url) = url::Url::parse(&self.0) else {
            return HIDDEN.to_owned();
        };
        if url.password().is_some() && url.set_password(Some("***")).is_err() {
            return HIDDEN.to_owned();
        }
        if url
            .query_pairs()
            .any(|(k, _)| k.eq_ignore_ascii_case("password"))
        {
            let pairs: Vec<(String, String)> = url
                .query_pairs()
                .map(|(k, v)| {
                    let v = if k.eq_ignore_ascii_case("password") {
                        "***".to_owned()
                    } else {
                        v.into_owned()
                    };
                    (k.into_owned(), v)
                })
                .collect();
            url.query_pairs_mut().clear().extend_pairs(pairs);
        }
        url.to_string()
    }
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DatabaseUrl")
            .field(&self.redacted())
            .finish()
    }
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

// ---------------------------------------------------------------------------------------------
// Errors

/// Invalid configuration. `vantage` exits with [`ConfigError::EXIT_CODE`]. Messages name the
/// key, the bad value and the layer it came from, and never contain the database password.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A value of the wrong type or out of range.
    #[error("invalid configuration: {key} = {value}{}: expected {expected}", from_suffix(.origin))]
    InvalidValue {
        /// Dotted key, e.g. `worker.consumers` or `perspectives[0].name`.
        key: String,
        /// The value as written (strings quoted), secrets redacted.
        value: String,
        /// The layer that set it: a file path, an environment variable, `an override`.
        origin: Option<String>,
        /// What would have been accepted.
        expected: String,
    },
    /// A key vantage does not know (usually a typo).
    #[error("invalid configuration: unknown key {key}{}: expected one of {expected}", from_suffix(.origin))]
    UnknownKey {
        /// Dotted key.
        key: String,
        /// The layer that set it.
        origin: Option<String>,
        /// The keys valid at that place.
        expected: String,
    },
    /// A rule about a key that is not about a single value (missing, inconsistent).
    #[error("invalid configuration: {key}: {message}")]
    Invalid {
        /// Dotted key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// `--config PATH` names a file that does not exist.
    #[error("invalid configuration: configuration file {} does not exist", .path.display())]
    FileNotFound {
        /// The path given.
        path: PathBuf,
    },
    /// The configuration file exists but cannot be read.
    #[error("invalid configuration: cannot read configuration file {}: {error}", .path.display())]
    FileRead {
        /// The path.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// The file is not valid TOML. The message gives line and column but never echoes the
    /// source line, which could hold a password.
    #[error("invalid configuration: {origin} is not valid TOML: {message}")]
    Syntax {
        /// The file.
        origin: String,
        /// Position and reason.
        message: String,
    },
    /// A `VANTAGE__*` or `DATABASE_URL` variable is not UTF-8.
    #[error("invalid configuration: environment variable {var} is not valid UTF-8")]
    NotUnicode {
        /// The variable name.
        var: String,
    },
    /// Anything else reported by the layering machinery (secrets scrubbed).
    #[error("invalid configuration: {0}")]
    Other(String),
}

impl ConfigError {
    /// Process exit code for invalid configuration (`EX_CONFIG` of sysexits.h).
    pub const EXIT_CODE: i32 = 78;

    fn other(err: config::ConfigError) -> Self {
        ConfigError::Other(scrub_secrets(&err.to_string()))
    }
}

fn from_suffix(origin: &Option<String>) -> String {
    match origin {
        Some(origin) => format!(" (from {origin})"),
        None => String::new(),
    }
}

// ---------------------------------------------------------------------------------------------
// Loading

/// Where the layers above the defaults come from.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// `--config PATH`. `None` = [`DEFAULT_CONFIG_PATH`] if it exists, else no file.
    pub config_path: Option<PathBuf>,
    /// `--database-url`: the highest layer for `database.url`.
    pub database_url: Option<String>,
    /// Explicit `("section.key", "value")` overrides (CLI flags), e.g.
    /// `("worker.consumers", "8")`. Values are parsed like environment variables.
    pub overrides: Vec<(String, String)>,
}

impl LoadOptions {
    /// The file that will be read: the explicit path (even if missing, which is then an error
    /// at load), else [`DEFAULT_CONFIG_PATH`] if it is a file, else none.
    pub fn resolved_config_path(&self) -> Option<PathBuf> {
        match &self.config_path {
            Some(path) => Some(path.clone()),
            None => {
                let default = Path::new(DEFAULT_CONFIG_PATH);
                default.is_file().then(|| default.to_path_buf())
            }
        }
    }
}

impl Settings {
    /// Loads and validates the configuration from every layer, reading the process
    /// environment.
    pub fn load(opts: &LoadOptions) -> Result<Settings, ConfigError> {
        Self::load_with_env(opts, &process_env()?)
    }

    /// Like [`load`](Self::load), but takes the environment from `env` (variable name →
    /// value) instead of the process, so tests need not mutate the global environment.
    pub fn load_with_env(
        opts: &LoadOptions,
        env: &HashMap<String, String>,
    ) -> Result<Settings, ConfigError> {
        let mut origins = Origins::default();
        let mut builder = config::Config::builder();

        if let Some(path) = opts.resolved_config_path() {
            let text = std::fs::read_to_string(&path).map_err(|error| {
                if error.kind() == std::io::ErrorKind::NotFound {
                    ConfigError::FileNotFound { path: path.clone() }
                } else {
                    ConfigError::FileRead {
                        path: path.clone(),
                        error,
                    }
                }
            })?;
            let label = path.display().to_string();
            builder = builder.add_source(Layer(parse_toml(&text, &label)?));
            origins.file = Some(label);
        }

        if let Some(url) = env.get(DATABASE_URL_VAR).filter(|v| !v.is_empty()) {
            builder = builder.add_source(Layer(Map::from_iter([(
                "database.url".to_owned(),
                Value::new(None, url.as_str()),
            )])));
            origins.database_url_var = true;
        }

        builder = builder.add_source(Layer(environment_layer(env, &mut origins)?));

        let mut overrides = Map::new();
        for (key, value) in &opts.overrides {
            check_settable(key, "an override")?;
            overrides.insert(key.clone(), Value::new(None, value.as_str()));
            origins.overrides.insert(key.clone());
        }
        if let Some(url) = &opts.database_url {
            overrides.insert("database.url".to_owned(), Value::new(None, url.as_str()));
            origins.database_url_flag = true;
        }
        builder = builder.add_source(Layer(overrides));

        let merged = builder.build().map_err(ConfigError::other)?;
        from_tree(merged.collect().map_err(ConfigError::other)?, &origins)
    }

    /// Defaults overlaid with `toml` only (no file lookup, no environment): for tests and
    /// embedding.
    pub fn from_toml_str(toml: &str) -> Result<Settings, ConfigError> {
        // There is only one layer, so errors need not say where a value came from.
        let tree = parse_toml(toml, "the configuration text")?;
        from_tree(tree, &Origins::default())
    }

    /// The effective configuration as TOML, with the database password replaced by `***`
    /// (for `vantage config check`). It parses back to the same settings, password aside.
    pub fn redacted_toml(&self) -> String {
        let mut out = String::new();
        let d = &self.database;
        out.push_str("[database]\n");
        match &d.url {
            Some(url) => entry(&mut out, "url", toml_string(&url.redacted())),
            None => out.push_str(
                "# url is not set: the connection comes from libpq's PG* environment variables\n",
            ),
        }
        entry(&mut out, "schema", toml_string(&d.schema));
        entry(&mut out, "max_connections", d.max_connections.to_string());
        entry(&mut out, "auto_migrate", d.auto_migrate.to_string());
        entry(
            &mut out,
            "connect_timeout",
            toml_duration(d.connect_timeout),
        );

        let w = &self.worker;
        out.push_str("\n[worker]\n");
        entry(&mut out, "consumers", w.consumers.to_string());
        entry(&mut out, "batch_size", w.batch_size.to_string());
        entry(
            &mut out,
            "max_streams_per_claim",
            w.max_streams_per_claim.to_string(),
        );
        entry(&mut out, "lease", toml_duration(w.lease));
        entry(&mut out, "poll_interval", toml_duration(w.poll_interval));
        entry(
            &mut out,
            "max_perspective_event_attempts",
            match w.max_perspective_event_attempts {
                Some(max) => max.to_string(),
                None => toml_string("off"),
            },
        );
        entry(
            &mut out,
            "retry_backoff_base",
            toml_duration(w.retry_backoff_base),
        );
        entry(
            &mut out,
            "retry_backoff_max",
            toml_duration(w.retry_backoff_max),
        );
        entry(&mut out, "shutdown_grace", toml_duration(w.shutdown_grace));
        entry(&mut out, "apply_timeout", toml_duration(w.apply_timeout));

        let c = &self.cooldown;
        out.push_str("\n[cooldown]\n");
        entry(&mut out, "enabled", c.enabled.to_string());
        entry(&mut out, "ttl", toml_duration(c.ttl));
        entry(&mut out, "max_entries", c.max_entries.to_string());

        let o = &self.orphans;
        out.push_str("\n[orphans]\n");
        entry(
            &mut out,
            "heartbeat_interval",
            toml_duration(o.heartbeat_interval),
        );
        entry(&mut out, "stale_after", toml_duration(o.stale_after));

        out.push_str("\n[http]\n");
        entry(
            &mut out,
            "listen",
            toml_string(&self.http.listen.to_string()),
        );

        out.push_str("\n[log]\n");
        entry(&mut out, "format", toml_string(self.log.format.as_str()));
        entry(&mut out, "level", toml_string(&self.log.level));

        for p in &self.perspectives {
            out.push_str("\n[[perspectives]]\n");
            entry(&mut out, "name", toml_string(&p.name));
            let events: Vec<String> = p.events.iter().map(|e| toml_string(e)).collect();
            entry(&mut out, "events", format!("[{}]", events.join(", ")));
            if let Some(reset) = &p.reset {
                entry(&mut out, "reset", toml_string(reset));
            }
            if !p.sql.is_empty() {
                out.push_str("[perspectives.sql]\n");
                for (event_type, statement) in &p.sql {
                    entry(&mut out, &toml_key(event_type), toml_string(statement));
                }
            }
        }
        out
    }
}

/// The `VANTAGE__*` and `DATABASE_URL` variables of the process. Others are not read, so an
/// unrelated non-UTF-8 variable cannot fail the load.
fn process_env() -> Result<HashMap<String, String>, ConfigError> {
    let prefix = format!("{ENV_PREFIX}{ENV_SEPARATOR}");
    let mut env = HashMap::new();
    for (name, value) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        if name == DATABASE_URL_VAR || name.to_ascii_uppercase().starts_with(&prefix) {
            let value = value.into_string().map_err(|_| ConfigError::NotUnicode {
                var: name.to_owned(),
            })?;
            env.insert(name.to_owned(), value);
        }
    }
    Ok(env)
}

/// The `VANTAGE__SECTION__KEY` layer, keys checked. Values stay strings (no `try_parsing`):
/// each key's parser accepts the string spelling, so `"off"`, `"10"` or a numeric schema
/// are read as the key expects rather than as whatever they look like.
fn environment_layer(
    env: &HashMap<String, String>,
    origins: &mut Origins,
) -> Result<Map<String, Value>, ConfigError> {
    let source: Map<String, String> = env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let layer = config::Environment::with_prefix(ENV_PREFIX)
        .prefix_separator(ENV_SEPARATOR)
        .separator(ENV_SEPARATOR)
        .ignore_empty(true)
        .try_parsing(false)
        .source(Some(source))
        .collect()
        .map_err(ConfigError::other)?;
    for key in layer.keys() {
        let var = format!(
            "{ENV_PREFIX}{ENV_SEPARATOR}{}",
            key.replace('.', ENV_SEPARATOR).to_uppercase()
        );
        check_settable(key, &var)?;
        origins.env.insert(key.clone(), var);
    }
    Ok(layer)
}

/// Environment variables and overrides may set `section.key` of the scalar sections only.
fn check_settable(key: &str, origin: &str) -> Result<(), ConfigError> {
    let mut parts = key.split('.');
    let (section, name, rest) = (parts.next(), parts.next(), parts.next());
    if section == Some("perspectives") {
        return Err(ConfigError::Invalid {
            key: key.to_owned(),
            message: format!("perspectives can only be configured in the file, not from {origin}"),
        });
    }
    let Some(&(section, keys)) = SECTIONS.iter().find(|(s, _)| Some(*s) == section) else {
        return Err(ConfigError::UnknownKey {
            key: key.to_owned(),
            origin: Some(origin.to_owned()),
            expected: all_settable_keys(),
        });
    };
    match (name, rest) {
        (Some(name), None) if keys.contains(&name) => Ok(()),
        _ => Err(ConfigError::UnknownKey {
            key: key.to_owned(),
            origin: Some(origin.to_owned()),
            expected: prefixed(section, keys),
        }),
    }
}

fn all_settable_keys() -> String {
    SECTIONS
        .iter()
        .map(|(section, keys)| prefixed(section, keys))
        .collect::<Vec<_>>()
        .join(", ")
}

fn prefixed(section: &str, keys: &[&str]) -> String {
    keys.iter()
        .map(|k| format!("{section}.{k}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses TOML into a layer. The parser's message echoes the offending source line, which
/// may hold a password, so only position and reason are kept.
fn parse_toml(text: &str, label: &str) -> Result<Map<String, Value>, ConfigError> {
    config::File::from_str(text, config::FileFormat::Toml)
        .collect()
        .map_err(|err| {
            let message = match &err {
                config::ConfigError::FileParse { cause, .. } => cause.to_string(),
                other => other.to_string(),
            };
            let message = message
                .lines()
                .map(str::trim)
                .filter(|line| !line.is_empty() && !is_source_echo(line))
                .collect::<Vec<_>>()
                .join("; ");
            ConfigError::Syntax {
                origin: label.to_owned(),
                message: scrub_secrets(&message),
            }
        })
}

/// A line of the TOML error's source excerpt: `|`, `2 | url = …`, `|   ^^^`.
fn is_source_echo(line: &str) -> bool {
    line.trim_start_matches(|c: char| c.is_ascii_digit())
        .trim_start()
        .starts_with('|')
}

/// A ready-made layer for the builder. `Debug` is opaque because values may hold the
/// password and the `config` crate's types derive `Debug`.
#[derive(Clone)]
struct Layer(Map<String, Value>);

impl fmt::Debug for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Layer(..)")
    }
}

impl Source for Layer {
    fn clone_into_box(&self) -> Box<dyn Source + Send + Sync> {
        Box::new(self.clone())
    }

    fn collect(&self) -> Result<Map<String, Value>, config::ConfigError> {
        Ok(self.0.clone())
    }
}

/// Which layer set each key, so that errors can point the operator at the right place.
#[derive(Debug, Default)]
struct Origins {
    file: Option<String>,
    env: HashMap<String, String>,
    database_url_var: bool,
    overrides: HashSet<String>,
    database_url_flag: bool,
}

impl Origins {
    /// The highest layer that set `key`.
    fn of(&self, key: &str) -> Option<String> {
        let is_url = key == "database.url";
        if is_url && self.database_url_flag {
            Some("--database-url".to_owned())
        } else if self.overrides.contains(key) {
            Some("an override".to_owned())
        } else if let Some(var) = self.env.get(key) {
            Some(var.clone())
        } else if is_url && self.database_url_var {
            Some(DATABASE_URL_VAR.to_owned())
        } else {
            self.file.clone()
        }
    }

    fn invalid(&self, key: &str, value: String, expected: impl Into<String>) -> ConfigError {
        ConfigError::InvalidValue {
            key: key.to_owned(),
            value,
            origin: self.of(key),
            expected: expected.into(),
        }
    }

    fn unknown(&self, key: &str, expected: String) -> ConfigError {
        ConfigError::UnknownKey {
            key: key.to_owned(),
            origin: self.of(key),
            expected,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// From the merged tree to Settings

/// One table of the merged tree; keys are removed as they are read so that whatever is left
/// over is unknown.
struct Table<'o> {
    path: String,
    map: Map<String, Value>,
    origins: &'o Origins,
}

impl<'o> Table<'o> {
    fn key(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_owned()
        } else {
            format!("{}.{name}", self.path)
        }
    }

    /// Reads and parses `name` if present.
    fn get<T>(
        &mut self,
        name: &str,
        parse: impl FnOnce(&Value) -> Result<T, String>,
    ) -> Result<Option<T>, ConfigError> {
        let Some(value) = self.map.remove(name) else {
            return Ok(None);
        };
        let key = self.key(name);
        parse(&value)
            .map(Some)
            .map_err(|expected| self.origins.invalid(&key, render(&key, &value), expected))
    }

    /// Reads `name` into `slot` if present, leaving the default otherwise.
    fn set<T>(
        &mut self,
        name: &str,
        slot: &mut T,
        parse: impl FnOnce(&Value) -> Result<T, String>,
    ) -> Result<(), ConfigError> {
        if let Some(value) = self.get(name, parse)? {
            *slot = value;
        }
        Ok(())
    }

    /// A nested table, absent = empty.
    fn table(&mut self, name: &str) -> Result<Table<'o>, ConfigError> {
        let map = self.get(name, as_table)?.unwrap_or_default();
        Ok(Table {
            path: self.key(name),
            map,
            origins: self.origins,
        })
    }

    /// Fails on the first (alphabetically) key that was not read.
    fn finish(self, known: &[&str]) -> Result<(), ConfigError> {
        match self.map.keys().min() {
            Some(name) => Err(self.origins.unknown(&self.key(name), known.join(", "))),
            None => Ok(()),
        }
    }
}

fn from_tree(root: Map<String, Value>, origins: &Origins) -> Result<Settings, ConfigError> {
    let mut root = Table {
        path: String::new(),
        map: root,
        origins,
    };
    let mut s = Settings::default();

    let mut t = root.table("database")?;
    let d = &mut s.database;
    t.set("url", &mut d.url, database_url)?;
    t.set("schema", &mut d.schema, schema)?;
    t.set("max_connections", &mut d.max_connections, positive_u32)?;
    t.set("auto_migrate", &mut d.auto_migrate, boolean)?;
    t.set("connect_timeout", &mut d.connect_timeout, duration)?;
    t.finish(DATABASE_KEYS)?;

    let mut t = root.table("worker")?;
    let w = &mut s.worker;
    t.set("consumers", &mut w.consumers, |v| {
        positive_u32(v).map(|n| n as usize)
    })?;
    t.set("batch_size", &mut w.batch_size, positive_u32)?;
    t.set(
        "max_streams_per_claim",
        &mut w.max_streams_per_claim,
        positive_u32,
    )?;
    t.set("lease", &mut w.lease, duration)?;
    t.set("poll_interval", &mut w.poll_interval, duration)?;
    t.set(
        "max_perspective_event_attempts",
        &mut w.max_perspective_event_attempts,
        attempts,
    )?;
    t.set("retry_backoff_base", &mut w.retry_backoff_base, duration)?;
    t.set("retry_backoff_max", &mut w.retry_backoff_max, duration)?;
    t.set("shutdown_grace", &mut w.shutdown_grace, duration)?;
    // Not set: 30 s, or half the lease when the lease is shorter than a minute.
    let mut apply_timeout = None;
    t.set("apply_timeout", &mut apply_timeout, |v| {
        duration(v).map(Some)
    })?;
    w.apply_timeout = apply_timeout.unwrap_or_else(|| DEFAULT_APPLY_TIMEOUT.min(w.lease / 2));
    t.finish(WORKER_KEYS)?;

    let mut t = root.table("cooldown")?;
    let c = &mut s.cooldown;
    t.set("enabled", &mut c.enabled, boolean)?;
    t.set("ttl", &mut c.ttl, duration)?;
    // 0 is parsed here and rejected by `validate` only when the cache is enabled.
    t.set("max_entries", &mut c.max_entries, |v| {
        integer(v, 0).map(|n| n as usize)
    })?;
    t.finish(COOLDOWN_KEYS)?;

    let mut t = root.table("orphans")?;
    t.set(
        "heartbeat_interval",
        &mut s.orphans.heartbeat_interval,
        duration,
    )?;
    t.set("stale_after", &mut s.orphans.stale_after, duration)?;
    t.finish(ORPHANS_KEYS)?;

    let mut t = root.table("http")?;
    t.set("listen", &mut s.http.listen, socket_addr)?;
    t.finish(HTTP_KEYS)?;

    let mut t = root.table("log")?;
    t.set("format", &mut s.log.format, log_format)?;
    t.set("level", &mut s.log.level, log_level)?;
    t.finish(LOG_KEYS)?;

    if let Some(list) = root.get("perspectives", as_perspective_list)? {
        for (i, map) in list.into_iter().enumerate() {
            let mut t = Table {
                path: format!("perspectives[{i}]"),
                map,
                origins,
            };
            let missing = |name: &str| ConfigError::Invalid {
                key: format!("perspectives[{i}].{name}"),
                message: "missing".to_owned(),
            };
            let name = t.get("name", string)?.ok_or_else(|| missing("name"))?;
            let events = t
                .get("events", string_list)?
                .ok_or_else(|| missing("events"))?;
            let mut sql_table = t.table("sql")?;
            let mut sql = BTreeMap::new();
            for event_type in sql_table.map.keys().cloned().collect::<Vec<_>>() {
                if let Some(statement) = sql_table.get(&event_type, string)? {
                    sql.insert(event_type, statement);
                }
            }
            let reset = t.get("reset", string)?;
            t.finish(PERSPECTIVE_KEYS)?;
            s.perspectives.push(PerspectiveSettings {
                name,
                events,
                sql,
                reset,
            });
        }
    }
    root.finish(ROOT_KEYS)?;

    validate(&s, origins)?;
    Ok(s)
}

/// Rules across keys, checked once on the merged result.
fn validate(s: &Settings, origins: &Origins) -> Result<(), ConfigError> {
    let w = &s.worker;
    if w.lease < Duration::from_secs(1) || w.lease.as_secs() > MAX_SQL_INT {
        return Err(origins.invalid(
            "worker.lease",
            toml_duration(w.lease),
            "a duration of at least 1s (leases are whole seconds in SQL)",
        ));
    }
    if w.apply_timeout.is_zero() || w.apply_timeout >= w.lease {
        return Err(origins.invalid(
            "worker.apply_timeout",
            toml_duration(w.apply_timeout),
            format!(
                "a duration greater than zero and below worker.lease ({}): an apply must end while its lease is held",
                toml_duration(w.lease)
            ),
        ));
    }
    // Zero would make the interval timers spin (tokio refuses a zero period).
    if w.poll_interval.is_zero() {
        return Err(origins.invalid(
            "worker.poll_interval",
            toml_duration(w.poll_interval),
            "a duration greater than zero",
        ));
    }
    if w.retry_backoff_base > w.retry_backoff_max {
        return Err(origins.invalid(
            "worker.retry_backoff_base",
            toml_duration(w.retry_backoff_base),
            format!(
                "at most worker.retry_backoff_max ({})",
                toml_duration(w.retry_backoff_max)
            ),
        ));
    }
    let o = &s.orphans;
    if o.heartbeat_interval.is_zero() {
        return Err(origins.invalid(
            "orphans.heartbeat_interval",
            toml_duration(o.heartbeat_interval),
            "a duration greater than zero",
        ));
    }
    if o.stale_after <= o.heartbeat_interval {
        return Err(origins.invalid(
            "orphans.stale_after",
            toml_duration(o.stale_after),
            format!(
                "more than orphans.heartbeat_interval ({}), or live instances would be declared dead",
                toml_duration(o.heartbeat_interval)
            ),
        ));
    }
    let c = &s.cooldown;
    if c.enabled && c.max_entries == 0 {
        return Err(origins.invalid(
            "cooldown.max_entries",
            "0".to_owned(),
            "a positive integer while cooldown.enabled = true",
        ));
    }
    if c.enabled && c.ttl.is_zero() {
        return Err(origins.invalid(
            "cooldown.ttl",
            toml_duration(c.ttl),
            "a duration greater than zero while cooldown.enabled = true",
        ));
    }

    let mut names: HashMap<&str, usize> = HashMap::new();
    for (i, p) in s.perspectives.iter().enumerate() {
        let at = |field: &str| format!("perspectives[{i}].{field}");
        if p.name.trim().is_empty() {
            return Err(origins.invalid(&at("name"), quote(&p.name), "a non-empty name"));
        }
        if let Some(first) = names.insert(&p.name, i) {
            return Err(origins.invalid(
                &at("name"),
                quote(&p.name),
                format!("a name not used by another perspective (perspectives[{first}] has it)"),
            ));
        }
        if p.events.is_empty() {
            return Err(ConfigError::Invalid {
                key: at("events"),
                message: format!("perspective '{}' subscribes to no event type", p.name),
            });
        }
        let mut seen = HashSet::new();
        for event_type in &p.events {
            if event_type.trim().is_empty() || !seen.insert(event_type.as_str()) {
                return Err(origins.invalid(
                    &at("events"),
                    quote(event_type),
                    "distinct, non-empty event types",
                ));
            }
        }
        let wildcard = p.events.iter().any(|e| e == "*");
        for (event_type, statement) in &p.sql {
            let key = format!("perspectives[{i}].sql.{event_type}");
            if !wildcard && !p.events.contains(event_type) {
                return Err(ConfigError::Invalid {
                    key,
                    message: format!(
                        "perspective '{}' has a statement for event type '{event_type}', which is not listed in its events",
                        p.name
                    ),
                });
            }
            if statement.trim().is_empty() {
                return Err(ConfigError::Invalid {
                    key,
                    message: "the statement is empty".to_owned(),
                });
            }
        }
        if !wildcard {
            if let Some(event_type) = p.events.iter().find(|e| !p.sql.contains_key(*e)) {
                return Err(ConfigError::Invalid {
                    key: at("sql"),
                    message: format!(
                        "perspective '{}' lists event type '{event_type}' but has no statement for it",
                        p.name
                    ),
                });
            }
        }
        if p.reset.as_deref().is_some_and(|r| r.trim().is_empty()) {
            return Err(ConfigError::Invalid {
                key: at("reset"),
                message: "the statement is empty".to_owned(),
            });
        }
    }
    validate_perspective_statements(&s.perspectives)
}

// ---------------------------------------------------------------------------------------------
// Perspective statements

/// What can be refused about SQL perspective statements without a database (the rules are the
/// SQL perspective's own, [`SqlPerspective::check`](crate::perspective::SqlPerspective::check)):
/// a subscribed type with no statement to run (`"*"` needs a `"*"` statement), a parameter
/// beyond `$7` (or any in `reset`), a statement that ends or controls the transaction. The
/// daemon checks again after preparing, with PostgreSQL's own parameter count.
fn validate_perspective_statements(
    perspectives: &[PerspectiveSettings],
) -> Result<(), ConfigError> {
    for (i, p) in perspectives.iter().enumerate() {
        crate::perspective::SqlPerspective::from_settings(p)
            .check()
            .map_err(|e| ConfigError::Invalid {
                key: format!("perspectives[{i}].{}", e.key),
                message: e.to_string(),
            })?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Value parsers: each returns what it expected on failure. Scalars accept their string spelling
// too, because environment variables and overrides are always strings.

fn as_table(v: &Value) -> Result<Map<String, Value>, String> {
    match &v.kind {
        ValueKind::Table(map) => Ok(map.clone()),
        _ => Err("a table".to_owned()),
    }
}

fn as_perspective_list(v: &Value) -> Result<Vec<Map<String, Value>>, String> {
    let expected = || "a list of tables ([[perspectives]])".to_owned();
    match &v.kind {
        ValueKind::Array(items) => items
            .iter()
            .map(|item| match &item.kind {
                ValueKind::Table(map) => Ok(map.clone()),
                _ => Err(expected()),
            })
            .collect(),
        _ => Err(expected()),
    }
}

/// An integer in `min..=i32::MAX`, from a TOML integer or its decimal string.
fn integer(v: &Value, min: u64) -> Result<u64, String> {
    let n: Option<i128> = match &v.kind {
        ValueKind::I64(n) => Some(i128::from(*n)),
        ValueKind::U64(n) => Some(i128::from(*n)),
        ValueKind::I128(n) => Some(*n),
        ValueKind::U128(n) => i128::try_from(*n).ok(),
        ValueKind::String(s) => s.trim().parse::<i128>().ok(),
        _ => None,
    };
    let expected = if min == 0 {
        "a non-negative integer"
    } else {
        "a positive integer"
    };
    match n {
        Some(n) if n >= i128::from(min) && n <= i128::from(MAX_SQL_INT) => Ok(n as u64),
        Some(n) if n > i128::from(MAX_SQL_INT) => Err(format!("{expected} up to {MAX_SQL_INT}")),
        _ => Err(expected.to_owned()),
    }
}

fn positive_u32(v: &Value) -> Result<u32, String> {
    integer(v, 1).map(|n| n as u32)
}

fn attempts(v: &Value) -> Result<Option<u32>, String> {
    if let ValueKind::String(s) = &v.kind {
        if s.trim().eq_ignore_ascii_case("off") {
            return Ok(None);
        }
    }
    integer(v, 1)
        .map(|n| Some(n as u32))
        .map_err(|_| "a positive integer or \"off\"".to_owned())
}

fn boolean(v: &Value) -> Result<bool, String> {
    match &v.kind {
        ValueKind::Boolean(b) => Ok(*b),
        ValueKind::String(s) if s.trim().eq_ignore_ascii_case("true") => Ok(true),
        ValueKind::String(s) if s.trim().eq_ignore_ascii_case("false") => Ok(false),
        _ => Err("true or false".to_owned()),
    }
}

fn string(v: &Value) -> Result<String, String> {
    match &v.kind {
        ValueKind::String(s) => Ok(s.clone()),
        _ => Err("a string".to_owned()),
    }
}

fn string_list(v: &Value) -> Result<Vec<String>, String> {
    let expected = || "a list of strings".to_owned();
    match &v.kind {
        ValueKind::Array(items) => items
            .iter()
            .map(|item| string(item).map_err(|_| expected()))
            .collect(),
        _ => Err(expected()),
    }
}

fn duration(v: &Value) -> Result<Duration, String> {
    let expected = || "a duration with a unit, such as \"30s\", \"5m\" or \"250ms\"".to_owned();
    match &v.kind {
        ValueKind::String(s) => humantime::parse_duration(s.trim()).map_err(|_| expected()),
        _ => Err(expected()),
    }
}

fn socket_addr(v: &Value) -> Result<SocketAddr, String> {
    let expected = || "an IP address and port, such as \"127.0.0.1:9464\"".to_owned();
    match &v.kind {
        ValueKind::String(s) => s.trim().parse().map_err(|_| expected()),
        _ => Err(expected()),
    }
}

fn log_format(v: &Value) -> Result<LogFormat, String> {
    match &v.kind {
        ValueKind::String(s) if s == "text" => Ok(LogFormat::Text),
        ValueKind::String(s) if s == "json" => Ok(LogFormat::Json),
        _ => Err("\"text\" or \"json\"".to_owned()),
    }
}

/// A bare level must be a real one (catches `inof`); anything with `=` or `,` is a `tracing`
/// filter directive and is left to the logger.
fn log_level(v: &Value) -> Result<String, String> {
    const LEVELS: &[&str] = &["trace", "debug", "info", "warn", "error", "off"];
    let expected = || {
        "one of trace, debug, info, warn, error, off, or a filter directive such as \"info,vantage=debug\""
            .to_owned()
    };
    let s = string(v).map_err(|_| expected())?;
    let s = s.trim();
    let directive = s.contains('=') || s.contains(',');
    if s.is_empty() || (!directive && !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(s))) {
        return Err(expected());
    }
    Ok(s.to_owned())
}

/// `^[a-z_][a-z0-9_]*$`, at most 63 bytes (PostgreSQL's identifier limit): the schema is
/// spliced into SQL, so only what needs no quoting is accepted.
fn schema(v: &Value) -> Result<String, String> {
    let s = string(v)?;
    let mut chars = s.chars();
    let plain = matches!(chars.next(), Some('a'..='z' | '_'))
        && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'))
        && s.len() <= 63;
    if plain {
        Ok(s)
    } else {
        Err("a plain SQL identifier: lower-case letters, digits and _, not starting with a digit, at most 63 bytes".to_owned())
    }
}

/// Empty = not configured (fall back to `PG*`).
fn database_url(v: &Value) -> Result<Option<DatabaseUrl>, String> {
    let s = string(v)?;
    if s.trim().is_empty() {
        return Ok(None);
    }
    match url::Url::parse(&s) {
        Ok(url) if matches!(url.scheme(), "postgres" | "postgresql") => {
            Ok(Some(DatabaseUrl::new(s)))
        }
        _ => Err("a postgres:// or postgresql:// URL".to_owned()),
    }
}

/// How a bad value is shown in an error: strings quoted, the database URL redacted, and
/// anything URL-like scrubbed in case a secret was pasted under the wrong key.
fn render(key: &str, v: &Value) -> String {
    match &v.kind {
        ValueKind::String(s) if key == "database.url" => {
            quote(&DatabaseUrl::new(s.as_str()).redacted())
        }
        ValueKind::String(s) => quote(&scrub_secrets(s)),
        ValueKind::Nil => "nothing".to_owned(),
        ValueKind::Boolean(b) => b.to_string(),
        ValueKind::I64(n) => n.to_string(),
        ValueKind::I128(n) => n.to_string(),
        ValueKind::U64(n) => n.to_string(),
        ValueKind::U128(n) => n.to_string(),
        ValueKind::Float(f) => f.to_string(),
        ValueKind::Table(_) => "a table".to_owned(),
        ValueKind::Array(_) => "a list".to_owned(),
    }
}

fn quote(s: &str) -> String {
    format!("{s:?}")
}

/// Replaces the password of anything that looks like `scheme://user:password@host` and any
/// `password=value` in free text. Used on messages that quote user input.
fn scrub_secrets(text: &str) -> String {
    let is_end = |c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '`');
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find("://") {
        let (head, tail) = rest.split_at(pos + 3);
        out.push_str(head);
        let token_len = tail.find(is_end).unwrap_or(tail.len());
        let (token, after) = tail.split_at(token_len);
        match token.rfind('@') {
            Some(at) if token[..at].contains(':') => {
                let colon = token[..at].find(':').unwrap_or(at);
                out.push_str(&token[..=colon]);
                out.push_str("***");
                out.push_str(&token[at..]);
            }
            _ => out.push_str(token),
        }
        rest = after;
    }
    out.push_str(rest);

    let lower = out.to_ascii_lowercase();
    let mut scrubbed = String::with_capacity(out.len());
    let mut i = 0;
    while let Some(found) = lower[i..].find("password=") {
        let start = i + found + "password=".len();
        scrubbed.push_str(&out[i..start]);
        let len = out[start..]
            .find(|c: char| is_end(c) || c == '&')
            .unwrap_or(out.len() - start);
        if len > 0 {
            scrubbed.push_str("***");
        }
        i = start + len;
    }
    scrubbed.push_str(&out[i..]);
    scrubbed
}

// ---------------------------------------------------------------------------------------------
// TOML output

fn entry(out: &mut String, key: &str, value: String) {
    out.push_str(key);
    out.push_str(" = ");
    out.push_str(&value);
    out.push('\n');
}

fn toml_duration(d: Duration) -> String {
    toml_string(&humantime::format_duration(d).to_string())
}

/// A TOML basic string.
fn toml_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Bare when TOML allows it, quoted otherwise (event types may contain dots).
fn toml_key(key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if bare {
        key.to_owned()
    } else {
        toml_string(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const SECRET_URL: &str = "postgres://u:secret@h/db";

    fn env(vars: &[(&str, &str)]) -> HashMap<String, String> {
        vars.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn file(contents: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
        f.write_all(contents.as_bytes()).unwrap();
        f
    }

    fn opts(f: &tempfile::NamedTempFile) -> LoadOptions {
        LoadOptions {
            config_path: Some(f.path().to_path_buf()),
            ..LoadOptions::default()
        }
    }

    fn err(toml: &str) -> String {
        Settings::from_toml_str(toml).unwrap_err().to_string()
    }

    #[test]
    fn defaults_are_as_specified() {
        let s = Settings::from_toml_str("").unwrap();
        assert_eq!(s, Settings::default());
        assert_eq!(s.database.url, None);
        assert_eq!(s.database.schema, "vantage");
        assert_eq!(s.database.max_connections, 10);
        assert!(s.database.auto_migrate);
        assert_eq!(s.database.connect_timeout, Duration::from_secs(30));
        assert_eq!(s.worker.consumers, 4);
        assert_eq!(s.worker.batch_size, 500);
        assert_eq!(s.worker.max_streams_per_claim, 100);
        assert_eq!(s.worker.lease, Duration::from_secs(60));
        assert_eq!(s.worker.poll_interval, Duration::from_secs(1));
        assert_eq!(s.worker.max_perspective_event_attempts, Some(10));
        assert_eq!(s.worker.retry_backoff_base, Duration::from_secs(1));
        assert_eq!(s.worker.retry_backoff_max, Duration::from_secs(300));
        assert_eq!(s.worker.shutdown_grace, Duration::from_secs(30));
        assert!(s.cooldown.enabled);
        assert_eq!(s.cooldown.ttl, Duration::from_secs(300));
        assert_eq!(s.cooldown.max_entries, 100_000);
        assert_eq!(s.orphans.heartbeat_interval, Duration::from_secs(10));
        assert_eq!(s.orphans.stale_after, Duration::from_secs(30));
        assert_eq!(s.http.listen, "127.0.0.1:9464".parse().unwrap());
        assert_eq!(s.log.format, LogFormat::Text);
        assert_eq!(s.log.level, "info");
        assert!(s.perspectives.is_empty());
    }

    #[test]
    fn file_overrides_defaults() {
        let s = Settings::from_toml_str(
            r#"
            [database]
            url = "postgres://h/db"
            schema = "read_models"
            [worker]
            consumers = 2
            lease = "90s"
            retry_backoff_base = "250ms"
            [log]
            format = "json"
            "#,
        )
        .unwrap();
        assert_eq!(s.database.url.unwrap().expose(), "postgres://h/db");
        assert_eq!(s.database.schema, "read_models");
        assert_eq!(s.worker.consumers, 2);
        assert_eq!(s.worker.lease, Duration::from_secs(90));
        assert_eq!(s.worker.retry_backoff_base, Duration::from_millis(250));
        assert_eq!(s.log.format, LogFormat::Json);
        // Untouched keys keep their defaults.
        assert_eq!(s.worker.batch_size, 500);
        assert_eq!(s.database.max_connections, 10);
    }

    #[test]
    fn spec_perspective_example_parses() {
        let s = Settings::from_toml_str(
            r#"
            [[perspectives]]
            name = "order_summary"
            events = ["OrderPlaced", "OrderShipped"]
            reset = "TRUNCATE order_summary"
            [perspectives.sql]
            OrderPlaced  = "INSERT INTO order_summary (order_id) VALUES (($1->>'order_id')::uuid)"
            OrderShipped = "UPDATE order_summary SET status = 'shipped'"

            [[perspectives]]
            name = "audit"
            events = ["*"]
            [perspectives.sql]
            "*" = "INSERT INTO audit_log (event_id, event_type) VALUES ($3, $4)"
            "#,
        )
        .unwrap();
        assert_eq!(s.perspectives.len(), 2);
        let p = &s.perspectives[0];
        assert_eq!(p.name, "order_summary");
        assert_eq!(p.events, ["OrderPlaced", "OrderShipped"]);
        assert_eq!(p.reset.as_deref(), Some("TRUNCATE order_summary"));
        assert!(p.sql["OrderPlaced"].starts_with("INSERT"));
        assert!(p.sql["OrderShipped"].starts_with("UPDATE"));
        assert_eq!(s.perspectives[1].events, ["*"]);
        assert_eq!(s.perspectives[1].sql.keys().collect::<Vec<_>>(), ["*"]);
    }

    #[test]
    fn env_overrides_file_and_database_url_sits_between() {
        let f = file(
            "[worker]\nconsumers = 2\nbatch_size = 7\n[database]\nurl = \"postgres://file/db\"\n",
        );
        let o = opts(&f);

        let s = Settings::load_with_env(&o, &env(&[])).unwrap();
        assert_eq!(s.worker.consumers, 2);
        assert_eq!(s.database.url.unwrap().expose(), "postgres://file/db");

        let s = Settings::load_with_env(
            &o,
            &env(&[
                ("VANTAGE__WORKER__CONSUMERS", "8"),
                ("VANTAGE__WORKER__LEASE", "2m"),
                ("VANTAGE__COOLDOWN__ENABLED", "false"),
                ("DATABASE_URL", "postgres://env/db"),
                ("UNRELATED", "x"),
            ]),
        )
        .unwrap();
        assert_eq!(s.worker.consumers, 8);
        assert_eq!(s.worker.batch_size, 7);
        assert_eq!(s.worker.lease, Duration::from_secs(120));
        assert!(!s.cooldown.enabled);
        assert_eq!(s.database.url.unwrap().expose(), "postgres://env/db");

        let s = Settings::load_with_env(
            &o,
            &env(&[
                ("DATABASE_URL", "postgres://env/db"),
                ("VANTAGE__DATABASE__URL", "postgres://vantage/db"),
            ]),
        )
        .unwrap();
        assert_eq!(s.database.url.unwrap().expose(), "postgres://vantage/db");

        // Empty variables count as unset.
        let s = Settings::load_with_env(
            &o,
            &env(&[("VANTAGE__WORKER__CONSUMERS", ""), ("DATABASE_URL", "")]),
        )
        .unwrap();
        assert_eq!(s.worker.consumers, 2);
        assert_eq!(s.database.url.unwrap().expose(), "postgres://file/db");
    }

    #[test]
    fn overrides_beat_env() {
        let f = file("[worker]\nconsumers = 2\n");
        let o = LoadOptions {
            overrides: vec![("worker.consumers".into(), "16".into())],
            database_url: Some("postgres://flag/db".into()),
            ..opts(&f)
        };
        let s = Settings::load_with_env(
            &o,
            &env(&[
                ("VANTAGE__WORKER__CONSUMERS", "8"),
                ("VANTAGE__DATABASE__URL", "postgres://vantage/db"),
            ]),
        )
        .unwrap();
        assert_eq!(s.worker.consumers, 16);
        assert_eq!(s.database.url.unwrap().expose(), "postgres://flag/db");
    }

    #[test]
    fn no_url_anywhere_stays_none() {
        let f = file("");
        let s = Settings::load_with_env(&opts(&f), &env(&[("PGHOST", "db")])).unwrap();
        assert_eq!(s.database.url, None);
    }

    #[test]
    fn missing_explicit_file_is_an_error() {
        let o = LoadOptions {
            config_path: Some("/nonexistent/vantage.toml".into()),
            ..LoadOptions::default()
        };
        let e = Settings::load_with_env(&o, &env(&[])).unwrap_err();
        assert!(matches!(e, ConfigError::FileNotFound { .. }), "{e}");
        assert!(e.to_string().contains("/nonexistent/vantage.toml"));
    }

    #[test]
    fn attempts_off_and_numbers_from_every_layer() {
        let s =
            Settings::from_toml_str("[worker]\nmax_perspective_event_attempts = \"off\"").unwrap();
        assert_eq!(s.worker.max_perspective_event_attempts, None);
        let s = Settings::from_toml_str("[worker]\nmax_perspective_event_attempts = 3").unwrap();
        assert_eq!(s.worker.max_perspective_event_attempts, Some(3));

        let f = file("");
        for (raw, want) in [
            ("off", None),
            ("OFF", None),
            ("10", Some(10)),
            ("1", Some(1)),
        ] {
            let s = Settings::load_with_env(
                &opts(&f),
                &env(&[("VANTAGE__WORKER__MAX_PERSPECTIVE_EVENT_ATTEMPTS", raw)]),
            )
            .unwrap();
            assert_eq!(s.worker.max_perspective_event_attempts, want, "{raw}");
        }
        for bad in ["0", "-1", "never", "1.5"] {
            let e = Settings::load_with_env(
                &opts(&f),
                &env(&[("VANTAGE__WORKER__MAX_PERSPECTIVE_EVENT_ATTEMPTS", bad)]),
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("worker.max_perspective_event_attempts")
                    && e.contains("VANTAGE__WORKER__MAX_PERSPECTIVE_EVENT_ATTEMPTS"),
                "{e}"
            );
        }
        assert!(err("[worker]\nmax_perspective_event_attempts = 0")
            .contains("expected a positive integer or \"off\""));
    }

    #[test]
    fn bad_values_name_their_key() {
        assert_eq!(ConfigError::EXIT_CODE, 78);
        let f = file("");
        let e = Settings::load_with_env(&opts(&f), &env(&[("VANTAGE__WORKER__CONSUMERS", "abc")]))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "invalid configuration: worker.consumers = \"abc\" (from VANTAGE__WORKER__CONSUMERS): expected a positive integer"
        );

        assert_eq!(
            err("[worker]\nconsumers = \"abc\""),
            "invalid configuration: worker.consumers = \"abc\": expected a positive integer"
        );

        let cases = [
            ("[worker]\nconsumers = 0", "worker.consumers = 0"),
            ("[worker]\nbatch_size = 0", "worker.batch_size = 0"),
            (
                "[worker]\nmax_streams_per_claim = -3",
                "worker.max_streams_per_claim = -3",
            ),
            ("[worker]\nconsumers = 1.5", "worker.consumers = 1.5"),
            ("[worker]\nlease = \"500ms\"", "worker.lease = \"500ms\""),
            ("[worker]\nlease = 60", "worker.lease = 60"),
            (
                "[worker]\npoll_interval = \"soon\"",
                "worker.poll_interval = \"soon\"",
            ),
            (
                "[worker]\nretry_backoff_base = \"10m\"",
                "worker.retry_backoff_base = \"10m\"",
            ),
            (
                "[orphans]\nstale_after = \"10s\"",
                "orphans.stale_after = \"10s\"",
            ),
            ("[cooldown]\nmax_entries = 0", "cooldown.max_entries = 0"),
            (
                "[cooldown]\nenabled = \"yes\"",
                "cooldown.enabled = \"yes\"",
            ),
            (
                "[database]\nschema = \"Vantage\"",
                "database.schema = \"Vantage\"",
            ),
            (
                "[database]\nschema = \"1abc\"",
                "database.schema = \"1abc\"",
            ),
            (
                "[database]\nschema = \"a;drop\"",
                "database.schema = \"a;drop\"",
            ),
            (
                "[database]\nurl = \"mysql://h/db\"",
                "database.url = \"mysql://h/db\"",
            ),
            (
                "[http]\nlisten = \"localhost\"",
                "http.listen = \"localhost\"",
            ),
            ("[log]\nformat = \"xml\"", "log.format = \"xml\""),
            ("[log]\nlevel = \"inof\"", "log.level = \"inof\""),
            ("worker = 3", "worker = 3"),
            ("perspectives = 3", "perspectives = 3"),
        ];
        for (toml, want) in cases {
            let e = err(toml);
            assert!(e.starts_with("invalid configuration: "), "{e}");
            assert!(e.contains(want), "{toml:?} gave {e}");
        }
        let long = format!("[database]\nschema = \"{}\"", "a".repeat(64));
        assert!(err(&long).contains("database.schema"));
        assert!(
            Settings::from_toml_str(&format!("[database]\nschema = \"{}\"", "a".repeat(63)))
                .is_ok()
        );
        // A disabled cache may have any size.
        assert!(Settings::from_toml_str("[cooldown]\nenabled = false\nmax_entries = 0").is_ok());
        // Directives are left to the logger.
        assert!(Settings::from_toml_str("[log]\nlevel = \"info,vantage=debug\"").is_ok());
    }

    #[test]
    fn unknown_keys_are_errors() {
        let e = err("[worker]\nconsumer = 3");
        assert!(
            e.contains("unknown key worker.consumer") && e.contains("consumers"),
            "{e}"
        );
        assert!(err("[workers]\nconsumers = 3").contains("unknown key workers"));
        assert!(
            err("[[perspectives]]\nname = \"a\"\nevents = [\"*\"]\ntable = \"x\"")
                .contains("unknown key perspectives[0].table")
        );

        let f = file("");
        let e = Settings::load_with_env(&opts(&f), &env(&[("VANTAGE__WORKER__CONSUMER", "3")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("worker.consumer") && e.contains("VANTAGE__WORKER__CONSUMER"),
            "{e}"
        );

        let e =
            Settings::load_with_env(&opts(&f), &env(&[("VANTAGE__PERSPECTIVES__0__NAME", "x")]))
                .unwrap_err()
                .to_string();
        assert!(e.contains("only be configured in the file"), "{e}");

        let o = LoadOptions {
            overrides: vec![("worker.nope".into(), "1".into())],
            ..opts(&f)
        };
        let e = Settings::load_with_env(&o, &env(&[]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown key worker.nope (from an override)"),
            "{e}"
        );
    }

    #[test]
    fn perspective_rules() {
        let base = "[[perspectives]]\nname = \"p\"\n";
        let e = err(&format!(
            "{base}events = [\"A\"]\n[perspectives.sql]\nA = \"select 1\"\nB = \"select 2\""
        ));
        assert!(
            e.contains("perspectives[0].sql.B") && e.contains("not listed"),
            "{e}"
        );
        let e = err(&format!(
            "{base}events = [\"A\", \"B\"]\n[perspectives.sql]\nA = \"select 1\""
        ));
        assert!(
            e.contains("perspectives[0].sql") && e.contains("'B'"),
            "{e}"
        );
        let e = err("[[perspectives]]\nevents = [\"*\"]");
        assert!(e.contains("perspectives[0].name: missing"), "{e}");
        let e = err("[[perspectives]]\nname = \"\"\nevents = [\"*\"]");
        assert!(e.contains("perspectives[0].name = \"\""), "{e}");
        let e = err(&format!(
            "{base}events = [\"*\"]\n[[perspectives]]\nname = \"p\"\nevents = [\"*\"]"
        ));
        assert!(
            e.contains("perspectives[1].name = \"p\"") && e.contains("perspectives[0]"),
            "{e}"
        );
        let e = err(&format!("{base}events = []"));
        assert!(e.contains("perspectives[0].events"), "{e}");
        let e = err(&format!("{base}events = \"A\""));
        assert!(e.contains("perspectives[0].events = \"A\""), "{e}");
        // With "*", statements for any type are fine, and the "*" catch-all is required: an
        // event without a statement would be completed without running anything.
        assert!(Settings::from_toml_str(&format!(
            "{base}events = [\"*\"]\n[perspectives.sql]\nAnything = \"select 1\"\n\"*\" = \"select 2\""
        ))
        .is_ok());
        for toml in [
            format!("{base}events = [\"*\"]"),
            format!("{base}events = [\"*\"]\n[perspectives.sql]\nAnything = \"select 1\""),
        ] {
            assert_eq!(
                err(&toml),
                "invalid configuration: perspectives[0].sql: perspective 'p', event type '*': it \
                 subscribes to every event type but has no \"*\" statement, so events without a \
                 statement of their own would be completed without running anything (add the \
                 catch-all \"*\" = \"...\" to its [perspectives.sql])",
                "{toml}"
            );
        }
        // A "*" statement without the "*" subscription names an unlisted type.
        let e = err(&format!(
            "{base}events = [\"A\"]\n[perspectives.sql]\nA = \"select 1\"\n\"*\" = \"select 2\""
        ));
        assert!(
            e.contains("perspectives[0].sql.*") && e.contains("not listed"),
            "{e}"
        );
        // Statements that can never run are refused before any database is involved.
        let cases = [
            ("A = \"select $8\"", "perspectives[0].sql.A: perspective 'p', event type 'A': the statement uses parameter $8, but only $1 to $7 are bound"),
            ("A = \"select '$8', $7 -- $9\"", ""),
            ("A = \" /* done */ COMMIT\"", "perspectives[0].sql.A: perspective 'p', event type 'A': the statement starts with COMMIT, which ends or controls the transaction"),
            ("A = \"rollback\"", "perspectives[0].sql.A: perspective 'p', event type 'A': the statement starts with ROLLBACK"),
        ];
        for (sql, want) in cases {
            let toml = format!("{base}events = [\"A\"]\n[perspectives.sql]\n{sql}");
            if want.is_empty() {
                assert!(Settings::from_toml_str(&toml).is_ok(), "{toml}");
            } else {
                let e = err(&toml);
                assert!(
                    e.starts_with(&format!("invalid configuration: {want}")),
                    "{toml}: {e}"
                );
            }
        }
        let e = err(&format!(
            "{base}events = [\"A\"]\nreset = \"delete from t where id = $1\"\n[perspectives.sql]\nA = \"select 1\""
        ));
        assert!(
            e.starts_with("invalid configuration: perspectives[0].reset: perspective 'p', reset statement: the statement uses parameter $1, but reset runs with no parameters bound"),
            "{e}"
        );
        let e = err(&format!(
            "{base}events = [\"A\"]\nreset = \"COMMIT\"\n[perspectives.sql]\nA = \"select 1\""
        ));
        assert!(
            e.contains("perspectives[0].reset") && e.contains("COMMIT"),
            "{e}"
        );
        // Event types keep their case and may contain dots.
        let s = Settings::from_toml_str(&format!(
            "{base}events = [\"Orders.Placed\"]\n[perspectives.sql]\n\"Orders.Placed\" = \"select 1\""
        ))
        .unwrap();
        assert!(s.perspectives[0].sql.contains_key("Orders.Placed"));
    }

    #[test]
    fn redacted_toml_hides_the_password_and_round_trips() {
        let s = Settings::from_toml_str(&format!(
            r#"
            [database]
            url = "{SECRET_URL}"
            [worker]
            max_perspective_event_attempts = "off"
            retry_backoff_max = "1m 30s 250ms"
            [[perspectives]]
            name = "order_summary"
            events = ["OrderPlaced", "Odd \"type\"\n"]
            reset = "TRUNCATE order_summary"
            [perspectives.sql]
            OrderPlaced = "INSERT INTO t VALUES ($1->>'id')"
            "Odd \"type\"\n" = "SELECT '\\'"
            "#
        ))
        .unwrap();
        let out = s.redacted_toml();
        assert!(!out.contains("secret"), "{out}");
        assert!(out.contains("url = \"postgres://u:***@h/db\""), "{out}");

        let back = Settings::from_toml_str(&out).unwrap();
        assert_eq!(
            back.database.url.as_ref().unwrap().expose(),
            "postgres://u:***@h/db"
        );
        let mut expected = s.clone();
        expected.database.url = back.database.url.clone();
        assert_eq!(back, expected);

        let defaults = Settings::default().redacted_toml();
        assert!(defaults.contains("# url is not set"));
        assert_eq!(
            Settings::from_toml_str(&defaults).unwrap(),
            Settings::default()
        );
    }

    #[test]
    fn password_never_shows_in_debug_or_errors() {
        let s = Settings::from_toml_str(&format!("[database]\nurl = \"{SECRET_URL}\"")).unwrap();
        let url = s.database.url.clone().unwrap();
        assert_eq!(url.expose(), SECRET_URL);
        assert!(!format!("{s:?}").contains("secret"));
        assert!(!format!("{s:#?}").contains("secret"));
        assert!(!url.to_string().contains("secret"));

        let q = DatabaseUrl::new("postgres://h/db?sslmode=require&password=secret");
        assert!(!q.redacted().contains("secret") && q.redacted().contains("sslmode=require"));
        assert!(!DatabaseUrl::new("host=h password=secret")
            .to_string()
            .contains("secret"));

        // A TOML syntax error would echo the line; the message must not.
        let e = err(&format!("[database]\nurl = {SECRET_URL}\n"));
        assert!(e.contains("line 2") && !e.contains("secret"), "{e}");
        // A bad URL is shown redacted.
        let e = err("[database]\nurl = \"mysql://u:secret@h/db\"");
        assert!(e.contains("database.url") && !e.contains("secret"), "{e}");
        let e = err("[database]\nurl = \"not a url secret\"");
        assert!(e.contains("database.url") && !e.contains("secret"), "{e}");
        // Pasted under the wrong key, still scrubbed.
        let e = err(&format!("[database]\nschema = \"{SECRET_URL}\""));
        assert!(
            e.contains("database.schema") && !e.contains("secret"),
            "{e}"
        );
        let f = file("");
        let e = Settings::load_with_env(
            &opts(&f),
            &env(&[("DATABASE_URL", "mysql://u:secret@h/db")]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("(from DATABASE_URL)") && !e.contains("secret"),
            "{e}"
        );
    }

    #[test]
    fn scrub_secrets_handles_free_text() {
        assert_eq!(
            scrub_secrets("see postgres://a:b@c/d and x://e@f, password=hunter2&x=1"),
            "see postgres://a:***@c/d and x://e@f, password=***&x=1"
        );
    }
}
