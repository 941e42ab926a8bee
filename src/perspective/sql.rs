//! SQL perspectives: one parameterised statement per event type, from configuration.
//!
//! Parameters bound to every statement: `$1` data (jsonb), `$2` stream_id, `$3` event_id,
//! `$4` event_type, `$5` global_position, `$6` stream_version, `$7` metadata. Event data is only
//! ever bound, never formatted into SQL.
//!
//! Which statement runs for an event: the one keyed by its exact type, else the `"*"` statement
//! (the catch-all of a perspective that subscribes to `"*"`). An event with neither is never
//! completed silently: [`Perspective::apply`] fails it permanently (it is dead-lettered).
//!
//! What is refused (the rules are the crate's `statement` module, which configuration
//! validation applies too), both when settings are validated (no database needed,
//! [`SqlPerspective::check`]) and again at start-up before anything is written
//! ([`SqlPerspective::prepare`]):
//! - a subscribed type with no statement to run (`"*"` needs a `"*"` statement);
//! - a statement that uses a parameter beyond `$7`, or a `reset` that uses any (reset runs with
//!   none bound): it would fail on every run with SQLSTATE 08P01;
//! - a statement (or `reset`) that ends or controls the transaction (`COMMIT`, `ROLLBACK`,
//!   `SAVEPOINT`, …): the statement runs inside the transaction that also completes the work
//!   row, and ending it would break exactly-once.

use std::collections::BTreeMap;

use async_trait::async_trait;
use sqlx::{Either, Executor, PgConnection, Statement};

use super::handler::{ApplyError, ApplyTx, EventEnvelope, Perspective};
use crate::config::PerspectiveSettings;
use crate::statement::{unbound_parameter, Statements, BOUND_PARAMETERS, RESET};

pub use crate::statement::SqlPerspectiveError;

/// A perspective whose handler is SQL from configuration.
#[derive(Clone, Debug)]
pub struct SqlPerspective {
    name: String,
    events: Vec<String>,
    statements: BTreeMap<String, String>,
    reset: Option<String>,
}

impl SqlPerspective {
    /// From its configuration.
    pub fn from_settings(s: &PerspectiveSettings) -> Self {
        SqlPerspective {
            name: s.name.clone(),
            events: s.events.clone(),
            statements: s.sql.clone(),
            reset: s.reset.clone(),
        }
    }

    /// From its parts: a name, the subscribed types and a statement per type (the daemon
    /// builds each version of a versioned perspective this way, from the registry).
    pub fn from_parts(
        name: impl Into<String>,
        events: Vec<String>,
        statements: BTreeMap<String, String>,
    ) -> Self {
        SqlPerspective {
            name: name.into(),
            events,
            statements,
            reset: None,
        }
    }

    /// The statement that runs for an event type: its own, else the `"*"` catch-all.
    pub fn statement(&self, event_type: &str) -> Option<&str> {
        self.statements().statement(event_type)
    }

    /// The statements as the rules read them.
    fn statements(&self) -> Statements<'_> {
        Statements {
            name: &self.name,
            events: &self.events,
            sql: &self.statements,
            reset: self.reset.as_deref(),
        }
    }

    /// The checks that need no database: every subscribed type has a statement to run, and no
    /// statement uses an unbound parameter or controls the transaction (see the module docs).
    /// Parameters are judged from the text here; [`prepare`](Self::prepare) asks PostgreSQL.
    pub fn check(&self) -> Result<(), SqlPerspectiveError> {
        self.statements().check(true)
    }

    /// [`check`](Self::check) (parameters aside), then prepares every statement (and `reset`)
    /// on `conn` and refuses one that PostgreSQL says needs more parameters than are bound, so
    /// a mistake stops the daemon at start-up with the perspective and event type named, not
    /// at the first matching event. Settings built in code, which skip file validation, get
    /// every check here.
    pub async fn prepare(&self, conn: &mut PgConnection) -> Result<(), SqlPerspectiveError> {
        let rules = self.statements();
        rules.check(false)?;
        for (key, event_type, statement) in rules.all() {
            let is_reset = key == RESET;
            let prepared = if is_reset {
                conn.prepare(statement).await
            } else {
                conn.prepare_with(statement, &param_types()).await
            };
            let prepared = prepared.map_err(|e| {
                let reason = match &e {
                    sqlx::Error::Database(db) => db.message().to_string(),
                    other => other.to_string(),
                };
                rules.error(
                    key.clone(),
                    event_type,
                    format!("the statement does not prepare: {reason}"),
                )
            })?;
            // PostgreSQL infers parameters beyond the seven types given (`$8` prepares fine),
            // and then every execution with seven bound fails with 08P01.
            let needed = match prepared.parameters() {
                Some(Either::Left(types)) => types.len(),
                Some(Either::Right(n)) => n,
                None => 0,
            };
            let bound = if is_reset { 0 } else { BOUND_PARAMETERS };
            if needed > bound {
                return Err(rules.error(
                    key,
                    event_type,
                    unbound_parameter(needed as u64, is_reset),
                ));
            }
        }
        Ok(())
    }
}

fn param_types() -> [sqlx::postgres::PgTypeInfo; BOUND_PARAMETERS] {
    use sqlx::postgres::PgTypeInfo;
    [
        PgTypeInfo::with_name("jsonb"),
        PgTypeInfo::with_name("uuid"),
        PgTypeInfo::with_name("uuid"),
        PgTypeInfo::with_name("text"),
        PgTypeInfo::with_name("int8"),
        PgTypeInfo::with_name("int4"),
        PgTypeInfo::with_name("jsonb"),
    ]
}

#[async_trait]
impl Perspective for SqlPerspective {
    fn name(&self) -> &str {
        &self.name
    }

    fn event_types(&self) -> Vec<String> {
        self.events.clone()
    }

    fn batch_statement(&self, event_type: &str) -> Option<&str> {
        self.statement(event_type)
    }

    fn reads_data(&self) -> bool {
        // Any statement that mentions `$1` (the scan the statement batch uses to decide what to
        // send: a false "mentioned" only costs the payloads, a false "not mentioned" cannot be).
        self.statements
            .values()
            .any(|s| crate::store::mentioned_params(s) & 1 != 0)
    }

    async fn apply(&self, event: &EventEnvelope, tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        // Configuration guarantees a statement for every subscribed type; an event without one
        // was queued under another subscription (the registry's types differ from this
        // configuration). Completing it would pretend it was applied.
        let Some(statement) = self.statement(&event.event_type) else {
            return Err(ApplyError::Permanent(format!(
                "perspective '{}' has no statement for event type '{}' in this configuration \
                 (it subscribes to [{}]); nothing was run",
                self.name,
                event.event_type,
                self.events.join(", ")
            )));
        };
        sqlx::query(statement)
            .bind(&event.data)
            .bind(event.stream_id)
            .bind(event.event_id)
            .bind(&event.event_type)
            .bind(event.global_position)
            .bind(event.stream_version)
            .bind(&event.metadata)
            .execute(tx.connection()?)
            .await
            .map_err(ApplyError::from_sqlx)?;
        Ok(())
    }

    async fn reset(&self, tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        if let Some(reset) = &self.reset {
            sqlx::query(reset)
                .execute(tx.connection()?)
                .await
                .map_err(ApplyError::from_sqlx)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PerspectiveSettings;

    fn perspective(events: &[&str], sql: &[(&str, &str)], reset: Option<&str>) -> SqlPerspective {
        SqlPerspective::from_settings(&PerspectiveSettings {
            name: "p".into(),
            events: events.iter().map(|e| e.to_string()).collect(),
            sql: sql
                .iter()
                .map(|(t, s)| (t.to_string(), s.to_string()))
                .collect(),
            reset: reset.map(String::from),
            quarantine_after: None,
            ..Default::default()
        })
    }

    #[test]
    fn the_catch_all_runs_for_types_without_their_own_statement() {
        let p = perspective(&["*"], &[("*", "SELECT 1"), ("A", "SELECT 2")], None);
        assert_eq!(p.statement("A"), Some("SELECT 2"));
        assert_eq!(p.statement("B"), Some("SELECT 1"));
        assert!(p.check().is_ok());
        let p = perspective(&["A"], &[("A", "SELECT 2")], None);
        assert_eq!(p.statement("B"), None);
    }

    #[test]
    fn reads_data_when_some_statement_mentions_dollar_one() {
        let p = perspective(
            &["A", "B"],
            &[("A", "SELECT $2"), ("B", "SELECT $6, $7")],
            None,
        );
        assert!(!p.reads_data());
        let p = perspective(
            &["A", "B"],
            &[("A", "SELECT $2"), ("B", "SELECT $1->>'x'")],
            None,
        );
        assert!(p.reads_data());
        // A mention anywhere counts (a comment included): reading too much is only slower.
        let p = perspective(&["A"], &[("A", "SELECT $2 -- not $1")], None);
        assert!(p.reads_data());
    }

    #[test]
    fn check_names_what_is_wrong() {
        let e = perspective(&["*"], &[("A", "SELECT 1")], None)
            .check()
            .unwrap_err();
        assert_eq!((e.key.as_str(), e.event_type.as_str()), ("sql", "*"));
        assert!(
            e.to_string()
                .starts_with("perspective 'p', event type '*': "),
            "{e}"
        );

        let e = perspective(&["A", "B"], &[("A", "SELECT 1")], None)
            .check()
            .unwrap_err();
        assert_eq!((e.key.as_str(), e.event_type.as_str()), ("sql", "B"));

        let e = perspective(&["A"], &[("A", "SELECT $8")], None)
            .check()
            .unwrap_err();
        assert_eq!(e.key, "sql.A");
        assert!(
            e.reason.contains("$8") && e.reason.contains("$1 to $7"),
            "{e}"
        );

        let e = perspective(&["A"], &[("A", "COMMIT")], None)
            .check()
            .unwrap_err();
        assert_eq!(e.key, "sql.A");
        assert!(e.reason.contains("starts with COMMIT"), "{e}");

        let e = perspective(
            &["A"],
            &[("A", "SELECT $7")],
            Some("DELETE FROM t WHERE id = $1"),
        )
        .check()
        .unwrap_err();
        assert_eq!((e.key.as_str(), e.event_type.as_str()), ("reset", "reset"));
        assert!(
            e.to_string()
                .starts_with("perspective 'p', reset statement: the statement uses parameter $1"),
            "{e}"
        );

        let e = perspective(&["A"], &[("A", "SELECT 1")], Some("TRUNCATE t; COMMIT")).check();
        // Only the first keyword is judged; a second statement does not prepare anyway.
        assert!(e.is_ok());
        let e = perspective(&["A"], &[("A", "SELECT 1")], Some(" rollback"))
            .check()
            .unwrap_err();
        assert_eq!(e.key, "reset");
    }
}
