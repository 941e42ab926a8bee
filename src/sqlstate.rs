//! What a database error means, told by its SQLSTATE: the classification the store (retry the
//! connection or give up) and the perspectives (charge the event or not) both need, kept below
//! both so neither has to ask the other.

/// SQLSTATEs of a transaction that lost a race with another one and is worth retrying as is:
/// serialization failure, deadlock, lock not available.
const CONFLICT_SQLSTATES: &[&str] = &["40001", "40P01", "55P03"];

/// True for sqlx errors caused by a lost or refused connection rather than by the statement.
pub fn is_connection_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(db) => {
            // 08xxx connection exceptions, 57P01-03 admin/crash shutdown, cannot connect now.
            db.code()
                .map(|c| c.starts_with("08") || c.starts_with("57P"))
                .unwrap_or(false)
        }
        _ => false,
    }
}

/// True for a database error that means "lost a lock race, retry the transaction".
pub fn is_conflict(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| CONFLICT_SQLSTATES.contains(&c.as_ref())),
        _ => false,
    }
}
