//! What a store call can fail with; the database password never appears in a message.

use std::time::Duration;

use sqlx::migrate::MigrateError;

use crate::sqlstate::is_connection_error;

/// Errors of the storage layer. Messages never contain the database password.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database could not be reached before `database.connect_timeout` ran out.
    #[error("database unreachable at {target} after {waited:?}: {reason}")]
    Unreachable {
        /// `host:port` (never the password).
        target: String,
        /// How long we kept trying.
        waited: Duration,
        /// The last connection error.
        reason: String,
    },
    /// The server refused the credentials (wrong password, unknown role, `pg_hba.conf`): a
    /// retry will not fix it.
    #[error("authentication failed at {target}: {reason}; check the user and password of database.url (or PGUSER and PGPASSWORD) and the server's pg_hba.conf")]
    AuthenticationFailed {
        /// `host:port` (never the password).
        target: String,
        /// The server's message.
        reason: String,
    },
    /// The database named in the connection options does not exist on the server.
    #[error("database does not exist at {target}: {reason}; check the database name of database.url (or PGDATABASE)")]
    DatabaseMissing {
        /// `host:port`.
        target: String,
        /// The server's message.
        reason: String,
    },
    /// The connection string could not be parsed.
    #[error("invalid database url: {0}")]
    InvalidUrl(String),
    /// The database holds migrations this binary does not know: it is newer than we are.
    #[error("the database schema is newer than this binary (it has migration {0}, which this build does not know); upgrade vantage")]
    SchemaNewer(i64),
    /// The schema has migrations still to apply.
    #[error("the database schema is not migrated (pending migration {0}); run `vantage migrate`")]
    SchemaBehind(i64),
    /// The database was migrated by a build from before the baseline (migrations 0001–0014 of
    /// the unreleased versions), which this binary cannot upgrade.
    #[error("the database schema was migrated by a pre-release build of vantage (its migration {0} is one of the fourteen the baseline replaced); this build cannot upgrade it: drop the schema (DROP SCHEMA ... CASCADE, after saving any event store data you need) and run `vantage migrate` again")]
    PreBaseline(i64),
    /// A migration applied to the database differs from the one built into this binary.
    #[error("migration {0} applied to this database differs from the one built into this binary (checksum mismatch): the database was migrated by another build of vantage; run that build, or restore its migration files and rebuild")]
    MigrationChanged(i64),
    /// The role may not do what a pending migration needs (create the schema, its tables or
    /// functions).
    #[error("the database role may not migrate schema \"{schema}\": {reason}; run `vantage migrate` as the schema's owner (see deploy/postgres/privileges.sql) and start the daemon with database.auto_migrate = false")]
    MigratePrivilege {
        /// The schema.
        schema: String,
        /// The server's message.
        reason: String,
    },
    /// A migration failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] MigrateError),
    /// A statement got no answer within the time its caller allowed.
    #[error("no answer from the database within {0:?}")]
    Timeout(Duration),
    /// An optimistic-concurrency check failed (SQLSTATE 40001), e.g. an append's expected version.
    #[error("{0}")]
    Conflict(String),
    /// Any other database error.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The store cannot do this (the memory store has no dead letters and runs no SQL).
    #[error("not supported by this store: {0}")]
    Unsupported(String),
}

impl StoreError {
    /// True for errors that mean "the database is not there right now" (retry later).
    pub fn is_connection_error(&self) -> bool {
        match self {
            StoreError::Unreachable { .. } => true,
            StoreError::Database(e) => is_connection_error(e),
            _ => false,
        }
    }
}

pub(crate) fn map_db_error(e: sqlx::Error) -> StoreError {
    if let sqlx::Error::Database(db) = &e {
        if db.code().as_deref() == Some("40001") {
            return StoreError::Conflict(db.message().to_string());
        }
    }
    StoreError::Database(e)
}
