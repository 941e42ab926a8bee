//! Keeping secrets out of everything vantage prints, in one place: the secret type of the
//! console's credentials and the database URL type, whose `Debug`, `Display` and `Serialize`
//! hide what they hold, the keys whose values are never quoted, and the scrubber for messages
//! that quote user input. Everything else in `config` that prints reads from here; this file
//! reads nothing of theirs.

use std::fmt;

use serde::{Serialize, Serializer};

use crate::connection::{with_host, NO_HOST};

/// The keys whose values are secrets: shown as `***` by `config check` and in every message.
pub(super) const SECRET_KEYS: &[&str] = &["console.auth_token", "console.basic_password"];

/// What a secret is shown as.
pub const REDACTED: &str = "***";

/// A secret from the configuration (a token, a password). `Debug`, `Display` and `Serialize`
/// hide it; [`expose`](Self::expose) gives it to the one comparison that needs it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(secret: impl Into<String>) -> Self {
        Self(secret.into())
    }

    /// The secret itself: for the constant-time comparison of credentials and nothing else.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({REDACTED})")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

/// Always redacted: serializing settings can never write a secret.
impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(REDACTED)
    }
}

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
