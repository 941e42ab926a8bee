//! Keeping the database password out of everything vantage prints: the URL type whose
//! `Debug`, `Display` and `Serialize` hide it, the scrubber for messages that quote user input,
//! and the redacted TOML of `vantage config check`.

use std::fmt;

use serde::{Serialize, Serializer};

use super::database::{with_host, NO_HOST};
use super::sections::Settings;

/// A database URL whose `Debug`, `Display` and `Serialize` hide the password, so it cannot be
/// logged or printed by accident. [`expose`](Self::expose) returns the real string for the
/// connection only.
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
        // libpq's empty host (`postgres://u:pw@/db?host=/dir`) is parsed with a placeholder.
        let (text, placeholder) = with_host(&self.0);
        let Ok(mut url) = url::Url::parse(&text) else {
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
        let out = url.to_string();
        if placeholder {
            out.replacen(NO_HOST, "", 1)
        } else {
            out
        }
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

/// Always the redacted form: serializing settings can never write the password.
impl Serialize for DatabaseUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.redacted())
    }
}

/// The effective configuration as TOML, password redacted (see [`Settings::redacted_toml`]).
pub(super) fn redacted_toml(settings: &Settings) -> String {
    let mut out = toml::to_string(settings)
        .expect("settings always serialize: every field is a string, number, bool, list or table");
    if settings.database.url.is_none() {
        const NOTE: &str =
            "# url is not set: the connection comes from libpq's PG* environment variables\n";
        let at = out
            .find("[database]\n")
            .map_or(0, |i| i + "[database]\n".len());
        out.insert_str(at, NOTE);
    }
    out
}

/// Replaces the password of anything that looks like `scheme://user:password@host` and any
/// `password=value` in free text. Used on messages that quote user input.
pub(super) fn scrub_secrets(text: &str) -> String {
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
