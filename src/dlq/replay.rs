//! The replay: the event once more through its perspective's handler, and the dead letter
//! resolved in the same transaction.

use super::{check_not_queued, reread, DlqError};
use crate::config::PerspectiveSettings;
use crate::perspective::{ApplyError, ApplyTx, EventEnvelope, Perspective, SqlPerspective};
use crate::store::{resolve_dead_letter_in, DeadLetter, Store, StoreError, StoredEvent};

/// A replay that can run: the perspective's handler from the configuration, and the event
/// re-read live. Made by [`prepare_replay`].
pub struct PreparedReplay {
    pub(super) handler: SqlPerspective,
    pub(super) event: StoredEvent,
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
    let envelope = envelope(dl, event);
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

/// The envelope the handler sees for the dead letter's event: as the daemon gave it the last
/// time, with the attempts and failures it had when it was dead-lettered.
pub(super) fn envelope(dl: &DeadLetter, event: StoredEvent) -> EventEnvelope {
    EventEnvelope {
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
        // An operator's retry of an event whose apply never committed: its effects are wanted
        // (docs/pipeline.md, "Replays").
        replay: false,
    }
}
