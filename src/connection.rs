//! Connection options: the database URL and libpq's `PG*` variables, read as the PostgreSQL
//! client reads them. Configuration validates with these functions and the store connects
//! with them, so what `config check` accepts is what the connection accepts; they sit below
//! both, so neither has to ask the other.
//!
//! libpq allows an empty host, `postgres://user:password@/db?host=/run/postgresql` (a Unix
//! socket directory, or the default socket when no `host` is given). The URL parser under
//! sqlx refuses an empty host after a user name, so such a URL is parsed with a placeholder
//! host that never reaches a connection: the `host` parameter replaces it, or, without one,
//! the client's default (`PGHOST`, else the local socket), as libpq would.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use sqlx::postgres::{PgConnectOptions, PgSslMode};

/// Stands in for an empty host while parsing; `.invalid` can never resolve (RFC 2606).
pub(crate) const NO_HOST: &str = "empty-host.vantage.invalid";

/// Why a URL cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum UrlProblem {
    /// Not a URL, or not `postgres://` / `postgresql://`.
    NotPostgres,
    /// The PostgreSQL client refuses it (an unknown `sslmode`, a bad `port` parameter, …).
    Refused(String),
}

impl fmt::Display for UrlProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UrlProblem::NotPostgres => f.write_str("not a postgres:// or postgresql:// URL"),
            UrlProblem::Refused(reason) => f.write_str(reason),
        }
    }
}

/// `url` with [`NO_HOST`] put where its host is empty, and whether that was needed.
pub(crate) fn with_host(url: &str) -> (String, bool) {
    let Some(start) = url.find("://").map(|i| i + 3) else {
        return (url.to_owned(), false);
    };
    let end = url[start..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| start + i);
    let host_start = url[start..end].rfind('@').map_or(start, |i| start + i + 1);
    let host = &url[host_start..end];
    if host.is_empty() || host.starts_with(':') {
        (
            format!("{}{NO_HOST}{}", &url[..host_start], &url[host_start..]),
            true,
        )
    } else {
        (url.to_owned(), false)
    }
}

/// The parsed URL ([`NO_HOST`] in place of an empty host) and whether it had to be put there.
fn parse_url(url: &str) -> Result<(url::Url, bool), UrlProblem> {
    let (text, placeholder) = with_host(url);
    match url::Url::parse(&text) {
        Ok(parsed) if matches!(parsed.scheme(), "postgres" | "postgresql") => {
            Ok((parsed, placeholder))
        }
        _ => Err(UrlProblem::NotPostgres),
    }
}

/// The password of `url` as written in it, if any (to scrub it from messages).
pub(crate) fn url_password(url: &str) -> Option<String> {
    let (parsed, _) = parse_url(url).ok()?;
    parsed.password().map(str::to_owned)
}

fn has_param(url: &url::Url, names: &[&str]) -> bool {
    url.query_pairs().any(|(k, _)| names.contains(&k.as_ref()))
}

/// The connection options of `url`, parsed by sqlx (the same parser the pool uses). Errors
/// never contain the password.
pub(crate) fn connect_options(url: &str) -> Result<PgConnectOptions, UrlProblem> {
    let (parsed, placeholder) = parse_url(url)?;
    let mut options = PgConnectOptions::from_str(parsed.as_str()).map_err(|e| {
        let mut reason = e.to_string();
        while let Some(rest) = reason.strip_prefix("error with configuration: ") {
            reason = rest.to_owned();
        }
        if let Some(password) = parsed.password().filter(|p| !p.is_empty()) {
            reason = reason.replace(password, "***");
        }
        UrlProblem::Refused(reason)
    })?;
    if placeholder && !has_param(&parsed, &["host", "hostaddr"]) {
        options = options.host(PgConnectOptions::new().get_host());
    }
    Ok(options)
}

/// libpq's variables that vantage checks (the others are free text). Empty counts as unset.
pub(crate) const PG_VARS: &[&str] = &["PGPORT", "PGSSLMODE"];

/// A `PG*` variable the connection would read but cannot use: (variable, value, expected).
/// Each is checked only where the URL leaves it to the environment (no URL, or a URL without
/// a port or an `sslmode`), as libpq does.
pub(crate) fn check_pg_env(
    url: Option<&str>,
    env: &HashMap<String, String>,
) -> Result<(), (&'static str, String, &'static str)> {
    let parsed = url.and_then(|u| parse_url(u).ok()).map(|(u, _)| u);
    let set = |var: &str| env.get(var).filter(|v| !v.trim().is_empty()).cloned();
    let port_from_env = parsed
        .as_ref()
        .map_or(true, |u| u.port().is_none() && !has_param(u, &["port"]));
    if let Some(port) = set("PGPORT").filter(|_| port_from_env) {
        if !matches!(port.trim().parse::<u16>(), Ok(p) if p > 0) {
            return Err(("PGPORT", port, "a port number from 1 to 65535"));
        }
    }
    let sslmode_from_env = parsed
        .as_ref()
        .map_or(true, |u| !has_param(u, &["sslmode", "ssl-mode"]));
    if let Some(mode) = set("PGSSLMODE").filter(|_| sslmode_from_env) {
        if mode.trim().parse::<PgSslMode>().is_err() {
            return Err((
                "PGSSLMODE",
                mode,
                "one of disable, allow, prefer, require, verify-ca, verify-full",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_host_gets_the_placeholder() {
        assert_eq!(
            with_host("postgres://u:pw@/db?host=/tmp"),
            (format!("postgres://u:pw@{NO_HOST}/db?host=/tmp"), true)
        );
        assert_eq!(
            with_host("postgres:///db"),
            (format!("postgres://{NO_HOST}/db"), true)
        );
        assert_eq!(
            with_host("postgres://u@:5433/db"),
            (format!("postgres://u@{NO_HOST}:5433/db"), true)
        );
        assert_eq!(
            with_host("postgres://u:p@h:1/db"),
            ("postgres://u:p@h:1/db".to_owned(), false)
        );
        assert_eq!(
            with_host("postgres://[::1]/db"),
            ("postgres://[::1]/db".to_owned(), false)
        );
    }

    #[test]
    fn the_socket_directory_is_used() {
        let o = connect_options("postgres://u:pw@/db?host=/tmp").unwrap();
        assert_eq!(
            o.get_socket().map(|p| p.display().to_string()),
            Some("/tmp".into())
        );
        assert_eq!(o.get_database(), Some("db"));
        assert!(matches!(
            connect_options("postgres://u:secret@h/db?sslmode=bogus"),
            Err(UrlProblem::Refused(r)) if r.contains("bogus") && !r.contains("secret")
        ));
        assert_eq!(
            connect_options("mysql://h/db").unwrap_err(),
            UrlProblem::NotPostgres
        );
    }

    #[test]
    fn pg_variables_are_checked_where_they_are_read() {
        let env = |k: &str, v: &str| HashMap::from([(k.to_owned(), v.to_owned())]);
        assert!(check_pg_env(None, &env("PGPORT", "abc")).is_err());
        assert!(check_pg_env(None, &env("PGPORT", "0")).is_err());
        assert!(check_pg_env(None, &env("PGPORT", "5433")).is_ok());
        assert!(check_pg_env(None, &env("PGPORT", "")).is_ok());
        assert!(check_pg_env(Some("postgres://h:5432/db"), &env("PGPORT", "abc")).is_ok());
        assert!(check_pg_env(Some("postgres://h/db"), &env("PGPORT", "abc")).is_err());
        assert!(check_pg_env(None, &env("PGSSLMODE", "garbage")).is_err());
        assert!(check_pg_env(None, &env("PGSSLMODE", "Verify-Full")).is_ok());
        assert!(check_pg_env(
            Some("postgres://h/db?sslmode=require"),
            &env("PGSSLMODE", "garbage")
        )
        .is_ok());
    }
}
