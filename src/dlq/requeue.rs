//! Requeue and purge: the two actions that need no handler.

use crate::store::{DeadLetter, Store, StoreError};

/// What one requeue came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requeued {
    /// Handed back to the daemon, attempts reset, `Requeued` in the history.
    HandedBack,
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
        Ok(true) => Ok(Requeued::HandedBack),
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
