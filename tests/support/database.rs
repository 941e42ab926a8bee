//! Databases: every test gets its own empty database, either on the server named by
//! `DATABASE_URL` or on one throwaway server per test binary.

use std::sync::OnceLock;
use std::time::Duration;

use sqlx::{Connection, PgConnection};
use vantage::throwaway::ThrowawayPostgres;

/// A fresh, empty database for one test. Dropping it drops the database (`WITH (FORCE)`, so
/// connections the test left open do not keep it alive).
#[derive(Debug)]
pub struct TestDatabase {
    /// Connection URL of this database.
    pub url: String,
    /// Its name, `vantage_test_<12 hex digits>`.
    pub name: String,
    /// URL of the maintenance database used to create and drop it.
    admin_url: String,
}

/// Create a new empty database. Panics (never skips) when no server is available, with the
/// launcher's explanation of what to install.
pub async fn fresh_database() -> TestDatabase {
    let admin_url = admin_url().await;
    let name = format!(
        "vantage_test_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let mut conn = PgConnection::connect(&admin_url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", redacted(&admin_url)));
    sqlx::raw_sql(&format!(r#"CREATE DATABASE "{name}""#))
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("cannot create database {name}: {e}"));
    let _ = conn.close().await;
    TestDatabase {
        url: with_database(&admin_url, &name),
        name,
        admin_url,
    }
}

/// The throwaway server every test in this binary shares, started on first use; `None` when
/// `DATABASE_URL` is set. Blocking on first call: from async code, go through
/// `tokio::task::spawn_blocking`.
///
/// It is never dropped (statics are not); the launcher's exit hook stops it and removes its
/// directory when the test binary exits, and a parent-death signal covers a killed binary.
pub fn throwaway_server() -> Option<&'static ThrowawayPostgres> {
    if external_url().is_some() {
        return None;
    }
    // The error is kept as text so every later test fails fast with the same message instead
    // of retrying a start that cannot work.
    static SERVER: OnceLock<Result<ThrowawayPostgres, String>> = OnceLock::new();
    match SERVER.get_or_init(|| ThrowawayPostgres::start().map_err(|e| e.to_string())) {
        Ok(server) => Some(server),
        Err(message) => panic!("cannot start a throwaway PostgreSQL for the tests: {message}"),
    }
}

fn external_url() -> Option<String> {
    std::env::var("DATABASE_URL")
        .ok()
        .filter(|url| !url.trim().is_empty())
}

async fn admin_url() -> String {
    if let Some(url) = external_url() {
        return url;
    }
    // Starting the server blocks for a second or two; keep that off the test's runtime.
    let started = tokio::task::spawn_blocking(|| {
        throwaway_server()
            .expect("DATABASE_URL is unset, so there is a throwaway server")
            .url()
    })
    .await;
    match started {
        Ok(url) => url,
        // Re-raise the launcher's panic in the test itself so its message is the failure.
        Err(e) => match e.try_into_panic() {
            Ok(payload) => std::panic::resume_unwind(payload),
            Err(e) => panic!("starting the throwaway PostgreSQL failed: {e}"),
        },
    }
}

/// `url` with its path replaced by `/database`, keeping credentials and query parameters.
fn with_database(url: &str, database: &str) -> String {
    let mut url = url::Url::parse(url)
        .unwrap_or_else(|e| panic!("DATABASE_URL is not a valid URL ({e}): {}", redacted(url)));
    url.set_path(&format!("/{database}"));
    url.to_string()
}

/// `url` without its password, for messages.
fn redacted(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) => {
            if parsed.password().is_some() {
                let _ = parsed.set_password(Some("***"));
            }
            parsed.to_string()
        }
        Err(_) => "(unparsable URL)".to_owned(),
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let name = self.name.clone();
        // Drop cannot await, and the test's runtime may be shutting down (or be a
        // current-thread runtime blocked right here), so use a runtime of our own on a thread
        // of our own. Errors are ignored: a leftover database is harmless.
        let dropper = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async {
                let drop_it = async {
                    let mut conn = PgConnection::connect(&admin_url).await?;
                    sqlx::raw_sql(&format!(r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#))
                        .execute(&mut conn)
                        .await?;
                    conn.close().await
                };
                let _ = tokio::time::timeout(Duration::from_secs(30), drop_it).await;
            });
        });
        let _ = dropper.join();
    }
}

/// The configuration of a fast test daemon on `url` (short poll, backoff, heartbeat and lease),
/// with `extra` TOML (perspectives, more sections) appended. One definition for every suite;
/// a test that needs other timings changes the fields of [`fast_settings`]'s result.
pub fn fast_daemon_toml(url: &str, extra: &str) -> String {
    format!(
        r#"
[database]
url = "{url}"
[worker]
consumers = 2
batch_size = 200
max_streams_per_claim = 20
lease = "10s"
poll_interval = "50ms"
retry_backoff_base = "10ms"
retry_backoff_max = "50ms"
shutdown_grace = "5s"
[orphans]
heartbeat_interval = "200ms"
stale_after = "2s"
[log]
level = "warn"
{extra}
"#
    )
}

/// [`fast_daemon_toml`], parsed.
pub fn fast_settings(url: &str, extra: &str) -> vantage::config::Settings {
    vantage::config::Settings::from_toml_str(&fast_daemon_toml(url, extra))
        .expect("the fast test configuration parses")
}
