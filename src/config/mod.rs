//! Settings.
//!
//! Layers, lowest to highest precedence:
//! 1. built-in defaults ([`Settings::default`], the values in docs/operations.md,
//!    "Configuration");
//! 2. the TOML file: `--config PATH`, else [`DEFAULT_CONFIG_PATH`] if it exists, else none;
//! 3. `DATABASE_URL` (for `database.url` only);
//! 4. environment variables `VANTAGE__SECTION__KEY`, e.g. `VANTAGE__WORKER__CONSUMERS=8`;
//! 5. explicit overrides (CLI flags): [`LoadOptions::overrides`], then [`LoadOptions::database_url`].
//!
//! Every layer is merged first and validated once, so a bad value is reported the same way
//! whichever layer it came from, and the message names the key, the value as written and the
//! layer it came from.
//!
//! Environment variables and overrides can set the scalar keys of the sections only;
//! `[[perspectives]]` and `[[slo]]` come from the file alone (a list of tables has no sane
//! spelling as environment variables). Unknown keys are errors everywhere, so a typo never
//! silently falls back to a default. An empty environment variable counts as unset.
//!
//! When no `database.url` is configured at all it stays `None`, and the storage layer builds
//! its connection from libpq's `PG*` environment variables (`PGHOST`, `PGPORT`, `PGUSER`,
//! `PGPASSWORD`, `PGDATABASE`, … through sqlx's `PgConnectOptions::new()`); `PGPORT` and
//! `PGSSLMODE` are checked wherever the URL leaves them to the environment.
//!
//! Only what can work is accepted: every duration is at most [`MAX_DURATION`] (the daemon
//! multiplies intervals), `worker.consumers` at most [`MAX_CONSUMERS`], `database.max_connections`
//! at least the consumers plus [`MIN_EXTRA_CONNECTIONS`], `database.connect_timeout` more than
//! zero, no system schema, a log filter the logger parses, a URL the PostgreSQL client parses.
//!
//! The database password never leaves this module in clear text except through
//! [`DatabaseUrl::expose`]: `Debug`, `Display`, `Serialize`, [`Settings::redacted_toml`] and
//! every [`ConfigError`] redact it.
//!
//! The files: `sections` (the serde structs and their defaults), `console` (the `[console]`
//! section and its rule), `secret` (what is never printed: the secret and URL types, the
//! secret keys, the scrubber), `values` (the parser of each key and the value types it
//! produces), `layers` (reading and merging), `validate` (rules across keys), `messages` (what
//! a failure says), `limits` (the bounds), `options` (where the layers come from), `error`.
//! The URL and `PG*` as the client reads them are the crate's `connection` module, shared with
//! the store. No file here reads this one: it only declares, re-exports and composes.

mod console;
mod error;
mod layers;
mod limits;
mod messages;
mod options;
mod secret;
mod sections;
mod validate;
mod values;

#[cfg(test)]
mod tests;

use std::collections::HashMap;

pub use console::ConsoleSettings;
pub use error::ConfigError;
pub use limits::{
    MAX_CONSUMERS, MAX_DURATION, MAX_SLO_WINDOW, MAX_SQL_INT, MIN_EXTRA_CONNECTIONS, MIN_SLO_WINDOW,
};
pub use options::{LoadOptions, DEFAULT_CONFIG_PATH};
pub use secret::{DatabaseUrl, Secret};
pub use sections::{
    CooldownSettings, DatabaseSettings, HttpSettings, LogSettings, OrphanSettings, OtlpProtocol,
    PerspectiveSettings, Settings, SloKind, SloSettings, TelemetrySettings, WorkerSettings,
};
pub use values::{LogFormat, Percent, QuarantineAfter};

pub(crate) use values::{decimal, otlp_endpoint_ok, OTLP_ENDPOINT};

use messages::Written;

impl Settings {
    /// Loads and validates the configuration from every layer, reading the process
    /// environment.
    pub fn load(opts: &LoadOptions) -> Result<Settings, ConfigError> {
        Self::load_with_env(opts, &layers::process_env()?)
    }

    /// Like [`load`](Self::load), but takes the environment from `env` (variable name →
    /// value) instead of the process, so tests need not mutate the global environment.
    pub fn load_with_env(
        opts: &LoadOptions,
        env: &HashMap<String, String>,
    ) -> Result<Settings, ConfigError> {
        let root = layers::merge(opts, env)?;
        build(
            Written {
                root,
                defaults: Some("the defaults"),
            },
            env,
        )
    }

    /// Defaults overlaid with `toml` only (no file lookup, no environment): for tests and
    /// embedding.
    pub fn from_toml_str(toml: &str) -> Result<Settings, ConfigError> {
        // There is only one layer, so errors need not say where a value came from.
        let root = layers::parse_toml(toml, "the configuration text", None)?;
        build(
            Written {
                root,
                defaults: None,
            },
            &HashMap::new(),
        )
    }

    /// The effective configuration as TOML, with the database password replaced by `***`
    /// (for `vantage config check`). It parses back to the same settings, password aside.
    pub fn redacted_toml(&self) -> String {
        let mut out = toml::to_string(self).expect(
            "settings always serialize: every field is a string, number, bool, list or table",
        );
        if self.database.url.is_none() {
            const NOTE: &str =
                "# url is not set: the connection comes from libpq's PG* environment variables\n";
            let at = out
                .find("[database]\n")
                .map_or(0, |i| i + "[database]\n".len());
            out.insert_str(at, NOTE);
        }
        out
    }
}

/// Deserializes the merged tree and checks it.
fn build(written: Written, env: &HashMap<String, String>) -> Result<Settings, ConfigError> {
    let tree = config::Value::new(None, config::ValueKind::Table(written.root.clone()));
    let mut settings: Settings =
        serde_path_to_error::deserialize(tree).map_err(|e| written.explain(e))?;
    // Not set: 30 s, or half the lease when the lease is shorter than a minute.
    if written.get("worker.apply_timeout").is_none() {
        let w = &mut settings.worker;
        w.apply_timeout = sections::DEFAULT_APPLY_TIMEOUT.min(w.lease / 2);
    }
    console::read_secret_files(&mut settings.console, &written)?;
    validate::settings(&settings, &written, env)?;
    Ok(settings)
}
