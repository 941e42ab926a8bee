//! The statements of a SQL perspective as text: the rules they must follow, checked without a
//! database, and the reading of that text ([`scan`]: comments, literals, `$n` parameters,
//! transaction control).
//!
//! Configuration validation (`config`), the SQL perspective (`perspective`) and the statement
//! batch (`store::apply`) all need these rules; they live here, below all three, so none of
//! them has to reach into another. See docs/sql-contract.md, "SQL perspectives".
//!
//! Parameters bound to every statement: `$1` data (jsonb), `$2` stream_id, `$3` event_id,
//! `$4` event_type, `$5` global_position, `$6` stream_version, `$7` metadata. What is refused:
//! - a subscribed type with no statement to run (`"*"` needs a `"*"` statement);
//! - a statement that uses a parameter beyond `$7`, or a `reset` that uses any (reset runs with
//!   none bound): it would fail on every run with SQLSTATE 08P01;
//! - a statement (or `reset`) that ends or controls the transaction (`COMMIT`, `ROLLBACK`,
//!   `SAVEPOINT`, …): the statement runs inside the transaction that also completes the work
//!   row, and ending it would break exactly-once.

pub(crate) mod scan;

use std::collections::BTreeMap;

/// How many parameters are bound to an event's statement (`$1` … `$7`).
pub(crate) const BOUND_PARAMETERS: usize = 7;

/// The key of the catch-all statement, and the subscription to every event type.
pub(crate) const CATCH_ALL: &str = "*";

/// The `key` and `event_type` of [`SqlPerspectiveError`] when the `reset` statement is at fault.
pub(crate) const RESET: &str = "reset";

/// A statement refused at configuration or start-up: it does not prepare, needs parameters that
/// are not bound, ends the transaction, or a subscribed type has none.
#[derive(Debug, thiserror::Error)]
#[error("perspective '{perspective}', {}: {reason}", subject(.key, .event_type))]
pub struct SqlPerspectiveError {
    /// The perspective.
    pub perspective: String,
    /// The event type (or `reset`).
    pub event_type: String,
    /// Where in the perspective's `[[perspectives]]` entry: `sql.TYPE`, `sql` (a statement is
    /// missing) or `reset`.
    pub key: String,
    /// What is wrong (for a statement that does not prepare: what PostgreSQL said).
    pub reason: String,
}

fn subject(key: &str, event_type: &str) -> String {
    if key == RESET {
        "reset statement".to_owned()
    } else {
        format!("event type '{event_type}'")
    }
}

/// A SQL perspective's statements as configured, borrowed: what the rules read.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Statements<'a> {
    /// The perspective's name (for messages).
    pub name: &'a str,
    /// The subscribed event types (`"*"` = every type).
    pub events: &'a [String],
    /// Event type (or `"*"`) → statement.
    pub sql: &'a BTreeMap<String, String>,
    /// The `reset` statement, if any.
    pub reset: Option<&'a str>,
}

impl<'a> Statements<'a> {
    /// The statement that runs for an event type: its own, else the `"*"` catch-all.
    pub fn statement(&self, event_type: &str) -> Option<&'a str> {
        self.sql
            .get(event_type)
            .or_else(|| self.sql.get(CATCH_ALL))
            .map(String::as_str)
    }

    /// An error about this perspective.
    pub fn error(&self, key: String, event_type: &str, reason: String) -> SqlPerspectiveError {
        SqlPerspectiveError {
            perspective: self.name.to_owned(),
            event_type: event_type.to_owned(),
            key,
            reason,
        }
    }

    /// Statements with their key and the event type named in messages; `reset` last.
    pub fn all(&self) -> impl Iterator<Item = (String, &'a str, &'a str)> + 'a {
        self.sql
            .iter()
            .map(|(t, s)| (format!("sql.{t}"), t.as_str(), s.as_str()))
            .chain(self.reset.map(|s| (RESET.to_owned(), RESET, s)))
    }

    /// The rules that need no database (see the module docs); with `parameters` false, the
    /// parameters are left to the caller (who asks PostgreSQL instead of reading the text).
    pub fn check(&self, parameters: bool) -> Result<(), SqlPerspectiveError> {
        if let Some(event_type) = self
            .events
            .iter()
            .find(|t| self.statement(t.as_str()).is_none())
        {
            let reason = if event_type == CATCH_ALL {
                "it subscribes to every event type but has no \"*\" statement, so events without \
                 a statement of their own would be completed without running anything (add the \
                 catch-all \"*\" = \"...\" to its [perspectives.sql])"
                    .to_owned()
            } else {
                "it subscribes to this type but has no statement for it".to_owned()
            };
            return Err(self.error("sql".to_owned(), event_type, reason));
        }
        for (key, event_type, statement) in self.all() {
            let is_reset = key == RESET;
            if let Some(keyword) = scan::transaction_control(statement) {
                return Err(self.error(
                    key,
                    event_type,
                    format!(
                        "the statement starts with {keyword}, which ends or controls the transaction; \
                         vantage runs it inside the transaction that {} and commits that \
                         transaction itself, so it may not",
                        if is_reset {
                            "re-queues the history"
                        } else {
                            "completes the event (exactly-once)"
                        }
                    ),
                ));
            }
            if !parameters {
                continue;
            }
            let bound = if is_reset { 0 } else { BOUND_PARAMETERS };
            if let Some(n) = scan::highest_parameter(statement).filter(|n| *n > bound as u64) {
                return Err(self.error(key, event_type, unbound_parameter(n, is_reset)));
            }
        }
        Ok(())
    }
}

/// Why a statement that uses `$n` is refused.
pub(crate) fn unbound_parameter(n: u64, is_reset: bool) -> String {
    if is_reset {
        format!("the statement uses parameter ${n}, but reset runs with no parameters bound")
    } else {
        format!(
            "the statement uses parameter ${n}, but only $1 to ${BOUND_PARAMETERS} are bound \
             ($1 data, $2 stream_id, $3 event_id, $4 event_type, $5 global_position, \
             $6 stream_version, $7 metadata)"
        )
    }
}
