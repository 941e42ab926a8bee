//! The operator's actions on dead letters (docs/cli.md, "vantage dlq"): find one, re-read its
//! event, replay it through its perspective's handler, requeue it, purge it. `vantage dlq` and
//! the console (docs/cli.md, "The console") both call these, so the two can never disagree
//! about what an action does, which compare-and-set guards it, or what history it writes.
//!
//! - Every state change is a compare-and-set in SQL on `status = 'exhausted'`
//!   ([`Store::requeue_dead_letter`](crate::store::Store::requeue_dead_letter),
//!   [`Store::purge_dead_letter`](crate::store::Store::purge_dead_letter),
//!   `resolve_dead_letter`): of two operators acting on one dead letter exactly one wins, and
//!   the other gets [`DlqError::Race`] with nothing done.
//! - A replay or a requeue never applies an event twice: both refuse while the perspective is
//!   being rebuilt and while a work row for the event exists (checked first, and again
//!   atomically by the action itself).
//! - The actor is the caller's: `user@host` for the CLI, the console's user for the console.
//!
//! Confirmation is the caller's business (the CLI asks on the terminal, the console shows a
//! page with a button); nothing here asks anything.
//!
//! Finding a dead letter is in `lookup`, the replay in `replay`, its dry run (what a replay
//! would write, shown before it runs) in `preview`, requeue and purge in `requeue`.

mod lookup;
pub mod msg;
mod preview;
mod replay;
mod requeue;

use std::fmt;

use crate::store::StoreError;

pub use lookup::{check_not_queued, check_perspective, reread, resolve};
pub use preview::{dry_run, DryRun, Preview};
pub use replay::{prepare_replay, replay, PreparedReplay, Replayed};
pub use requeue::{purge, requeue, Requeued};

/// Why an action was refused or could not be done. Its `Display` is the message docs/cli.md
/// ("vantage dlq") gives.
#[derive(Debug)]
pub enum DlqError {
    /// `No perspective named '{name}' is registered.`
    UnknownPerspective(String),
    /// `No dead-lettered event at position {n}.`
    NoDeadLetter(i64),
    /// `Could not re-read the event at position {n}.`
    CannotReread(i64),
    /// The position is dead-lettered in several perspectives.
    Ambiguous {
        /// The position.
        position: i64,
        /// The perspectives that gave up on it.
        perspectives: Vec<String>,
    },
    /// Another command changed the dead letter first: nothing was done.
    Race(i64),
    /// The perspective has no handler in this configuration.
    NoHandler {
        /// The perspective.
        perspective: String,
        /// The position.
        position: i64,
    },
    /// The perspective's handler has no statement for the event's type.
    NoStatement {
        /// The perspective.
        perspective: String,
        /// The event's type.
        event_type: String,
        /// The position.
        position: i64,
    },
    /// The perspective is being rebuilt: nothing was done, try again after.
    BeingRebuilt(String),
    /// A work row for the event exists: acting would apply it twice.
    AlreadyQueued {
        /// The position.
        position: i64,
        /// The perspective.
        perspective: String,
        /// `replaying` or `requeuing`.
        verb: &'static str,
    },
    /// The database went away in the middle of a replay: nothing was recorded.
    UnavailableDuringReplay {
        /// `host:port` (never the password).
        target: String,
        /// The position.
        position: i64,
        /// What the driver said.
        error: String,
    },
    /// Any other database failure.
    Store(StoreError),
}

impl fmt::Display for DlqError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DlqError::UnknownPerspective(name) => f.write_str(&msg::unknown_perspective(name)),
            DlqError::NoDeadLetter(n) => f.write_str(&msg::no_dead_letter(*n)),
            DlqError::CannotReread(n) => f.write_str(&msg::cannot_reread(*n)),
            DlqError::Ambiguous {
                position,
                perspectives,
            } => {
                let names: Vec<&str> = perspectives.iter().map(String::as_str).collect();
                f.write_str(&msg::ambiguous(*position, &names))
            }
            DlqError::Race(n) => f.write_str(&msg::race(*n)),
            DlqError::NoHandler {
                perspective,
                position,
            } => f.write_str(&msg::no_handler(perspective, *position)),
            DlqError::NoStatement {
                perspective,
                event_type,
                position,
            } => f.write_str(&msg::no_statement(perspective, event_type, *position)),
            DlqError::BeingRebuilt(p) => f.write_str(&msg::being_rebuilt(p)),
            DlqError::AlreadyQueued {
                position,
                perspective,
                verb,
            } => f.write_str(&msg::already_queued(*position, perspective, verb)),
            DlqError::UnavailableDuringReplay {
                target,
                position,
                error,
            } => write!(
                f,
                "Database unreachable at {target} during the replay of position {position}: {error}. Nothing was done."
            ),
            DlqError::Store(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for DlqError {}

impl From<StoreError> for DlqError {
    fn from(e: StoreError) -> Self {
        DlqError::Store(e)
    }
}
