//! `[console]`: where the operator console listens and who may use it (docs/cli.md, "The
//! console"), where its secrets come from, and the rule that keeps it from being reachable
//! without authentication.
//!
//! - `listen` (default `127.0.0.1:9465`);
//! - `read_only` (default false);
//! - `auth_token` (secret): a bearer token;
//! - `basic_user`, `basic_password` (secret): HTTP basic credentials, both or neither;
//! - `auth_token_file`, `basic_password_file`: the same secrets read from a file (its content,
//!   one trailing line break removed), e.g. a Kubernetes secret volume or a systemd credential;
//!   a secret comes from its key or its file, not both.
//!
//! Every key is settable from the environment like any other (`VANTAGE__CONSOLE__AUTH_TOKEN`,
//! …), so a secret can stay out of the configuration file. A secret is a [`Secret`]
//! (`secret.rs`): its `Debug`, `Display` and `Serialize` write `***`, and a message about its
//! key never quotes it.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::de::Deserializer;
use serde::{Deserialize, Serialize};

use super::error::ConfigError;
use super::messages::{quote, Written};
use super::secret::Secret;
use super::values;

/// `[console]`
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConsoleSettings {
    /// `listen` (default `127.0.0.1:9465`). Anything but a loopback address needs
    /// authentication configured.
    #[serde(deserialize_with = "values::socket_addr")]
    pub listen: SocketAddr,
    /// `read_only` (default false): the console shows, and changes nothing.
    #[serde(deserialize_with = "values::boolean")]
    pub read_only: bool,
    /// `auth_token` (secret): requests must carry `Authorization: Bearer <token>`.
    #[serde(deserialize_with = "token", skip_serializing_if = "Option::is_none")]
    pub auth_token: Option<Secret>,
    /// `basic_user`: with `basic_password`, HTTP basic credentials.
    #[serde(
        deserialize_with = "basic_user",
        skip_serializing_if = "Option::is_none"
    )]
    pub basic_user: Option<String>,
    /// `basic_password` (secret).
    #[serde(deserialize_with = "password", skip_serializing_if = "Option::is_none")]
    pub basic_password: Option<Secret>,
    /// `auth_token_file`: a file holding the bearer token (instead of `auth_token`).
    #[serde(deserialize_with = "file", skip_serializing_if = "Option::is_none")]
    pub auth_token_file: Option<PathBuf>,
    /// `basic_password_file`: a file holding the basic password (instead of `basic_password`).
    #[serde(deserialize_with = "file", skip_serializing_if = "Option::is_none")]
    pub basic_password_file: Option<PathBuf>,
    /// The token read from `auth_token_file` when settings were loaded (not a key of its own;
    /// read it through [`token`](Self::token)).
    #[serde(skip)]
    pub token_from_file: Option<Secret>,
    /// The password read from `basic_password_file` when settings were loaded (not a key of its
    /// own; read it through [`password`](Self::password)).
    #[serde(skip)]
    pub password_from_file: Option<Secret>,
}

impl Default for ConsoleSettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9465)),
            read_only: false,
            auth_token: None,
            basic_user: None,
            basic_password: None,
            auth_token_file: None,
            basic_password_file: None,
            token_from_file: None,
            password_from_file: None,
        }
    }
}

impl ConsoleSettings {
    /// Whether a bearer token or basic credentials are configured.
    pub fn authentication_configured(&self) -> bool {
        self.token().is_some() || (self.basic_user.is_some() && self.password().is_some())
    }

    /// The bearer token: `auth_token`, or what `auth_token_file` held.
    pub fn token(&self) -> Option<&Secret> {
        self.auth_token.as_ref().or(self.token_from_file.as_ref())
    }

    /// The basic password: `basic_password`, or what `basic_password_file` held.
    pub fn password(&self) -> Option<&Secret> {
        self.basic_password
            .as_ref()
            .or(self.password_from_file.as_ref())
    }
}

/// A path, not empty.
fn file<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PathBuf>, D::Error> {
    let s = values::string(d)?;
    if s.trim().is_empty() {
        return Err(values::expected("the path of a file holding the secret"));
    }
    Ok(Some(PathBuf::from(s)))
}

/// Most bytes read from a secret file (`auth_token_file`, `basic_password_file`): 64 KiB. A
/// longer file (or `/dev/zero`) is refused after reading one byte more, never read to the end.
pub const MAX_SECRET_FILE: u64 = 64 * 1024;

/// The file's text, refused past [`MAX_SECRET_FILE`] bytes.
fn read_capped(path: &std::path::Path) -> std::io::Result<String> {
    use std::io::Read as _;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_SECRET_FILE + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > MAX_SECRET_FILE {
        return Err(std::io::Error::other(format!(
            "it holds more than {} KiB, far more than any secret",
            MAX_SECRET_FILE / 1024
        )));
    }
    Ok(text)
}

/// Reads `auth_token_file` and `basic_password_file` into the settings, checking their content
/// as `auth_token` and `basic_password` are checked. A message names the file, never what it
/// holds.
pub(super) fn read_secret_files(c: &mut ConsoleSettings, w: &Written) -> Result<(), ConfigError> {
    let read = |key: &str, path: &PathBuf, check: fn(&str) -> Result<(), &'static str>| {
        let shown = quote(&path.display().to_string());
        let text = read_capped(path).map_err(|e| {
            w.invalid(
                key,
                shown.clone(),
                format!("a readable file holding the secret (reading it failed: {e})"),
            )
        })?;
        let secret = text
            .strip_suffix("\r\n")
            .or_else(|| text.strip_suffix('\n'))
            .unwrap_or(&text);
        check(secret).map_err(|why| w.invalid(key, shown, format!("a file holding {why}")))?;
        Ok(Secret::new(secret))
    };
    for (key, from_file, inline_key, inline) in [
        (
            "console.auth_token_file",
            c.auth_token_file.is_some(),
            "console.auth_token",
            c.auth_token.is_some(),
        ),
        (
            "console.basic_password_file",
            c.basic_password_file.is_some(),
            "console.basic_password",
            c.basic_password.is_some(),
        ),
    ] {
        if from_file && inline {
            return Err(ConfigError::Invalid {
                key: key.to_owned(),
                message: format!(
                    "set together with {inline_key}: give the secret one way, not both"
                ),
            });
        }
    }
    if let Some(path) = &c.auth_token_file {
        c.token_from_file = Some(read("console.auth_token_file", path, check_token)?);
    }
    if let Some(path) = &c.basic_password_file {
        c.password_from_file = Some(read("console.basic_password_file", path, check_password)?);
    }
    Ok(())
}

const TOKEN_RULE: &str = "a non-empty token of visible ASCII characters without spaces (it is sent in an Authorization header)";
const PASSWORD_RULE: &str = "a non-empty password without control characters";

fn check_token(s: &str) -> Result<(), &'static str> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(TOKEN_RULE);
    }
    Ok(())
}

fn check_password(s: &str) -> Result<(), &'static str> {
    if s.is_empty() || s.chars().any(char::is_control) {
        return Err(PASSWORD_RULE);
    }
    Ok(())
}

/// Visible ASCII, no spaces: it travels in an `Authorization` header.
fn token<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Secret>, D::Error> {
    let s = values::string(d)?;
    check_token(&s).map_err(values::expected)?;
    Ok(Some(Secret::new(s)))
}

/// RFC 7617: the user-id cannot contain a colon.
fn basic_user<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let s = values::string(d)?;
    if s.is_empty() || s.contains(':') || s.chars().any(char::is_control) {
        return Err(values::expected(
            "a non-empty user name without ':' or control characters",
        ));
    }
    Ok(Some(s))
}

fn password<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Secret>, D::Error> {
    let s = values::string(d)?;
    check_password(&s).map_err(values::expected)?;
    Ok(Some(Secret::new(s)))
}

/// The rules across the console's keys: basic credentials come in pairs, and a console
/// reachable beyond this machine must ask for credentials.
pub(super) fn validate(c: &ConsoleSettings, w: &Written) -> Result<(), ConfigError> {
    match (&c.basic_user, c.password()) {
        (Some(_), None) => {
            return Err(ConfigError::Invalid {
                key: "console.basic_password".to_owned(),
                message: "missing: console.basic_user is set, and basic authentication needs both (console.basic_password or console.basic_password_file)"
                    .to_owned(),
            })
        }
        (None, Some(_)) => {
            return Err(ConfigError::Invalid {
                key: "console.basic_user".to_owned(),
                message:
                    "missing: a basic password is set, and basic authentication needs both"
                        .to_owned(),
            })
        }
        _ => {}
    }
    if !c.listen.ip().is_loopback() && !c.authentication_configured() {
        return Err(w.invalid(
            "console.listen",
            quote(&c.listen.to_string()),
            "a loopback address such as \"127.0.0.1:9465\" unless authentication is configured (console.auth_token or console.auth_token_file, or console.basic_user and console.basic_password or console.basic_password_file): the console must not be reachable from other machines without credentials",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::super::{LoadOptions, Settings};
    use super::*;

    fn load(vars: &[(&str, &str)]) -> Result<Settings, ConfigError> {
        let env: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vantage.toml");
        std::fs::write(&path, "").unwrap();
        Settings::load_with_env(
            &LoadOptions {
                config_path: Some(path),
                ..LoadOptions::default()
            },
            &env,
        )
    }

    #[test]
    fn defaults_are_as_specified() {
        let c = Settings::from_toml_str("").unwrap().console;
        assert_eq!(c.listen, "127.0.0.1:9465".parse().unwrap());
        assert!(!c.read_only);
        assert!(c.auth_token.is_none() && c.basic_user.is_none() && c.basic_password.is_none());
        assert!(!c.authentication_configured());
    }

    #[test]
    fn every_key_is_settable_from_the_environment() {
        let s = load(&[
            ("VANTAGE__CONSOLE__LISTEN", "0.0.0.0:8080"),
            ("VANTAGE__CONSOLE__READ_ONLY", "true"),
            ("VANTAGE__CONSOLE__AUTH_TOKEN", "t0k"),
            ("VANTAGE__CONSOLE__BASIC_USER", "ops"),
            ("VANTAGE__CONSOLE__BASIC_PASSWORD", "pw"),
        ])
        .unwrap();
        let c = s.console;
        assert_eq!(c.listen, "0.0.0.0:8080".parse().unwrap());
        assert!(c.read_only);
        assert_eq!(c.auth_token.unwrap().expose(), "t0k");
        assert_eq!(c.basic_user.as_deref(), Some("ops"));
        assert_eq!(c.basic_password.unwrap().expose(), "pw");
    }

    #[test]
    fn loopback_needs_no_credentials_and_anything_else_does() {
        for listen in ["127.0.0.1:1", "127.8.9.1:1", "[::1]:1"] {
            assert!(
                load(&[("VANTAGE__CONSOLE__LISTEN", listen)]).is_ok(),
                "{listen}"
            );
        }
        for listen in [
            "0.0.0.0:1",
            "[::]:1",
            "192.168.1.2:9465",
            "[::ffff:127.0.0.1]:1",
        ] {
            let e = load(&[("VANTAGE__CONSOLE__LISTEN", listen)])
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with(&format!(
                    "invalid configuration: console.listen = \"{listen}\" (from VANTAGE__CONSOLE__LISTEN): expected a loopback address"
                )),
                "{e}"
            );
            assert_eq!(ConfigError::EXIT_CODE, 78);
        }
        assert!(load(&[
            ("VANTAGE__CONSOLE__LISTEN", "0.0.0.0:1"),
            ("VANTAGE__CONSOLE__BASIC_USER", "ops"),
            ("VANTAGE__CONSOLE__BASIC_PASSWORD", "pw"),
        ])
        .is_ok());
    }

    #[test]
    fn secrets_are_never_shown() {
        let e = Settings::from_toml_str("[console]\nauth_token = 12345678")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("12345678"), "{e}");
        assert!(e.contains("console.auth_token = ***: expected"), "{e}");
        let e = Settings::from_toml_str("[console]\nbasic_password = \"a\\u0007b\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("console.basic_password = ***: expected"), "{e}");
        // A `user:password` pasted into basic_user: what follows the first ':' is masked, as a
        // password in a database URL is (issue 19, defect 10).
        let e = Settings::from_toml_str("[console]\nbasic_user = \"a:b\"")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("console.basic_user = \"a:***\": expected"),
            "{e}"
        );
        let e = Settings::from_toml_str("[console]\nbasic_user = \"ops:Hunter2\"")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("Hunter2"), "{e}");
        assert!(e.contains("console.basic_user = \"ops:***\""), "{e}");
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s} {s:?}"), "*** Secret(***)");
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"***\"");
    }

    /// Issue 19, defect 18: a secret file is read up to a cap, never to the end.
    #[test]
    fn a_secret_file_is_read_up_to_a_cap() {
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("token");
        std::fs::write(&big, "a".repeat(1_000_000)).unwrap();
        for path in [big.display().to_string(), "/dev/zero".to_owned()] {
            let e = Settings::from_toml_str(&format!("[console]\nauth_token_file = \"{path}\""))
                .unwrap_err()
                .to_string();
            assert!(e.contains("more than 64 KiB"), "{e}");
        }
    }

    #[test]
    fn secrets_can_come_from_files() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "t0k-from-file\n").unwrap();
        let password = dir.path().join("password");
        std::fs::write(&password, "pw from file").unwrap();
        let s = load(&[
            ("VANTAGE__CONSOLE__LISTEN", "0.0.0.0:1"),
            ("VANTAGE__CONSOLE__AUTH_TOKEN_FILE", token.to_str().unwrap()),
            ("VANTAGE__CONSOLE__BASIC_USER", "ops"),
            (
                "VANTAGE__CONSOLE__BASIC_PASSWORD_FILE",
                password.to_str().unwrap(),
            ),
        ])
        .unwrap();
        let c = &s.console;
        assert_eq!(c.token().unwrap().expose(), "t0k-from-file");
        assert_eq!(c.password().unwrap().expose(), "pw from file");
        assert!(c.auth_token.is_none() && c.authentication_configured());
        // Shown as the path, never the content; and the shown TOML loads again.
        let shown = s.redacted_toml();
        assert!(
            !shown.contains("t0k-from-file") && !shown.contains("pw from file"),
            "{shown}"
        );
        assert!(shown.contains("auth_token_file = "), "{shown}");
        assert!(!format!("{s:?}").contains("t0k-from-file"));

        // Unreadable, or holding what the key would refuse: named by the file, not quoted.
        let e = load(&[("VANTAGE__CONSOLE__AUTH_TOKEN_FILE", "/nonexistent/token")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("console.auth_token_file = \"/nonexistent/token\" (from VANTAGE__CONSOLE__AUTH_TOKEN_FILE): expected a readable file holding the secret"),
            "{e}"
        );
        std::fs::write(&token, "has a space t0k-secret\n").unwrap();
        let e = load(&[("VANTAGE__CONSOLE__AUTH_TOKEN_FILE", token.to_str().unwrap())])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("expected a file holding a non-empty token"),
            "{e}"
        );
        assert!(!e.contains("t0k-secret"), "{e}");
        // One way, not both.
        let e = load(&[
            (
                "VANTAGE__CONSOLE__AUTH_TOKEN_FILE",
                password.to_str().unwrap(),
            ),
            ("VANTAGE__CONSOLE__AUTH_TOKEN", "inline"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("console.auth_token_file: set together with console.auth_token"),
            "{e}"
        );
    }
}
