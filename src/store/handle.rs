//! The PostgreSQL store: how to reach the database, the connection pool, the migrations.

use std::time::{Duration, Instant};

use super::error::StoreError;
use crate::sqlstate::is_connection_error;
use sqlx::migrate::{MigrateError, Migrator};
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};

/// The migrations of this binary, embedded at build time.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// How long any statement vantage issues may wait for a lock before it fails (SQLSTATE 55P03),
/// set on every connection of the pool. vantage's own waits are for its own short transactions
/// (a claim holding a lane, another settle of the same row), well inside this; nothing of ours
/// ever waits for a producer. A batch's statements get `worker.apply_timeout` instead, as their
/// `statement_timeout` bounds them already; a rebuild sets its own bound.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// The channel producers notify (in the same transaction as the append) when work is added.
pub const WORK_CHANNEL: &str = "vantage_work";

/// How to reach the database.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// A `postgres://` url; `None` uses libpq's `PG*` environment variables.
    pub url: Option<String>,
    /// The schema holding every vantage object.
    pub schema: String,
    /// Pool size.
    pub max_connections: u32,
    /// How long to keep retrying the first connection before giving up.
    pub connect_timeout: Duration,
    /// `application_name` of every connection (the daemon puts its instance id there, so an
    /// operator can tell its sessions apart in `pg_stat_activity`).
    pub application_name: String,
    /// `idle_in_transaction_session_timeout` of every session: a transaction left open by a
    /// stuck client is ended by the server instead of holding locks and an old snapshot.
    pub idle_in_transaction_timeout: Option<Duration>,
}

impl StoreOptions {
    /// Options for `url` with the default schema and pool size.
    pub fn for_url(url: impl Into<String>) -> Self {
        StoreOptions {
            url: Some(url.into()),
            schema: "vantage".into(),
            max_connections: 10,
            connect_timeout: Duration::from_secs(30),
            application_name: "vantage".into(),
            idle_in_transaction_timeout: None,
        }
    }

    /// Options from the `[database]` settings.
    pub fn from_settings(db: &crate::config::DatabaseSettings) -> Self {
        StoreOptions {
            url: db.url.as_ref().map(|u| u.expose().to_string()),
            schema: db.schema.clone(),
            max_connections: db.max_connections,
            connect_timeout: db.connect_timeout,
            application_name: "vantage".into(),
            idle_in_transaction_timeout: None,
        }
    }

    /// The connection options, with `search_path` set to the schema.
    pub fn connect_options(&self) -> Result<PgConnectOptions, StoreError> {
        let base = match &self.url {
            // Parsed as configuration parses it (libpq's empty host for a Unix socket
            // included), so what `config check` accepts connects.
            Some(url) => crate::connection::connect_options(url)
                .map_err(|e| StoreError::InvalidUrl(e.to_string()))?,
            None => PgConnectOptions::new(),
        };
        let mut options = vec![
            ("search_path".to_string(), self.schema.clone()),
            // No statement of ours waits without bound on a lock (a producer's, an operator's
            // session, a migration's): see LOCK_TIMEOUT.
            (
                "lock_timeout".to_string(),
                LOCK_TIMEOUT.as_millis().to_string(),
            ),
        ];
        if let Some(idle) = self.idle_in_transaction_timeout {
            let millis = idle.as_millis().clamp(1, i32::MAX as u128);
            options.push((
                "idle_in_transaction_session_timeout".into(),
                millis.to_string(),
            ));
        }
        Ok(base
            .application_name(&self.application_name)
            .options(options))
    }

    /// `host:port` of the target, for messages (never the password).
    pub(crate) fn target(&self) -> String {
        match self.connect_options() {
            Ok(o) => format!("{}:{}", o.get_host(), o.get_port()),
            Err(_) => "<invalid url>".into(),
        }
    }
}

/// The errors of a first connection that a retry will not fix, told apart by SQLSTATE: bad
/// credentials (28P01, and 28000 for an unknown role or a `pg_hba.conf` reject) and an unknown
/// database (3D000). The server's message names the user or database, never the password.
fn refusal(error: &sqlx::Error, target: &str) -> Option<StoreError> {
    let sqlx::Error::Database(db) = error else {
        return None;
    };
    let reason = db.message().to_string();
    let target = target.to_string();
    match db.code().as_deref() {
        Some("28P01" | "28000") => Some(StoreError::AuthenticationFailed { target, reason }),
        Some("3D000") => Some(StoreError::DatabaseMissing { target, reason }),
        _ => None,
    }
}

/// A missing privilege (SQLSTATE 42501) during a migration becomes
/// [`StoreError::MigratePrivilege`], with the hint of how to migrate instead.
fn migrate_error(schema: &str, error: sqlx::Error) -> StoreError {
    match &error {
        sqlx::Error::Database(db) if db.code().as_deref() == Some("42501") => {
            StoreError::MigratePrivilege {
                schema: schema.to_string(),
                reason: db.message().to_string(),
            }
        }
        _ => StoreError::Database(error),
    }
}

fn redact_error(message: &str, url: &str) -> String {
    match crate::connection::url_password(url) {
        Some(p) if !p.is_empty() => message.replace(&p, "***"),
        _ => message.to_string(),
    }
}

/// A migration this call applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppliedMigration {
    /// Version number (the file name prefix).
    pub version: i64,
    /// Description (the rest of the file name).
    pub description: String,
}

/// The handle every component uses to talk to the database.
#[derive(Clone, Debug)]
pub struct Store {
    pub(super) pool: PgPool,
    pub(super) schema: String,
    pub(super) target: String,
    /// Connections kept for batch transactions, besides the pool (see [`super::work`]).
    pub(super) batch_sessions: std::sync::Arc<super::work::BatchSessions>,
}

impl Store {
    /// Connects, retrying with backoff until `connect_timeout` has passed.
    ///
    /// Probes with a single connection first, so a failure reports its real cause (refused,
    /// authentication, unknown database) rather than the pool's timeout.
    pub async fn connect(opts: &StoreOptions) -> Result<Store, StoreError> {
        use sqlx::Connection;
        let connect = opts.connect_options()?;
        let target = opts.target();
        let started = Instant::now();
        let mut delay = Duration::from_millis(100);
        loop {
            let attempt =
                tokio::time::timeout(opts.connect_timeout, PgConnection::connect_with(&connect))
                    .await;
            let error = match attempt {
                Ok(Ok(conn)) => {
                    let _ = conn.close().await;
                    let pool = PgPoolOptions::new()
                        .max_connections(opts.max_connections.max(1))
                        .min_connections(0)
                        .acquire_timeout(Duration::from_secs(10))
                        .connect_lazy_with(connect);
                    return Ok(Store {
                        pool,
                        schema: opts.schema.clone(),
                        target,
                        batch_sessions: Default::default(),
                    });
                }
                Ok(Err(e)) => e,
                Err(_) => sqlx::Error::PoolTimedOut,
            };
            if let Some(refused) = refusal(&error, &target) {
                return Err(refused);
            }
            let waited = started.elapsed();
            let reason = redact_error(&error.to_string(), opts.url.as_deref().unwrap_or(""));
            // Authentication or a missing database will not fix itself; a refusal might.
            let remaining = opts.connect_timeout.saturating_sub(waited);
            if !is_connection_error(&error) || remaining.is_zero() {
                return Err(StoreError::Unreachable {
                    target,
                    waited,
                    reason,
                });
            }
            let pause = delay.min(remaining);
            tracing::warn!(target = %target, error = %reason, retry_in = ?pause,
                "database not reachable yet; retrying");
            tokio::time::sleep(pause).await;
            delay = (delay * 2).min(Duration::from_secs(5));
        }
    }

    /// The connection pool (its connections have `search_path` set to the schema).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema holding vantage's objects.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// `host:port` of the database, for messages.
    pub(crate) fn target(&self) -> &str {
        &self.target
    }

    /// Creates the schema if needed and applies pending migrations; returns what it applied.
    /// Idempotent. Fails with [`StoreError::SchemaNewer`] if the database is ahead of this
    /// binary and [`StoreError::MigrationChanged`] if an applied migration differs from ours.
    ///
    /// On a current schema it only reads (the migrations table), so a role without `CREATE`
    /// (the daemon's, deploy/postgres/privileges.sql) can run it; a role that lacks a privilege
    /// a pending migration needs gets [`StoreError::MigratePrivilege`].
    pub async fn migrate(&self) -> Result<Vec<AppliedMigration>, StoreError> {
        match self.check_migrations().await {
            // Pinning alters only functions not pinned yet: on a schema migrated by this
            // version, none, so it needs no privilege then.
            Ok(()) => return self.pin_search_path().await.map(|()| Vec::new()),
            Err(StoreError::SchemaBehind(_)) => {}
            Err(e) => return Err(e),
        }
        let schema = self.schema.as_str();
        if !self.schema_exists().await? {
            // The schema name is validated by configuration as a plain identifier; quote it anyway.
            let create = format!(
                "CREATE SCHEMA IF NOT EXISTS \"{}\"",
                schema.replace('"', "\"\"")
            );
            sqlx::query(&create)
                .execute(&self.pool)
                .await
                .map_err(|e| migrate_error(schema, e))?;
        }

        let before = self.applied_versions().await?;
        match MIGRATOR.run(&self.pool).await {
            Ok(()) => {}
            Err(MigrateError::VersionMissing(v)) => return Err(StoreError::SchemaNewer(v)),
            Err(MigrateError::VersionMismatch(v)) => return Err(StoreError::MigrationChanged(v)),
            Err(MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _)) => {
                return Err(migrate_error(schema, e))
            }
            Err(e) => return Err(e.into()),
        }
        self.pin_search_path().await?;

        Ok(MIGRATOR
            .iter()
            .filter(|m| m.migration_type.is_up_migration() && !before.contains(&m.version))
            .map(|m| AppliedMigration {
                version: m.version,
                description: m.description.to_string(),
            })
            .collect())
    }

    /// Checks that every migration of this binary is applied, unchanged (same checksum), and
    /// none unknown to it is.
    pub async fn check_migrations(&self) -> Result<(), StoreError> {
        let applied = self.applied_migrations().await?;
        if let Some(v) = pre_baseline(&applied) {
            return Err(StoreError::PreBaseline(v));
        }
        for (v, _, _) in &applied {
            if !MIGRATOR.iter().any(|m| m.version == *v) {
                return Err(StoreError::SchemaNewer(*v));
            }
        }
        for m in MIGRATOR.iter() {
            if !m.migration_type.is_up_migration() {
                continue;
            }
            match applied.iter().find(|(v, _, _)| *v == m.version) {
                None => return Err(StoreError::SchemaBehind(m.version)),
                Some((_, _, checksum)) if checksum.as_slice() != &*m.checksum => {
                    return Err(StoreError::MigrationChanged(m.version))
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Functions resolve table names through search_path; pin it to our schema so a producer
    /// whose session uses another search_path (a plain INSERT firing the fan-out trigger, a
    /// call of schema.append_events) still reaches our tables.
    async fn pin_search_path(&self) -> Result<(), StoreError> {
        sqlx::query(PIN_SEARCH_PATH)
            .execute(&self.pool)
            .await
            .map(|_| ())
            .map_err(|e| migrate_error(&self.schema, e))
    }

    async fn schema_exists(&self) -> Result<bool, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT to_regnamespace(quote_ident($1)) IS NOT NULL")
                .bind(&self.schema)
                .fetch_one(&self.pool)
                .await?,
        )
    }

    async fn applied_versions(&self) -> Result<Vec<i64>, StoreError> {
        Ok(self
            .applied_migrations()
            .await?
            .into_iter()
            .map(|(v, _, _)| v)
            .collect())
    }

    /// Version, description and checksum of every successfully applied migration.
    async fn applied_migrations(&self) -> Result<Vec<(i64, String, Vec<u8>)>, StoreError> {
        let exists: bool = sqlx::query_scalar(
            "SELECT to_regclass(quote_ident($1) || '._sqlx_migrations') IS NOT NULL",
        )
        .bind(&self.schema)
        .fetch_one(&self.pool)
        .await?;
        if !exists {
            return Ok(Vec::new());
        }
        Ok(sqlx::query_as(
            "SELECT version, description, checksum FROM _sqlx_migrations WHERE success ORDER BY version",
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// A cheap round trip, for readiness.
    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// Closes the pool, once every connection in use has come back (the batch sessions kept
    /// for the next batch are closed first).
    pub async fn close(&self) {
        self.batch_sessions.close();
        self.pool.close().await;
    }
}

/// The fourteen migrations the baseline replaced (version, description), as sqlx recorded them.
const PRE_BASELINE: [(i64, &str); 14] = [
    (1, "tables"),
    (2, "functions"),
    (3, "rebuild and dead letters"),
    (4, "exact refunds and real clock"),
    (5, "batched sql apply"),
    (6, "no lease after deregistration"),
    (7, "lane heads"),
    (8, "triage"),
    (9, "cached statement plans"),
    (10, "batched dead letter moves"),
    (11, "quarantine"),
    (12, "inlined statements"),
    (13, "lane bookkeeping"),
    (14, "fingerprint once per error"),
];

/// The first applied migration that only the pre-baseline builds had: its version and
/// description are an old one's and not ours. (Versions 1 and 8 have the same description in
/// both, `tables` and `triage`: a mismatch there alone is an ordinary changed checksum.)
fn pre_baseline(applied: &[(i64, String, Vec<u8>)]) -> Option<i64> {
    applied.iter().find_map(|(v, description, _)| {
        let old = PRE_BASELINE
            .iter()
            .any(|(ov, od)| ov == v && od == description);
        let ours = MIGRATOR
            .iter()
            .any(|m| m.version == *v && m.description == description.as_str());
        (old && !ours).then_some(*v)
    })
}

const PIN_SEARCH_PATH: &str = r#"
DO $$
DECLARE f record;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure AS sig
        FROM pg_proc p
        WHERE p.pronamespace = current_schema()::regnamespace
          AND NOT EXISTS (SELECT 1 FROM unnest(p.proconfig) c WHERE c LIKE 'search_path=%')
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f.sig, current_schema());
    END LOOP;
END
$$
"#;
