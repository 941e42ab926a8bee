//! Exit codes, defined once (SPEC §4.2 and §5).

/// Success, including "nothing to list".
pub const OK: i32 = 0;
/// Declined confirmation, a replay that failed again, or an unexpected internal error.
pub const FAILURE: i32 = 1;
/// Usage or environment error: unknown names or positions, ambiguity, a lost race, an
/// unreachable database in an operator command, malformed input.
pub const USAGE: i32 = 2;
/// The database stayed unreachable past `database.connect_timeout` (`vantage run`, sysexits
/// EX_UNAVAILABLE).
pub const UNAVAILABLE: i32 = 69;
/// Invalid configuration, or a database schema newer than this binary (sysexits EX_CONFIG).
pub const CONFIG: i32 = 78;
