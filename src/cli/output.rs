//! The operator's side of every command: what it prints (tables, ages, the JSON result
//! envelope), what it asks (the confirmation prompt and its token), and how it fails (a
//! [`Failure`] carries the message and the exit code).
//!
//! Streams: a command's result goes to stdout; prompts, warnings and progress go to stderr,
//! so with `--json` stdout carries exactly one JSON object and nothing else.

use std::fmt::Display;
use std::io::{IsTerminal, Write};
use std::time::Duration;

use comfy_table::{presets, CellAlignment, ContentArrangement, Table};
use serde_json::{json, Map, Value};

use super::exit;
// Shared with the console, which must not depend on the CLI; re-exported for the commands.
use crate::config::Settings;
pub use crate::present::{human_age, shorten, sort_keys, timestamp};
use crate::store::{Store, StoreError, StoreOptions};

/// `version` of the JSON result envelope.
pub const ENVELOPE_VERSION: &str = "1";

/// Test-only escape hatch: when set to `1`, stdin counts as a terminal, so end-to-end tests can
/// answer a confirmation prompt through a pipe. Operators never need it.
pub const ASSUME_TTY_VAR: &str = "VANTAGE_ASSUME_TTY";

/// Operator commands give up on an unreachable database after this long (or the configured
/// `database.connect_timeout` if shorter): a person is waiting, unlike the daemon's start-up.
pub const OPERATOR_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections an operator command needs at most (a transaction plus a side query).
const OPERATOR_MAX_CONNECTIONS: u32 = 4;

// ---------------------------------------------------------------------------------------------
// The JSON result envelope

/// `status` of the envelope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// The command did what was asked.
    Pass,
    /// It ran but did not succeed (declined, a replay that failed again): exit 1.
    Fail,
    /// It could not run (unknown names, a lost race, no database, bad configuration): exit 2.
    Error,
}

impl Status {
    /// The envelope spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Fail => "fail",
            Status::Error => "error",
        }
    }
}

/// `{"data", "diagnostics": [], "status", "version": "1"}`, every object's keys sorted.
pub fn envelope(status: Status, data: Value) -> Value {
    sort_keys(json!({
        "data": data,
        "diagnostics": [],
        "status": status.as_str(),
        "version": ENVELOPE_VERSION,
    }))
}

// ---------------------------------------------------------------------------------------------
// Failures

/// A command that did not succeed: the message for the operator, the exit code, and the
/// envelope's `data` (always with `error` = the message).
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    /// Process exit code.
    pub code: i32,
    /// What to tell the operator (stderr, or `data.error` under `--json`).
    pub message: String,
    /// Extra envelope data besides `error`.
    pub data: Map<String, Value>,
}

impl Failure {
    /// Usage or environment error (exit 2, status `error`).
    pub fn usage(message: impl Into<String>) -> Self {
        Self::with_code(exit::USAGE, message)
    }

    /// Declined, refused for lack of confirmation, or a replay that failed again (exit 1,
    /// status `fail`).
    pub fn failed(message: impl Into<String>) -> Self {
        Self::with_code(exit::FAILURE, message)
    }

    /// Any exit code; status `fail` for 1, `error` otherwise.
    pub fn with_code(code: i32, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
            data: Map::new(),
        }
    }

    /// Adds a key to the envelope's `data`.
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.data.insert(key.to_owned(), value.into());
        self
    }

    /// The envelope status for this exit code.
    pub fn status(&self) -> Status {
        if self.code == exit::FAILURE {
            Status::Fail
        } else {
            Status::Error
        }
    }

    /// The envelope's `data`.
    pub fn envelope_data(&self) -> Value {
        let mut data = self.data.clone();
        data.insert("error".to_owned(), Value::String(self.message.clone()));
        Value::Object(data)
    }
}

/// The failure for a storage error in an operator command. Every one is an environment error
/// (exit 2): the database is unreachable, not migrated, or refused the statement.
pub fn store_failure(e: &StoreError) -> Failure {
    match e {
        StoreError::Unreachable { target, reason, .. } => {
            Failure::usage(format!("Database unreachable at {target}: {reason}"))
        }
        // A role without the grants it needs: say where they are written down.
        StoreError::Database(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42501") => {
            Failure::usage(format!(
                "{e}. The database role lacks a privilege this command needs: \
                 deploy/postgres/privileges.sql lists what each role (daemon, producer, operator) is granted."
            ))
        }
        // Store errors never contain the password (see `StoreError`).
        other => Failure::usage(other.to_string()),
    }
}

// ---------------------------------------------------------------------------------------------
// Printing

/// Where a command's lines go, decided once by `--json`.
#[derive(Debug, Clone, Copy)]
pub struct Ui {
    json: bool,
}

impl Ui {
    /// Human output unless `json`.
    pub fn new(json: bool) -> Self {
        Ui { json }
    }

    /// A line of the human result (stdout); nothing under `--json`, whose result is the envelope.
    /// Control and invisible characters are escaped ([`crate::text::lines`]): what producers
    /// and handlers wrote cannot drive the terminal.
    pub fn say(&self, line: impl Display) {
        if !self.json {
            println!("{}", crate::text::lines(&line.to_string()));
        }
    }

    /// A warning, note or progress line (stderr, in both modes), escaped as [`say`](Self::say).
    pub fn note(&self, line: impl Display) {
        eprintln!("{}", crate::text::lines(&line.to_string()));
    }

    /// Prints the outcome and returns the exit code: the envelope on stdout under `--json`,
    /// else the failure message on stderr (success lines were already said).
    pub fn finish(&self, result: Result<Value, Failure>) -> i32 {
        match result {
            Ok(data) => {
                if self.json {
                    print_json(&envelope(Status::Pass, data));
                }
                exit::OK
            }
            Err(failure) => {
                if self.json {
                    print_json(&envelope(failure.status(), failure.envelope_data()));
                } else {
                    eprintln!("{}", crate::text::lines(&failure.message));
                }
                failure.code
            }
        }
    }
}

fn print_json(value: &Value) {
    let text = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    let mut out = std::io::stdout().lock();
    // A closed stdout (`| head`) is not worth a panic.
    let _ = writeln!(out, "{text}");
    let _ = out.flush();
}

/// A table with a plain ASCII preset and no dependence on the terminal (width, colours), so
/// the same data always prints the same bytes (golden-file tests rely on it).
pub fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(presets::ASCII_FULL_CONDENSED)
        .force_no_tty()
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(header.to_vec());
    t
}

/// Right-aligns the columns at `indexes` (counts).
pub fn align_right(t: &mut Table, indexes: &[usize]) {
    for &i in indexes {
        if let Some(column) = t.column_mut(i) {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Confirmation

/// Proof that the operator confirmed a destructive action (or passed `--yes`). Only
/// [`confirm`] can create one, and every destructive call site takes one, so an unconfirmed
/// purge, replay, requeue or rebuild does not compile.
#[derive(Debug)]
pub struct Confirmed(());

/// Asks `question` (it should end with `[y/N]`) on stderr and reads the answer from stdin.
/// `yes` (`--yes`) confirms without asking. Without a terminal on stdin nobody can answer, so
/// it refuses at once instead of hanging; an answer other than `y`/`yes` declines (`Aborted.`).
pub async fn confirm(question: &str, yes: bool) -> Result<Confirmed, Failure> {
    if yes {
        return Ok(Confirmed(()));
    }
    if !stdin_is_interactive() {
        return Err(Failure::failed(NO_TERMINAL));
    }
    {
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "{} ", crate::text::one_line(question));
        let _ = err.flush();
    }
    // stdin is blocking: read it off the runtime's worker threads.
    let answer = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|_| line)
    })
    .await;
    match answer {
        Ok(Ok(line)) if is_yes(&line) => Ok(Confirmed(())),
        Ok(Ok(line)) => {
            if line.is_empty() {
                // End of input: finish the prompt's line.
                eprintln!();
            }
            Err(Failure::failed(ABORTED))
        }
        _ => Err(Failure::failed(ABORTED)),
    }
}

/// `Aborted.`: the operator declined.
pub const ABORTED: &str = "Aborted.";

/// Why a destructive command refuses without `--yes` and without a terminal.
pub const NO_TERMINAL: &str =
    "Cannot ask for confirmation: stdin is not a terminal. Pass --yes to proceed without asking.";

fn is_yes(answer: &str) -> bool {
    matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes")
}

/// Whether a person can answer a prompt: stdin is a terminal, or the test-only
/// [`ASSUME_TTY_VAR`] is `1`.
pub fn stdin_is_interactive() -> bool {
    std::env::var(ASSUME_TTY_VAR).is_ok_and(|v| v == "1") || std::io::stdin().is_terminal()
}

// ---------------------------------------------------------------------------------------------
// Connecting

/// Connects for an operator command: a short timeout instead of the daemon's patient start-up,
/// a small pool, and a check that the schema is migrated (so a missing migration is reported
/// as such, not as a missing table).
pub async fn connect(settings: &Settings) -> Result<Store, Failure> {
    let mut opts = StoreOptions::from_settings(&settings.database);
    opts.connect_timeout = opts.connect_timeout.min(OPERATOR_CONNECT_TIMEOUT);
    opts.max_connections = opts.max_connections.clamp(1, OPERATOR_MAX_CONNECTIONS);
    let store = Store::connect(&opts).await.map_err(|e| store_failure(&e))?;
    store
        .check_migrations()
        .await
        .map_err(|e| store_failure(&e))?;
    Ok(store)
}

/// Who acts, for the dead-letter history: `operator USER@HOST`.
pub fn operator_actor() -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .ok()
        .filter(|u| !u.is_empty())
        .or_else(|| {
            nix::unistd::User::from_uid(nix::unistd::getuid())
                .ok()
                .flatten()
                .map(|u| u.name)
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "unknown-host".to_owned());
    format!("operator {user}@{host}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_keys_are_sorted_everywhere() {
        let e = envelope(
            Status::Error,
            json!({"zeta": 1, "alpha": {"b": 2, "a": [{"y": 1, "x": 2}]}}),
        );
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#"{"data":{"alpha":{"a":[{"x":2,"y":1}],"b":2},"zeta":1},"diagnostics":[],"status":"error","version":"1"}"#
        );
    }

    #[test]
    fn failures_carry_their_message_and_status() {
        let f = Failure::usage("No dead-lettered event at position 3.").with("position", 3);
        assert_eq!(f.code, 2);
        assert_eq!(f.status(), Status::Error);
        assert_eq!(
            f.envelope_data(),
            json!({"error": "No dead-lettered event at position 3.", "position": 3})
        );
        assert_eq!(Failure::failed(ABORTED).status(), Status::Fail);
    }

    #[test]
    fn only_y_and_yes_confirm() {
        for yes in ["y\n", "Y\n", "yes\n", " YES \r\n"] {
            assert!(is_yes(yes), "{yes:?}");
        }
        for no in ["", "\n", "n\n", "no\n", "yep\n", "y es\n"] {
            assert!(!is_yes(no), "{no:?}");
        }
    }

    #[test]
    fn tables_do_not_depend_on_the_terminal() {
        let mut t = table(&["A", "Count"]);
        t.add_row(vec!["x".to_owned(), "12".to_owned()]);
        align_right(&mut t, &[1]);
        assert_eq!(
            t.to_string(),
            "+---+-------+\n| A | Count |\n+===========+\n| x |    12 |\n+---+-------+"
        );
    }
}
