//! Exit codes, defined once (docs/cli.md, "Exit codes"), and the mapping of the daemon's errors
//! to them.
//!
//! One rule for a configuration that cannot be loaded (a file that is not TOML, an unknown or
//! invalid value, from the file, the environment or a flag): [`CONFIG`] (78) from every
//! command, except the `vantage dlq` commands, whose exit codes docs/cli.md ("vantage dlq")
//! fixes: [`DLQ_BAD_CONFIG`] (2). A command line clap refuses is [`USAGE`] (2) everywhere.
//!
//! The daemon does not know about exit codes (it is a library: tests and embedders start it
//! in-process); only this front end turns its errors into a process status.

use crate::daemon::DaemonError;
use crate::store::StoreError;

/// Success, including "nothing to list", a graceful shutdown, and a stop requested during
/// start-up (nothing was claimed).
pub const OK: i32 = 0;
/// Declined confirmation, a replay that failed again, or an unexpected internal error.
pub const FAILURE: i32 = 1;
/// Usage or environment error: unknown names or positions, ambiguity, a lost race, an
/// unreachable database in an operator command, malformed input.
pub const USAGE: i32 = 2;
/// A configuration that cannot be loaded, from a `vantage dlq` command: docs/cli.md ("vantage
/// dlq") counts "bad configuration" among its usage or environment errors. Every other command exits [`CONFIG`].
pub const DLQ_BAD_CONFIG: i32 = USAGE;
/// The database stayed unreachable past `database.connect_timeout` (`vantage run`, sysexits
/// EX_UNAVAILABLE): a retry later may succeed.
pub const UNAVAILABLE: i32 = 69;
/// Invalid configuration, or anything else a retry will not fix: refused credentials, a
/// missing database, a database schema newer than this binary or with a changed migration, a
/// role that may not migrate, an `http.listen` that cannot be bound (sysexits EX_CONFIG).
pub const CONFIG: i32 = 78;
/// A second SIGTERM or SIGINT during the graceful shutdown: exited at once, without finishing
/// the drain (leases left to lapse, the instance to go stale). 128 + SIGINT, the shell's code
/// for an interrupted command; distinct from 143, a death by an unhandled SIGTERM.
pub const FORCED: i32 = 130;

/// The exit code of a storage error met while starting (`run`, `migrate`, `demo`): 69 when
/// the database is not there yet, 78 when a retry will not fix it, 1 otherwise.
pub fn for_store_error(e: &StoreError) -> i32 {
    match e {
        StoreError::SchemaNewer(_)
        | StoreError::SchemaBehind(_)
        | StoreError::MigrationChanged(_)
        | StoreError::PreBaseline(_)
        | StoreError::MigratePrivilege { .. }
        | StoreError::InvalidUrl(_)
        | StoreError::AuthenticationFailed { .. }
        | StoreError::DatabaseMissing { .. } => CONFIG,
        e if e.is_connection_error() => UNAVAILABLE,
        _ => FAILURE,
    }
}

impl DaemonError {
    /// The process exit code for this error (docs/cli.md, "Exit codes").
    pub fn exit_code(&self) -> i32 {
        match self {
            DaemonError::Config(_) => CONFIG,
            DaemonError::Store(e) => for_store_error(e),
            DaemonError::Stopped => OK,
            DaemonError::Internal(_) => FAILURE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_that_cannot_help_is_78_and_one_that_may_is_69() {
        let refused = StoreError::AuthenticationFailed {
            target: "db:5432".into(),
            reason: "password authentication failed for user \"x\"".into(),
        };
        assert_eq!(for_store_error(&refused), CONFIG);
        assert_eq!(for_store_error(&StoreError::MigrationChanged(1)), CONFIG);
        let away = StoreError::Unreachable {
            target: "db:5432".into(),
            waited: std::time::Duration::from_secs(30),
            reason: "connection refused".into(),
        };
        assert_eq!(for_store_error(&away), UNAVAILABLE);
        assert_eq!(DaemonError::Store(away).exit_code(), UNAVAILABLE);
        assert_eq!(DaemonError::Stopped.exit_code(), OK);
    }
}
