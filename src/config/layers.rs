//! The layers, merged by the `config` crate: defaults (serde's, on deserialization) < the TOML
//! file < `DATABASE_URL` < `VANTAGE__SECTION__KEY` (`config::Environment` with `__`) <
//! overrides < `--database-url`. Every value carries the layer it came from as its origin, so a
//! message can name it.

use std::collections::HashMap;
use std::fmt;

use config::{Map, Source, Value, ValueKind};
use serde::de::{self, Deserialize, Deserializer};
use toml::de::{DeTable, DeValue};

use super::console::ConsoleSettings;
use super::error::ConfigError;
use super::options::LoadOptions;
use super::secret::scrub_secrets;
use super::sections::{
    CooldownSettings, DatabaseSettings, HttpSettings, LogSettings, OrphanSettings,
    TelemetrySettings, WorkerSettings,
};
use crate::connection::PG_VARS;

/// Environment variables `VANTAGE__SECTION__KEY` set `section.key`.
const ENV_PREFIX: &str = "VANTAGE";
const ENV_SEPARATOR: &str = "__";
/// Honoured for `database.url`, below `VANTAGE__DATABASE__URL`.
pub(super) const DATABASE_URL_VAR: &str = "DATABASE_URL";

/// Reads and merges every layer above the defaults.
pub(super) fn merge(
    opts: &LoadOptions,
    env: &HashMap<String, String>,
) -> Result<Map<String, Value>, ConfigError> {
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
        builder = builder.add_source(Layer(parse_toml(&text, &label, Some(&label))?));
    }

    if let Some(url) = env.get(DATABASE_URL_VAR).filter(|v| !v.is_empty()) {
        builder = builder.add_source(Layer(Map::from_iter([(
            "database.url".to_owned(),
            Value::new(Some(&DATABASE_URL_VAR.to_owned()), url.as_str()),
        )])));
    }

    builder = builder.add_source(Layer(environment_layer(env)?));

    let mut overrides = Map::new();
    let override_origin = "an override".to_owned();
    for (key, value) in &opts.overrides {
        check_settable(key, &override_origin)?;
        overrides.insert(
            key.clone(),
            Value::new(Some(&override_origin), value.as_str()),
        );
    }
    if let Some(url) = &opts.database_url {
        overrides.insert(
            "database.url".to_owned(),
            Value::new(Some(&"--database-url".to_owned()), url.as_str()),
        );
    }
    builder = builder.add_source(Layer(overrides));

    let merged = builder.build().map_err(ConfigError::other)?;
    merged.collect().map_err(ConfigError::other)
}

/// The `VANTAGE__*`, `DATABASE_URL` and checked `PG*` variables of the process. Others are
/// not read, so an unrelated non-UTF-8 variable cannot fail the load.
pub(super) fn process_env() -> Result<HashMap<String, String>, ConfigError> {
    let prefix = format!("{ENV_PREFIX}{ENV_SEPARATOR}");
    let mut env = HashMap::new();
    for (name, value) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        if name == DATABASE_URL_VAR
            || PG_VARS.contains(&name)
            || name.to_ascii_uppercase().starts_with(&prefix)
        {
            let value = value.into_string().map_err(|_| ConfigError::NotUnicode {
                var: name.to_owned(),
            })?;
            env.insert(name.to_owned(), value);
        }
    }
    Ok(env)
}

/// The `VANTAGE__SECTION__KEY` layer, keys checked, each value's origin its variable. Values
/// stay strings (no `try_parsing`): each key's parser accepts the string spelling, so `"off"`,
/// `"10"` or a numeric schema are read as the key expects rather than as what they look like.
fn environment_layer(env: &HashMap<String, String>) -> Result<Map<String, Value>, ConfigError> {
    let source: Map<String, String> = env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let layer = config::Environment::with_prefix(ENV_PREFIX)
        .prefix_separator(ENV_SEPARATOR)
        .separator(ENV_SEPARATOR)
        .ignore_empty(true)
        .try_parsing(false)
        .source(Some(source))
        .collect()
        .map_err(ConfigError::other)?;
    let mut keys: Vec<_> = layer.into_iter().collect();
    keys.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = Map::new();
    for (key, value) in keys {
        let var = format!(
            "{ENV_PREFIX}{ENV_SEPARATOR}{}",
            key.replace('.', ENV_SEPARATOR).to_uppercase()
        );
        check_settable(&key, &var)?;
        out.insert(key, Value::new(Some(&var), value.kind));
    }
    Ok(out)
}

/// The sections environment variables and overrides can set, with their keys (serde's own
/// field lists, so they cannot drift from the structs).
fn settable() -> [(&'static str, &'static [&'static str]); 8] {
    [
        ("database", fields::<DatabaseSettings>()),
        ("worker", fields::<WorkerSettings>()),
        ("cooldown", fields::<CooldownSettings>()),
        ("orphans", fields::<OrphanSettings>()),
        ("http", fields::<HttpSettings>()),
        ("console", fields::<ConsoleSettings>()),
        ("log", fields::<LogSettings>()),
        ("telemetry", fields::<TelemetrySettings>()),
    ]
}

/// Environment variables and overrides may set `section.key` of the scalar sections only;
/// `[[perspectives]]` and `[[slo]]` come from the file alone (a list of tables has no sane
/// spelling there).
fn check_settable(key: &str, origin: &str) -> Result<(), ConfigError> {
    let mut parts = key.split('.');
    let (section, name, rest) = (parts.next(), parts.next(), parts.next());
    if let Some(list @ ("perspectives" | "slo")) = section {
        return Err(ConfigError::Invalid {
            key: key.to_owned(),
            message: format!("{list} can only be configured in the file, not from {origin}"),
        });
    }
    let sections = settable();
    let prefixed = |section: &str, keys: &[&str]| {
        keys.iter()
            .map(|k| format!("{section}.{k}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let Some(&(section, keys)) = sections.iter().find(|(s, _)| Some(*s) == section) else {
        return Err(ConfigError::UnknownKey {
            key: key.to_owned(),
            origin: Some(origin.to_owned()),
            expected: sections
                .iter()
                .map(|(s, keys)| prefixed(s, keys))
                .collect::<Vec<_>>()
                .join(", "),
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

/// The field names serde deserializes `T` from: asks `T` to deserialize from a probe that
/// records what `deserialize_struct` is given.
fn fields<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    struct Probe(&'static [&'static str]);
    impl<'de> Deserializer<'de> for &mut Probe {
        type Error = de::value::Error;
        fn deserialize_any<V: de::Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            self.0 = fields;
            Err(de::Error::custom("probed"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut probe = Probe(&[]);
    let _ = T::deserialize(&mut probe);
    probe.0
}

/// Parses TOML into a layer whose values have `origin`. Integers keep their full value (one
/// beyond `i64` is still a number, reported at its key). The parser's message echoes the
/// offending source line, which may hold a password, so only position and reason are kept.
pub(super) fn parse_toml(
    text: &str,
    label: &str,
    origin: Option<&String>,
) -> Result<Map<String, Value>, ConfigError> {
    match DeTable::parse(text) {
        Ok(table) => Ok(convert_table(table.get_ref(), origin)),
        Err(mut err) => {
            err.set_input(Some(text));
            let message = err
                .to_string()
                .lines()
                .map(str::trim)
                .filter(|line| !line.is_empty() && !is_source_echo(line))
                .collect::<Vec<_>>()
                .join("; ");
            Err(ConfigError::Syntax {
                origin: label.to_owned(),
                message: scrub_secrets(&message),
            })
        }
    }
}

fn convert_table(table: &DeTable<'_>, origin: Option<&String>) -> Map<String, Value> {
    table
        .iter()
        .map(|(k, v)| (k.get_ref().to_string(), convert(v.get_ref(), origin)))
        .collect()
}

fn convert(value: &DeValue<'_>, origin: Option<&String>) -> Value {
    let kind = match value {
        DeValue::String(s) => ValueKind::String(s.to_string()),
        DeValue::Integer(i) => match i128::from_str_radix(i.as_str(), i.radix()) {
            Ok(n) => i64::try_from(n).map_or(ValueKind::I128(n), ValueKind::I64),
            // Beyond i128: still not a string; shown as the float it approximates.
            Err(_) => ValueKind::Float(i.as_str().parse().unwrap_or(f64::INFINITY)),
        },
        DeValue::Float(f) => {
            ValueKind::Float(f.as_str().replace('_', "").parse().unwrap_or(f64::NAN))
        }
        DeValue::Boolean(b) => ValueKind::Boolean(*b),
        DeValue::Datetime(d) => ValueKind::String(d.to_string()),
        DeValue::Array(items) => {
            ValueKind::Array(items.iter().map(|v| convert(v.get_ref(), origin)).collect())
        }
        DeValue::Table(t) => ValueKind::Table(convert_table(t, origin)),
    };
    Value::new(origin, kind)
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
