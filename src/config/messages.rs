//! From a failure to the message an operator can act on: `key = value (from layer): expected …`,
//! the value shown as it was written (strings quoted, the URL redacted) and the layer that set
//! it, which every merged value carries as its origin.

use config::{Map, Value, ValueKind};
use serde_path_to_error::Segment;

use super::error::ConfigError;
use super::secret::{scrub_secrets, DatabaseUrl, REDACTED, SECRET_KEYS};
use super::values::EXPECTED;

/// The merged layers, kept beside the settings so that messages can quote them.
pub(super) struct Written {
    /// The merged tree.
    pub root: Map<String, Value>,
    /// The origin of a key no layer set: `the defaults` when layers were loaded, nothing for a
    /// single text (whose errors need not say where a value came from).
    pub defaults: Option<&'static str>,
}

/// One step down the tree.
enum Step<'a> {
    Key(&'a str),
    Index(usize),
}

fn dotted(steps: &[Step<'_>]) -> String {
    let mut key = String::new();
    for step in steps {
        match step {
            Step::Key(k) if key.is_empty() => key.push_str(k),
            Step::Key(k) => {
                key.push('.');
                key.push_str(k);
            }
            Step::Index(i) => key.push_str(&format!("[{i}]")),
        }
    }
    key
}

/// `perspectives[1].name` → `perspectives`, `[1]`, `name` (keys with dots are not looked up).
fn steps_of(key: &str) -> Vec<Step<'_>> {
    let mut steps = Vec::new();
    for part in key.split('.') {
        let (name, rest) = part.split_once('[').unwrap_or((part, ""));
        steps.push(Step::Key(name));
        for index in rest.split('[') {
            if let Ok(i) = index.trim_end_matches(']').parse() {
                steps.push(Step::Index(i));
            }
        }
    }
    steps
}

impl Written {
    fn find(&self, steps: &[Step<'_>]) -> Option<&Value> {
        let (Step::Key(first), rest) = steps.split_first()? else {
            return None;
        };
        let mut value = self.root.get(*first)?;
        for step in rest {
            value = match (step, &value.kind) {
                (Step::Key(k), ValueKind::Table(t)) => t.get(*k)?,
                (Step::Index(i), ValueKind::Array(a)) => a.get(*i)?,
                _ => return None,
            };
        }
        Some(value)
    }

    /// The value at a dotted key, if a layer set it.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.find(&steps_of(key))
    }

    fn origin(&self, value: Option<&Value>) -> Option<String> {
        match value {
            Some(v) => layer_of(v),
            None => self.defaults.map(str::to_owned),
        }
    }

    /// `key` is wrong: shows it as written (or `effective`, when no layer set it) and names
    /// the layer.
    pub fn invalid(
        &self,
        key: &str,
        effective: String,
        expected: impl Into<String>,
    ) -> ConfigError {
        let value = self.get(key);
        ConfigError::InvalidValue {
            key: key.to_owned(),
            value: value.map_or(effective, |v| render(key, v)),
            origin: self.origin(value),
            expected: expected.into(),
        }
    }

    /// What serde could not deserialize, as a message about the key it was at.
    pub fn explain(&self, e: serde_path_to_error::Error<config::ConfigError>) -> ConfigError {
        let steps: Vec<Step<'_>> = e
            .path()
            .iter()
            .filter_map(|segment| match segment {
                Segment::Map { key } => Some(Step::Key(key.as_str())),
                Segment::Seq { index } => Some(Step::Index(*index)),
                _ => None,
            })
            .collect();
        let key = dotted(&steps);
        let value = self.find(&steps);
        let mut inner = e.inner();
        while let config::ConfigError::At { error, .. } = inner {
            inner = error;
        }
        if let config::ConfigError::NotFound(field) = inner {
            // The `config` crate prefixes the field with its parents; the path has them.
            let field = field.rsplit(['.', ']']).next().unwrap_or(field);
            return ConfigError::Invalid {
                key: format!("{key}.{field}"),
                message: "missing".to_owned(),
            };
        }
        let message = inner.to_string();
        let expected = if let Some(expected) = message.strip_prefix(EXPECTED) {
            expected.to_owned()
        } else if message.starts_with("unknown field `") {
            let known = message
                .split_once(", expected ")
                .map_or("", |(_, known)| known);
            return ConfigError::UnknownKey {
                key,
                origin: self.origin(value),
                expected: known
                    .strip_prefix("one of ")
                    .unwrap_or(known)
                    .replace('`', ""),
            };
        } else {
            // A table or a list where the other belongs.
            match steps.as_slice() {
                [Step::Key("perspectives")] | [Step::Key("perspectives"), Step::Index(_)] => {
                    "a list of tables ([[perspectives]])".to_owned()
                }
                [Step::Key("slo")] | [Step::Key("slo"), Step::Index(_)] => {
                    "a list of tables ([[slo]])".to_owned()
                }
                [Step::Key(_)] | [.., Step::Key("sql")] => "a table".to_owned(),
                _ => scrub_secrets(&message),
            }
        };
        ConfigError::InvalidValue {
            value: value.map_or_else(|| "nothing".to_owned(), |v| render(&key, v)),
            origin: self.origin(value),
            key,
            expected,
        }
    }
}

/// The layer of a value. A table the merge built has no origin of its own: its first value's.
fn layer_of(v: &Value) -> Option<String> {
    if let Some(origin) = v.origin() {
        return Some(origin.to_owned());
    }
    match &v.kind {
        ValueKind::Table(t) => t.values().find_map(layer_of),
        ValueKind::Array(a) => a.iter().find_map(layer_of),
        _ => None,
    }
}

/// How a bad value is shown in an error: strings quoted, the database URL redacted, and
/// anything URL-like scrubbed in case a secret was pasted under the wrong key.
pub(super) fn render(key: &str, v: &Value) -> String {
    if SECRET_KEYS.contains(&key) {
        return REDACTED.to_owned();
    }
    match &v.kind {
        ValueKind::String(s) if key == "database.url" => {
            quote(&DatabaseUrl::new(s.as_str()).redacted())
        }
        // `user:password` pasted into the user key: mask after the first ':'.
        ValueKind::String(s) if key == "console.basic_user" => match s.split_once(':') {
            Some((user, _)) => quote(&format!("{user}:***")),
            None => quote(&scrub_secrets(s)),
        },
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

pub(super) fn quote(s: &str) -> String {
    format!("{s:?}")
}
