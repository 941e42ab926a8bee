//! Who may use the console: a bearer token (`console.auth_token`) or HTTP basic credentials
//! (`console.basic_user`, `console.basic_password`), compared in constant time (`subtle`).
//!
//! With neither configured the console is open: configuration only allows that on a loopback
//! address, and it answers only requests whose `Host` is a loopback name
//! ([`security::loopback_host`](super::security::loopback_host)), against DNS rebinding. With either, a request without valid credentials gets 401 and a
//! `WWW-Authenticate` challenge for each configured scheme (basic first, so a browser asks
//! for a user and password). The secrets are never logged, echoed or put in a page.
//!
//! A request that passes carries a [`ConsoleUser`] extension: the actor the action pages write
//! in the dead-letter history and the audit log.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use subtle::ConstantTimeEq;

use crate::config::{ConsoleSettings, Secret};

/// The realm of the challenges.
pub const REALM: &str = "vantage console";

/// The credentials the console accepts.
#[derive(Clone, Debug, Default)]
pub struct Credentials {
    token: Option<Secret>,
    basic: Option<(String, Secret)>,
}

/// Who made a request, as the history will name them: `console user NAME` for basic
/// credentials, `console token` for the bearer token, `console (no authentication)` on an
/// open loopback console.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsoleUser(pub String);

impl Credentials {
    /// From the `[console]` settings.
    pub fn from_settings(settings: &ConsoleSettings) -> Self {
        Credentials {
            token: settings.token().cloned(),
            basic: settings
                .basic_user
                .clone()
                .zip(settings.password().cloned()),
        }
    }

    /// Whether any credentials are required.
    pub fn required(&self) -> bool {
        self.token.is_some() || self.basic.is_some()
    }

    /// Who presents this `Authorization` header value, if it is valid.
    pub fn check(&self, authorization: Option<&[u8]>) -> Option<ConsoleUser> {
        if !self.required() {
            return Some(ConsoleUser("console (no authentication)".to_owned()));
        }
        let value = authorization?;
        let (scheme, rest) = split_scheme(value)?;
        if scheme.eq_ignore_ascii_case(b"bearer") {
            let token = self.token.as_ref()?;
            return same_secret(rest, token.expose().as_bytes())
                .then(|| ConsoleUser("console token".to_owned()));
        }
        if scheme.eq_ignore_ascii_case(b"basic") {
            let (user, password) = self.basic.as_ref()?;
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(rest)
                .ok()?;
            let (given_user, given_password) = split_once(&decoded, b':')?;
            // Both compared, always, so the time taken says nothing about which one differed.
            let user_ok = same_secret(given_user, user.as_bytes());
            let password_ok = same_secret(given_password, password.expose().as_bytes());
            return (user_ok & password_ok).then(|| ConsoleUser(format!("console user {user}")));
        }
        None
    }

    /// The `WWW-Authenticate` values of a 401: one per configured scheme.
    pub fn challenges(&self) -> Vec<HeaderValue> {
        let mut out = Vec::new();
        if self.basic.is_some() {
            out.push(HeaderValue::from_static(
                "Basic realm=\"vantage console\", charset=\"UTF-8\"",
            ));
        }
        if self.token.is_some() {
            out.push(HeaderValue::from_static("Bearer realm=\"vantage console\""));
        }
        out
    }
}

/// `Scheme credentials` → (scheme, credentials without surrounding spaces).
fn split_scheme(value: &[u8]) -> Option<(&[u8], &[u8])> {
    let (scheme, rest) = split_once(value, b' ')?;
    Some((scheme, rest.trim_ascii()))
}

fn split_once(bytes: &[u8], at: u8) -> Option<(&[u8], &[u8])> {
    let i = bytes.iter().position(|&b| b == at)?;
    Some((&bytes[..i], &bytes[i + 1..]))
}

/// The middleware: 401 with the challenges unless the request carries valid credentials.
/// It is given the credentials alone, not the console's state, so authentication does not
/// depend on the module that wires it in.
pub async fn require(
    State(credentials): State<Arc<Credentials>>,
    mut request: Request,
    next: Next,
) -> Response {
    if !credentials.required() {
        let host = request
            .headers()
            .get(header::HOST)
            .map(HeaderValue::as_bytes);
        if host.is_some_and(|h| !super::security::loopback_host(h)) {
            return (
                StatusCode::FORBIDDEN,
                super::error::page(
                    StatusCode::FORBIDDEN,
                    "Unknown host name",
                    "Without credentials configured this console answers only to localhost, 127.0.0.1 or [::1] (another name pointing here could be a DNS rebinding attack). Open it by one of those, or configure console.auth_token.",
                ),
            )
                .into_response();
        }
    }
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    match credentials.check(given) {
        Some(user) => {
            request.extensions_mut().insert(user);
            next.run(request).await
        }
        None => {
            let mut response = (
                StatusCode::UNAUTHORIZED,
                super::error::page(
                    StatusCode::UNAUTHORIZED,
                    "Authentication required",
                    "This console needs credentials: the bearer token of console.auth_token, or the user and password of console.basic_user and console.basic_password.",
                ),
            )
                .into_response();
            for challenge in credentials.challenges() {
                response
                    .headers_mut()
                    .append(header::WWW_AUTHENTICATE, challenge);
            }
            response
        }
    }
}

/// Whether `given` equals `secret`, in time that depends on neither where they differ nor
/// whether their lengths do: both are reduced to fixed-length keyed digests (two SipHash
/// digests under random per-process keys, 128 bits), which are compared in constant time.
/// (`subtle`'s slice comparison returns at once on a length mismatch, which tells a prober
/// the secret's length.)
fn same_secret(given: &[u8], secret: &[u8]) -> bool {
    use std::hash::BuildHasher as _;
    static KEYS: std::sync::OnceLock<[std::collections::hash_map::RandomState; 2]> =
        std::sync::OnceLock::new();
    let keys = KEYS.get_or_init(Default::default);
    let digest = |bytes: &[u8]| {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&keys[0].hash_one(bytes).to_le_bytes());
        out[8..].copy_from_slice(&keys[1].hash_one(bytes).to_le_bytes());
        out
    };
    bool::from(digest(given).ct_eq(&digest(secret)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(token: Option<&str>, basic: Option<(&str, &str)>) -> Credentials {
        Credentials {
            token: token.map(Secret::new),
            basic: basic.map(|(u, p)| (u.to_owned(), Secret::new(p))),
        }
    }

    fn basic(user_password: &str) -> Vec<u8> {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(user_password)
        )
        .into_bytes()
    }

    #[test]
    fn open_without_credentials_configured() {
        assert!(creds(None, None).check(None).is_some());
    }

    #[test]
    fn bearer_token_must_match_exactly() {
        let c = creds(Some("s3cret-token"), None);
        assert_eq!(
            c.check(Some(b"Bearer s3cret-token")),
            Some(ConsoleUser("console token".into()))
        );
        assert!(c.check(Some(b"bearer s3cret-token")).is_some());
        assert!(c.check(Some(b"Bearer s3cret-toke")).is_none());
        assert!(c.check(Some(b"Bearer s3cret-tokenX")).is_none());
        assert!(c.check(Some(b"Bearer")).is_none());
        assert!(c.check(None).is_none());
        assert!(c.check(Some(&basic("a:s3cret-token"))).is_none());
    }

    #[test]
    fn basic_credentials_need_both_parts() {
        let c = creds(None, Some(("ops", "pa:ss")));
        assert_eq!(
            c.check(Some(&basic("ops:pa:ss"))),
            Some(ConsoleUser("console user ops".into()))
        );
        assert!(c.check(Some(&basic("ops:pa"))).is_none());
        assert!(c.check(Some(&basic("op:pa:ss"))).is_none());
        assert!(c.check(Some(b"Basic !!notbase64")).is_none());
        assert!(c.check(Some(b"Bearer pa:ss")).is_none());
        assert_eq!(c.challenges().len(), 1);
    }
}

#[cfg(test)]
mod fixed_length_tests {
    //! Issue 19, defect 13: secrets are compared as fixed-length digests.
    use super::same_secret;

    #[test]
    fn secrets_compare_by_content_whatever_their_lengths() {
        assert!(same_secret(b"Hunter2-token", b"Hunter2-token"));
        assert!(!same_secret(b"Hunter2-token", b"Hunter2-tokem"));
        assert!(!same_secret(b"Hunter2", b"Hunter2-token"));
        assert!(!same_secret(b"", b"x"));
        assert!(same_secret(b"", b""));
    }
}
