//! The operator's actions on dead letters (SPEC §4.2): find one, re-read its event, replay it
//! through its perspective's handler, requeue it, purge it. `vantage dlq` and the console
//! (§4.4) both call these, so the two can never disagree about what an action does, which
//! compare-and-set guards it, or what history it writes.
//!
//! - Every state change is a compare-and-set in SQL on `status = 'exhausted'`
//!   ([`Store::requeue_dead_letter`], [`Store::purge_dead_letter`], `resolve_dead_letter`): of
//!   two operators acting on one dead letter exactly one wins, and the other gets
//!   [`DlqError::Race`] with nothing done.
//! - A replay or a requeue never applies an event twice: both refuse while the perspective is
//!   being rebuilt and while a work row for the event exists (checked first, and again
//!   atomically by the action itself).
//! - The actor is the caller's: `user@host` for the CLI, the console's user for the console.
//!
//! Confirmation is the caller's business (the CLI asks on the terminal, the console shows a
//! page with a button); nothing here asks anything.

pub mod msg;

use std::fmt;

use crate::config::PerspectiveSettings;
use crate::perspective::{ApplyError, ApplyTx, EventEnvelope, Perspective, SqlPerspective};
use crate::store::{resolve_dead_letter_in, DeadLetter, Store, StoreError, StoredEvent};

/// Why an action was refused or could not be done. Its `Display` is the SPEC §4.2 message.
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

// ---------------------------------------------------------------------------------------------
// Lookups

/// A perspective name given by the operator must be registered.
pub async fn check_perspective(store: &Store, name: Option<&str>) -> Result<(), DlqError> {
    if let Some(name) = name {
        if store.perspective(name).await?.is_none() {
            return Err(DlqError::UnknownPerspective(name.to_owned()));
        }
    }
    Ok(())
}

/// The one open dead letter at `position` (of `perspective`, with `reason`, when given).
pub async fn resolve(
    store: &Store,
    position: i64,
    perspective: Option<&str>,
    reason: Option<&str>,
) -> Result<DeadLetter, DlqError> {
    check_perspective(store, perspective).await?;
    let mut found = store.open_dead_letters_at(position, perspective).await?;
    if let Some(reason) = reason {
        found.retain(|d| d.failure_reason == reason);
    }
    match found.len() {
        0 => Err(DlqError::NoDeadLetter(position)),
        1 => Ok(found.remove(0)),
        _ => Err(DlqError::Ambiguous {
            position,
            perspectives: found.into_iter().map(|d| d.perspective_name).collect(),
        }),
    }
}

/// Refuses to replay or requeue (`verb`: `replaying`, `requeuing`) a dead letter whose
/// perspective is being rebuilt, or whose event is queued for the daemon again (either would
/// apply it twice). The actions check again atomically; this is the early, friendly answer.
pub async fn check_not_queued(
    store: &Store,
    dl: &DeadLetter,
    verb: &'static str,
) -> Result<(), DlqError> {
    let p = dl.perspective_name.as_str();
    if store.perspective_is_rebuilding(p).await? {
        return Err(DlqError::BeingRebuilt(p.to_owned()));
    }
    if store.is_queued(p, dl.event_id).await? {
        return Err(DlqError::AlreadyQueued {
            position: dl.global_position,
            perspective: p.to_owned(),
            verb,
        });
    }
    Ok(())
}

/// Re-reads the dead letter's event live and checks that the row read really is that event:
/// the same global position and the same event id. Anything else is not that event.
pub async fn reread(store: &Store, dl: &DeadLetter) -> Result<StoredEvent, DlqError> {
    match store.event_at(dl.global_position).await? {
        Some(e) if e.global_position == dl.global_position && e.event_id == dl.event_id => Ok(e),
        _ => Err(DlqError::CannotReread(dl.global_position)),
    }
}

// ---------------------------------------------------------------------------------------------
// Replay

/// A replay that can run: the perspective's handler from the configuration, and the event
/// re-read live. Made by [`prepare_replay`].
pub struct PreparedReplay {
    handler: SqlPerspective,
    event: StoredEvent,
}

/// Everything a replay needs, or why it cannot run anything (a replay that could not run the
/// handler is refused, never recorded as resolved): a handler for the perspective in
/// `perspectives` (the configuration), the event re-read live, a statement for its type, and
/// the event not queued again nor its perspective being rebuilt.
pub async fn prepare_replay(
    store: &Store,
    perspectives: &[PerspectiveSettings],
    dl: &DeadLetter,
) -> Result<PreparedReplay, DlqError> {
    let (p, n) = (dl.perspective_name.as_str(), dl.global_position);
    let Some(settings) = perspectives.iter().find(|s| s.name == p) else {
        return Err(DlqError::NoHandler {
            perspective: p.to_owned(),
            position: n,
        });
    };
    let handler = SqlPerspective::from_settings(settings);
    let event = reread(store, dl).await?;
    if handler.statement(&event.event_type).is_none() {
        return Err(DlqError::NoStatement {
            perspective: p.to_owned(),
            event_type: event.event_type,
            position: n,
        });
    }
    check_not_queued(store, dl, "replaying").await?;
    Ok(PreparedReplay { handler, event })
}

/// What a replay that ran came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Replayed {
    /// The handler applied it; the dead letter is `resolved` (committed together).
    Resolved,
    /// The handler failed again with this error: it stays `exhausted`, with a `ReplayFailed`
    /// history record; nothing the handler wrote survives.
    Failed(String),
}

/// Dispatches the event once through the handler and resolves the dead letter, in one
/// transaction; the resolution is a compare-and-set, so if another command changed the dead
/// letter meanwhile everything is rolled back ([`DlqError::Race`]).
pub async fn replay(
    store: &Store,
    prepared: PreparedReplay,
    dl: &DeadLetter,
    actor: &str,
) -> Result<Replayed, DlqError> {
    let (p, n) = (dl.perspective_name.as_str(), dl.global_position);
    match dispatch(store, &prepared.handler, dl, prepared.event, actor).await? {
        Dispatch::Resolved => Ok(Replayed::Resolved),
        Dispatch::Lost => Err(DlqError::Race(n)),
        Dispatch::Rebuilding => Err(DlqError::BeingRebuilt(p.to_owned())),
        Dispatch::AlreadyQueued => Err(DlqError::AlreadyQueued {
            position: n,
            perspective: p.to_owned(),
            verb: "replaying",
        }),
        // The database went away mid-replay: not the event's fault, nothing to record.
        Dispatch::Failed(ApplyError::Unavailable(e)) => Err(DlqError::UnavailableDuringReplay {
            target: store.target().to_string(),
            position: n,
            error: e.to_string(),
        }),
        Dispatch::Failed(error) => {
            let error = crate::text::cap(error.message()).into_owned();
            if !store
                .record_replay_failure(dl.dead_letter_id, actor, &error)
                .await?
            {
                // Purged or replayed by someone else while this replay ran.
                return Err(DlqError::Race(n));
            }
            Ok(Replayed::Failed(error))
        }
    }
}

/// What one dispatch came to.
enum Dispatch {
    /// Applied and resolved, committed together.
    Resolved,
    /// Applied, but the dead letter had stopped being open: rolled back.
    Lost,
    /// The handler failed: rolled back.
    Failed(ApplyError),
    /// The perspective is being rebuilt: nothing ran.
    Rebuilding,
    /// A work row for the event exists (it is queued again): nothing ran.
    AlreadyQueued,
}

/// Applies the event and resolves the dead letter in one transaction. The transaction holds the
/// perspective's rebuild lock shared, so a rebuild cannot reset and re-queue under it.
async fn dispatch(
    store: &Store,
    handler: &SqlPerspective,
    dl: &DeadLetter,
    event: StoredEvent,
    actor: &str,
) -> Result<Dispatch, StoreError> {
    let envelope = EventEnvelope {
        event_work_id: dl.source_id,
        perspective_name: dl.perspective_name.clone(),
        event_id: event.event_id,
        stream_id: event.stream_id,
        stream_version: event.stream_version,
        global_position: event.global_position,
        event_type: event.event_type,
        data: event.event_data,
        metadata: event.metadata,
        attempts: dl.attempts_when_dlq,
        failures: dl.failures_when_dlq,
    };
    let mut tx = store.pool().begin().await?;
    // Held until commit: no rebuild resets and re-queues the perspective under this replay.
    if !Store::try_lock_perspective_shared_in(&mut tx, &dl.perspective_name).await? {
        return Ok(Dispatch::Rebuilding);
    }
    if Store::is_queued_in(&mut tx, &dl.perspective_name, dl.event_id).await? {
        return Ok(Dispatch::AlreadyQueued);
    }
    if let Err(e) = handler
        .apply(&envelope, &mut ApplyTx::postgres(&mut tx))
        .await
    {
        tx.rollback().await?;
        return Ok(Dispatch::Failed(e));
    }
    if !resolve_dead_letter_in(&mut tx, dl.dead_letter_id, actor).await? {
        tx.rollback().await?;
        return Ok(Dispatch::Lost);
    }
    tx.commit().await?;
    Ok(Dispatch::Resolved)
}

// ---------------------------------------------------------------------------------------------
// Replay dry run

/// Rows of a dry run's preview at most; each value of a row (written, before, after,
/// returned) and the error are capped at [`crate::text::MAX_TEXT`] bytes, so a dry run's memory
/// is bounded whatever the read model holds.
pub const DRY_RUN_ROWS: i64 = 50;

/// One read-model row a replay would write: its table, primary key, and the row before and
/// after (`None`: absent; both `None` with no key: the table has no primary key, see `row`).
#[derive(Clone, Debug, PartialEq)]
pub struct RowChange {
    /// The table.
    pub table: String,
    /// Its primary key columns (`None`: it has none, so before and after cannot be read).
    pub key: Option<Vec<String>>,
    /// The row before the statement, as JSON text (`None`: there was none: an insert).
    pub before: Option<String>,
    /// The row after it, as JSON text (`None`: there is none any more: a delete).
    pub after: Option<String>,
    /// The row as the statement's RETURNING saw it, as JSON text.
    pub written: String,
}

/// What the statement's effect could be shown as.
#[derive(Clone, Debug, PartialEq)]
pub enum Preview {
    /// The rows it inserts, updates or deletes, before and after.
    Rows(Vec<RowChange>),
    /// It returns rows of its own (a RETURNING clause, a SELECT): those, as JSON text.
    Returned(Vec<String>),
    /// Neither could be read; the statement ran (or failed) all the same.
    Unavailable,
}

/// What a replay would come to, found by running it in a transaction that is rolled back.
#[derive(Clone, Debug, PartialEq)]
pub struct DryRun {
    /// `None`: the handler succeeds (the replay would resolve the dead letter); otherwise the
    /// error it fails with (the replay would fail again).
    pub error: Option<String>,
    /// What it writes (when it succeeds).
    pub preview: Preview,
}

/// Runs the handler on the event in a transaction that is always rolled back, and reports what
/// it would change or the error it would fail with. Nothing is committed and no history is
/// written. The statement runs twice in that transaction: once wrapped with `RETURNING` (rolled
/// back to a savepoint) to learn which rows it writes, then as the handler runs it, between
/// two reads of those rows by primary key (before and after). Sequences it advances stay
/// advanced (PostgreSQL never rolls them back).
pub async fn dry_run(
    store: &Store,
    prepared: &PreparedReplay,
    dl: &DeadLetter,
) -> Result<DryRun, DlqError> {
    use crate::store::dry_run as dr;

    let event = &prepared.event;
    let envelope = EventEnvelope {
        event_work_id: dl.source_id,
        perspective_name: dl.perspective_name.clone(),
        event_id: event.event_id,
        stream_id: event.stream_id,
        stream_version: event.stream_version,
        global_position: event.global_position,
        event_type: event.event_type.clone(),
        data: event.event_data.clone(),
        metadata: event.metadata.clone(),
        attempts: dl.attempts_when_dlq,
        failures: dl.failures_when_dlq,
    };
    let params = dr::EventParams {
        data: envelope.data.clone(),
        stream_id: envelope.stream_id,
        event_id: envelope.event_id,
        event_type: envelope.event_type.clone(),
        global_position: envelope.global_position,
        stream_version: envelope.stream_version,
        metadata: envelope.metadata.clone(),
    };
    let statement = prepared
        .handler
        .statement(&envelope.event_type)
        .unwrap_or_default()
        .to_owned();

    let mut tx = store.pool().begin().await.map_err(StoreError::from)?;
    dr::savepoint_in(&mut tx).await?;
    let written = dr::written_rows_in(&mut tx, &statement, &params, DRY_RUN_ROWS)
        .await
        .ok();
    dr::rollback_to_in(&mut tx).await?;
    let returned = if written.is_none() {
        let r = dr::returned_rows_in(&mut tx, &statement, &params, DRY_RUN_ROWS)
            .await
            .ok();
        dr::rollback_to_in(&mut tx).await?;
        r
    } else {
        None
    };

    // Before: each written row's table row by primary key, as it is now.
    let mut changes = Vec::new();
    for w in written.iter().flatten() {
        let key = dr::primary_key_in(&mut tx, w.table_oid).await?;
        let before = match (&key, &w.key) {
            (Some(_), Some(k)) => dr::read_model_row_in(&mut tx, w.table_oid, k).await?,
            _ => None,
        };
        changes.push((w.clone(), key, before));
    }

    // The handler, as a replay runs it.
    let applied = prepared
        .handler
        .apply(&envelope, &mut ApplyTx::postgres(&mut tx))
        .await;
    let result = match applied {
        Err(e) => DryRun {
            error: Some(crate::text::cap(e.message()).into_owned()),
            preview: Preview::Unavailable,
        },
        Ok(()) => {
            let preview = match (written, returned) {
                (Some(_), _) => {
                    let mut rows = Vec::with_capacity(changes.len());
                    for (w, key, before) in changes {
                        let after = match (&key, &w.key) {
                            (Some(_), Some(k)) => {
                                dr::read_model_row_in(&mut tx, w.table_oid, k).await?
                            }
                            _ => None,
                        };
                        rows.push(RowChange {
                            table: w.table,
                            key,
                            before,
                            after,
                            written: w.row,
                        });
                    }
                    Preview::Rows(rows)
                }
                (None, Some(returned)) => Preview::Returned(returned),
                (None, None) => Preview::Unavailable,
            };
            DryRun {
                error: None,
                preview,
            }
        }
    };
    // Whatever happened, nothing stays.
    tx.rollback().await.map_err(StoreError::from)?;
    Ok(result)
}

// ---------------------------------------------------------------------------------------------
// Requeue and purge

/// What one requeue came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requeued {
    /// Handed back to the daemon, attempts reset, `Requeued` in the history.
    Requeued,
    /// It was no longer open (another command changed it): nothing done.
    Lost,
    /// A work row for its event exists: requeuing would apply it twice. Nothing done.
    AlreadyQueued,
    /// Its perspective is being rebuilt: nothing done.
    Rebuilding,
}

/// Requeues one dead letter (the compare-and-set of `requeue_dead_letter`).
pub async fn requeue(store: &Store, dl: &DeadLetter, actor: &str) -> Result<Requeued, StoreError> {
    match store.requeue_dead_letter(dl.dead_letter_id, actor).await {
        Ok(true) => Ok(Requeued::Requeued),
        Ok(false) => Ok(Requeued::Lost),
        Err(e) if e.is_already_queued() => Ok(Requeued::AlreadyQueued),
        Err(e) if e.is_rebuild_in_progress() => Ok(Requeued::Rebuilding),
        Err(e) => Err(e),
    }
}

/// Purges one dead letter (compare-and-set, terminal; the history keeps a `Purged` record).
/// Needs no handler and reads no event. False if it was no longer open: nothing done.
pub async fn purge(store: &Store, dl: &DeadLetter, actor: &str) -> Result<bool, StoreError> {
    store.purge_dead_letter(dl.dead_letter_id, actor).await
}
