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
//! What is refused, both when settings are validated (no database needed, [`SqlPerspective::check`])
//! and again at start-up before anything is written ([`SqlPerspective::prepare`]):
//! - a subscribed type with no statement to run (`"*"` needs a `"*"` statement);
//! - a statement that uses a parameter beyond `$7`, or a `reset` that uses any (reset runs with
//!   none bound): it would fail on every run with SQLSTATE 08P01;
//! - a statement (or `reset`) that ends or controls the transaction (`COMMIT`, `ROLLBACK`,
//!   `SAVEPOINT`, …): the statement runs inside the transaction that also completes the work
//!   row, and ending it would break exactly-once.

use std::collections::BTreeMap;

use async_trait::async_trait;
use sqlx::{Either, Executor, PgConnection, Statement};

use super::{ApplyError, ApplyTx, EventEnvelope, Perspective};
use crate::config::PerspectiveSettings;

/// How many parameters are bound to an event's statement (`$1` … `$7`).
pub const BOUND_PARAMETERS: usize = 7;

/// The key of the catch-all statement, and the subscription to every event type.
pub const CATCH_ALL: &str = "*";

/// The `event_type` of [`SqlPerspectiveError`] when the `reset` statement is at fault.
const RESET: &str = "reset";

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

    /// The statement that runs for an event type: its own, else the `"*"` catch-all.
    pub fn statement(&self, event_type: &str) -> Option<&str> {
        self.statements
            .get(event_type)
            .or_else(|| self.statements.get(CATCH_ALL))
            .map(String::as_str)
    }

    fn error(&self, key: String, event_type: &str, reason: String) -> SqlPerspectiveError {
        SqlPerspectiveError {
            perspective: self.name.clone(),
            event_type: event_type.to_owned(),
            key,
            reason,
        }
    }

    /// Statements with their key and the event type named in messages; `reset` last.
    fn all_statements(&self) -> impl Iterator<Item = (String, &str, &str)> {
        self.statements
            .iter()
            .map(|(t, s)| (format!("sql.{t}"), t.as_str(), s.as_str()))
            .chain(self.reset.as_deref().map(|s| (RESET.to_owned(), RESET, s)))
    }

    /// The checks that need no database: every subscribed type has a statement to run, and no
    /// statement uses an unbound parameter or controls the transaction (see the module docs).
    /// Parameters are judged from the text here; [`prepare`](Self::prepare) asks PostgreSQL.
    pub fn check(&self) -> Result<(), SqlPerspectiveError> {
        self.check_text(true)
    }

    fn check_text(&self, parameters: bool) -> Result<(), SqlPerspectiveError> {
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
        for (key, event_type, statement) in self.all_statements() {
            let is_reset = key == RESET;
            if let Some(keyword) = transaction_control(statement) {
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
            if let Some(n) = highest_parameter(statement).filter(|n| *n > bound as u64) {
                return Err(self.error(key, event_type, unbound_parameter(n, is_reset)));
            }
        }
        Ok(())
    }

    /// [`check`](Self::check) (parameters aside), then prepares every statement (and `reset`)
    /// on `conn` and refuses one that PostgreSQL says needs more parameters than are bound, so
    /// a mistake stops the daemon at start-up with the perspective and event type named, not
    /// at the first matching event. Settings built in code, which skip file validation, get
    /// every check here.
    pub async fn prepare(&self, conn: &mut PgConnection) -> Result<(), SqlPerspectiveError> {
        self.check_text(false)?;
        for (key, event_type, statement) in self.all_statements() {
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
                self.error(
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
                return Err(self.error(
                    key,
                    event_type,
                    unbound_parameter(needed as u64, is_reset),
                ));
            }
        }
        Ok(())
    }
}

fn unbound_parameter(n: u64, is_reset: bool) -> String {
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

// ---------------------------------------------------------------------------------------------
// Reading statement text: just enough lexing to skip comments, string literals, quoted
// identifiers and dollar quotes (PostgreSQL's rules, `standard_conforming_strings = on`).

/// A byte that continues an identifier (PostgreSQL: letters, digits, `_`, `$`, any non-ASCII).
fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80
}

fn is_ident_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || b >= 0x80
}

/// Skips whitespace and comments from `i`; returns where the next token starts.
fn skip_blank(s: &[u8], mut i: usize) -> usize {
    loop {
        while i < s.len() && s[i].is_ascii_whitespace() {
            i += 1;
        }
        if s[i..].starts_with(b"--") {
            while i < s.len() && s[i] != b'\n' {
                i += 1;
            }
        } else if s[i..].starts_with(b"/*") {
            i = skip_block_comment(s, i);
        } else {
            return i;
        }
    }
}

/// `s[i..]` starts with `/*`; returns the index after the matching `*/` (comments nest).
fn skip_block_comment(s: &[u8], mut i: usize) -> usize {
    let mut depth = 0usize;
    while i < s.len() {
        if s[i..].starts_with(b"/*") {
            depth += 1;
            i += 2;
        } else if s[i..].starts_with(b"*/") {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// The first two words of a statement, upper-cased, after whitespace and comments.
fn leading_keywords(sql: &str) -> (Option<String>, Option<String>) {
    let s = sql.as_bytes();
    let word = |at: usize| -> (Option<String>, usize) {
        let start = skip_blank(s, at);
        if start >= s.len() || !is_ident_start(s[start]) {
            return (None, start);
        }
        let mut end = start;
        while end < s.len() && is_ident(s[end]) {
            end += 1;
        }
        (Some(sql[start..end].to_ascii_uppercase()), end)
    };
    let (first, end) = word(0);
    let second = first.as_ref().and_then(|_| word(end).0);
    (first, second)
}

/// The transaction-control command a statement starts with (`COMMIT`, `ROLLBACK PREPARED`,
/// `START TRANSACTION`, …), judged by its first keyword(s) after whitespace and comments.
pub(crate) fn transaction_control(sql: &str) -> Option<String> {
    let (first, second) = leading_keywords(sql);
    let first = first?;
    let with_second = |expected: &str| match &second {
        Some(s) if s == expected => Some(format!("{first} {s}")),
        _ => None,
    };
    match first.as_str() {
        "COMMIT" | "ROLLBACK" => with_second("PREPARED").or(Some(first)),
        "END" | "ABORT" | "BEGIN" | "SAVEPOINT" | "RELEASE" => Some(first),
        "START" => Some("START TRANSACTION".to_owned()),
        // `PREPARE name AS …` is an ordinary (if odd) statement; `PREPARE TRANSACTION` is not.
        "PREPARE" => with_second("TRANSACTION"),
        _ => None,
    }
}

/// The highest positional parameter (`$N`) a statement uses, outside comments, string
/// literals, quoted identifiers and dollar-quoted strings. `None` when it uses none.
pub(crate) fn highest_parameter(sql: &str) -> Option<u64> {
    let s = sql.as_bytes();
    let mut highest: Option<u64> = None;
    let mut i = 0;
    while i < s.len() {
        let b = s[i];
        if s[i..].starts_with(b"--") || s[i..].starts_with(b"/*") {
            i = skip_blank(s, i);
        } else if b == b'\'' {
            // E'…' allows backslash escapes; a lone e/E before the quote makes it one.
            let escapes =
                i > 0 && matches!(s[i - 1], b'e' | b'E') && (i < 2 || !is_ident(s[i - 2]));
            i = skip_quoted(s, i, b'\'', escapes);
        } else if b == b'"' {
            i = skip_quoted(s, i, b'"', false);
        } else if b == b'$' && i + 1 < s.len() && s[i + 1].is_ascii_digit() {
            let start = i + 1;
            let mut end = start;
            while end < s.len() && s[end].is_ascii_digit() {
                end += 1;
            }
            let n = sql[start..end].parse::<u64>().unwrap_or(u64::MAX);
            highest = Some(highest.map_or(n, |h| h.max(n)));
            i = end;
        } else if b == b'$' {
            i = skip_dollar_quote(s, i);
        } else if is_ident(b) {
            // A whole identifier or number, so `a$1` stays an identifier.
            while i < s.len() && is_ident(s[i]) {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    highest
}

/// `s[i]` is the opening `quote`; returns the index after the closing one (a doubled quote is
/// part of the text; so is a backslash-escaped character when `escapes`).
fn skip_quoted(s: &[u8], mut i: usize, quote: u8, escapes: bool) -> usize {
    i += 1;
    while i < s.len() {
        if escapes && s[i] == b'\\' {
            i += 2;
        } else if s[i] == quote {
            if i + 1 < s.len() && s[i + 1] == quote {
                i += 2;
            } else {
                return i + 1;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// `s[i]` is a `$` not followed by a digit: if it opens a dollar quote (`$$` or `$tag$`),
/// returns the index after its closing delimiter, else the index after the `$`.
fn skip_dollar_quote(s: &[u8], i: usize) -> usize {
    let mut end = i + 1;
    if end < s.len() && is_ident_start(s[end]) {
        while end < s.len() && is_ident(s[end]) && s[end] != b'$' {
            end += 1;
        }
    }
    if end >= s.len() || s[end] != b'$' {
        return i + 1;
    }
    let delimiter = &s[i..=end];
    let body = end + 1;
    match s[body..]
        .windows(delimiter.len())
        .position(|w| w == delimiter)
    {
        Some(at) => body + at + delimiter.len(),
        None => s.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn highest_parameter_ignores_literals_comments_and_quotes() {
        let cases: &[(&str, Option<u64>)] = &[
            ("SELECT 1", None),
            ("INSERT INTO t VALUES ($2, $6)", Some(6)),
            ("SELECT $1->>'id', $7", Some(7)),
            ("SELECT $8", Some(8)),
            ("SELECT $10 + $2", Some(10)),
            ("SELECT $1::int+$12", Some(12)),
            ("SELECT $99999999999999999999999", Some(u64::MAX)),
            // Not parameters.
            ("SELECT '$8'", None),
            ("SELECT 'it''s $8', $1", Some(1)),
            ("SELECT E'\\'$8', $2", Some(2)),
            ("SELECT e'\\\\', $3", Some(3)),
            ("SELECT \"col$8\", $1 FROM t", Some(1)),
            ("SELECT \"a\"\"$9\" FROM t", None),
            ("SELECT 1 -- uses $8 later\n, $2", Some(2)),
            ("SELECT /* $8 /* nested $9 */ still $10 */ $3", Some(3)),
            ("SELECT $$ $8 $$, $1", Some(1)),
            ("SELECT $tag$ $8 $x$ $9 $tag$, $4", Some(4)),
            ("SELECT a$8 FROM t", None),
            // An unterminated literal hides nothing after it; prepare reports the syntax.
            ("SELECT '$8", None),
            ("SELECT $", None),
            ("SELECT x FROM t WHERE a = $8-- trailing", Some(8)),
        ];
        for (sql, want) in cases {
            assert_eq!(highest_parameter(sql), *want, "{sql:?}");
        }
    }

    #[test]
    fn transaction_control_is_judged_by_the_first_keywords() {
        let refused: &[(&str, &str)] = &[
            ("COMMIT", "COMMIT"),
            ("commit;", "COMMIT"),
            ("  \n\tCommit work", "COMMIT"),
            ("-- tidy up\nCOMMIT", "COMMIT"),
            ("/* a /* nested */ comment */ rollback", "ROLLBACK"),
            ("ROLLBACK TO SAVEPOINT s", "ROLLBACK"),
            ("END", "END"),
            ("ABORT", "ABORT"),
            ("BEGIN", "BEGIN"),
            ("begin isolation level serializable", "BEGIN"),
            ("START TRANSACTION", "START TRANSACTION"),
            ("SAVEPOINT s", "SAVEPOINT"),
            ("RELEASE SAVEPOINT s", "RELEASE"),
            ("release s", "RELEASE"),
            ("PREPARE TRANSACTION 'x'", "PREPARE TRANSACTION"),
            ("prepare /* c */ transaction 'x'", "PREPARE TRANSACTION"),
            ("COMMIT PREPARED 'x'", "COMMIT PREPARED"),
            ("rollback prepared 'x'", "ROLLBACK PREPARED"),
        ];
        for (sql, want) in refused {
            assert_eq!(transaction_control(sql).as_deref(), Some(*want), "{sql:?}");
        }
        for sql in [
            "INSERT INTO t VALUES ($1)",
            "UPDATE commits SET n = n + 1",
            "SELECT 'COMMIT'",
            "-- COMMIT\nSELECT 1",
            "/* ROLLBACK */ DELETE FROM t",
            "WITH x AS (SELECT 1) SELECT * FROM x",
            "PREPARE p AS SELECT 1",
            "TRUNCATE t",
            "\"COMMIT\"",
            "committed",
            "",
            "   ",
            "-- only a comment",
        ] {
            assert_eq!(transaction_control(sql), None, "{sql:?}");
        }
    }

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
