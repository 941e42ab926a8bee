//! The demo's configuration: perspectives, worker timings and log level from
//! `config/demo.toml` (or the copy built into the binary); the database and HTTP settings from
//! the usual layers (flags, environment, configuration file); the read model tables from
//! `config/demo.sql`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::sample::EVENT_TYPES;
use crate::cli::GlobalArgs;
use crate::config::{HttpSettings, Settings};

/// Where the demo configuration is looked for, relative to the working directory.
pub const DEMO_CONFIG_PATH: &str = "config/demo.toml";
/// The copy built into the binary, used when [`DEMO_CONFIG_PATH`] is not there.
pub(super) const EMBEDDED_CONFIG: &str = include_str!("../../../config/demo.toml");

/// The read model tables the perspectives of `config/demo.toml` write. Idempotent, so the demo
/// can run again on the same database.
pub(super) const READ_MODEL_DDL: &str = include_str!("../../../config/demo.sql");

/// Where the database of the demo comes from (decides how the printed commands reach it).
#[derive(Debug, Clone)]
pub(super) enum DatabaseSource {
    /// `--database-url`.
    Flag,
    /// `DATABASE_URL` or `VANTAGE__DATABASE__URL`: the printed commands inherit it.
    Environment,
    /// A configuration file.
    File,
    /// The throwaway server, at this URL (no password: `trust` authentication).
    Throwaway(String),
}

pub(super) struct DemoConfig {
    pub(super) settings: Settings,
    /// The demo configuration file, when it was read from disk (not the built-in copy).
    pub(super) file: Option<PathBuf>,
    pub(super) database: DatabaseSource,
}

impl DemoConfig {
    /// The demo's perspectives, worker timings and log level from `config/demo.toml`; the
    /// database and HTTP settings from the usual layers (flags, environment, config file).
    pub(super) fn load(global: &GlobalArgs) -> Result<DemoConfig, String> {
        let base = global.load_settings().map_err(|e| e.to_string())?;
        let path = Path::new(DEMO_CONFIG_PATH);
        let (text, file) = if path.is_file() {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            (text, Some(path.to_path_buf()))
        } else {
            (EMBEDDED_CONFIG.to_owned(), None)
        };
        let label = match &file {
            Some(p) => p.display().to_string(),
            None => format!("{DEMO_CONFIG_PATH} (built-in copy)"),
        };
        let mut settings = Settings::from_toml_str(&text).map_err(|e| format!("{label}: {e}"))?;
        if settings.perspectives.is_empty() {
            return Err(format!("{label}: defines no [[perspectives]]"));
        }
        if settings.worker.max_perspective_event_attempts.is_none() {
            return Err(format!(
                "{label}: worker.max_perspective_event_attempts = \"off\" would retry the \
                 demo's poison events forever; set a number"
            ));
        }

        let url = base.database.url.clone().or(settings.database.url.take());
        settings.database = base.database;
        settings.database.url = url;
        if base.http != HttpSettings::default() {
            settings.http = base.http;
        }

        let from_env = ["DATABASE_URL", "VANTAGE__DATABASE__URL"]
            .iter()
            .any(|v| std::env::var(v).is_ok_and(|s| !s.is_empty()));
        let database = if global.database_url.is_some() {
            DatabaseSource::Flag
        } else if from_env {
            DatabaseSource::Environment
        } else {
            DatabaseSource::File
        };
        Ok(DemoConfig {
            settings,
            file,
            database,
        })
    }

    pub(super) fn perspective_names(&self) -> Vec<String> {
        self.settings
            .perspectives
            .iter()
            .map(|p| p.name.clone())
            .collect()
    }

    /// How many perspectives each event type fans out to.
    pub(super) fn fan_out(&self) -> HashMap<String, u64> {
        let mut fan_out = HashMap::new();
        for event_type in EVENT_TYPES {
            let n = self
                .settings
                .perspectives
                .iter()
                .filter(|p| p.events.iter().any(|e| e == "*" || e == event_type))
                .count() as u64;
            fan_out.insert((*event_type).to_owned(), n);
        }
        fan_out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_configuration_is_valid() {
        let s = Settings::from_toml_str(EMBEDDED_CONFIG).expect("config/demo.toml parses");
        let names: Vec<&str> = s.perspectives.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            ["order_summary", "revenue_by_day", "customer_orders"]
        );
        assert_eq!(s.worker.max_perspective_event_attempts, Some(3));
        for p in &s.perspectives {
            for e in &p.events {
                assert!(EVENT_TYPES.contains(&e.as_str()), "{e}");
            }
        }
    }
}
