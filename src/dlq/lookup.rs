//! Finding the dead letter an operator names, and the checks every action makes first.

use super::DlqError;
use crate::store::{DeadLetter, Store, StoredEvent};

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
