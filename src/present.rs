//! Presentation helpers shared by the operator's two surfaces, the CLI and the console: ages,
//! timestamps, shortened text and JSON with sorted keys. Both show the same facts the same
//! way; neither depends on the other for it.

use serde_json::{Map, Value};

/// Rebuilds every object with its keys in sorted order. serde_json's map is sorted by default,
/// but a dependency enabling `preserve_order` would silently change that; this does not.
pub fn sort_keys(value: Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, sort_keys(v)))
                    .collect::<Map<String, Value>>(),
            )
        }
        Value::Array(items) => Value::Array(items.into_iter().map(sort_keys).collect()),
        other => other,
    }
}

/// An age for people: the two largest units, e.g. `3m 12s`, `2h 5m`, `4d 1h`, `0s`.
pub fn human_age(seconds: f64) -> String {
    let total = if seconds.is_finite() && seconds > 0.0 {
        seconds as u64
    } else {
        0
    };
    let units = [(86_400, "d"), (3_600, "h"), (60, "m"), (1, "s")];
    let mut parts = Vec::new();
    let mut rest = total;
    for (size, name) in units {
        let n = rest / size;
        rest %= size;
        if n > 0 || (!parts.is_empty() && parts.len() < 2) {
            parts.push(format!("{n}{name}"));
        }
        if parts.len() == 2 {
            break;
        }
    }
    if parts.is_empty() {
        "0s".to_owned()
    } else {
        parts.join(" ")
    }
}

/// The first `max` characters of `text`, with `…` when cut.
pub fn shorten(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}

/// A timestamp for people and envelopes: RFC 3339, UTC, milliseconds.
pub fn timestamp(at: &chrono::DateTime<chrono::Utc>) -> String {
    at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_show_two_units() {
        assert_eq!(human_age(0.0), "0s");
        assert_eq!(human_age(-3.0), "0s");
        assert_eq!(human_age(f64::NAN), "0s");
        assert_eq!(human_age(45.9), "45s");
        assert_eq!(human_age(192.0), "3m 12s");
        assert_eq!(human_age(3600.0), "1h 0m");
        assert_eq!(human_age(3600.0 * 2.0 + 300.0 + 7.0), "2h 5m");
        assert_eq!(human_age(86_400.0 * 4.0 + 3_600.0), "4d 1h");
    }
}
