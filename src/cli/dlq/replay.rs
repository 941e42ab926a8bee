//! `vantage dlq replay`: dispatch a dead-lettered event once more through its perspective's
//! handler, in this process.
//!
//! The handler's effects and the resolution commit in one transaction, and the resolution is a
//! compare-and-set: if another command changed the dead letter meanwhile, the transaction is
//! rolled back and nothing the handler wrote survives. A replay that cannot run anything (no
//! handler, no statement for the event's type) is refused rather than recorded as resolved.
//!
//! A replay never applies an event twice: it refuses while the perspective is being rebuilt
//! (the transaction holds the rebuild lock shared, so a rebuild cannot reset and re-queue under
//! it) and when the event is queued for the daemon again (a work row for it exists).

use serde_json::Value;

use super::{check_not_queued, msg, reread, resolve, target_json, Ctx, ReplayArgs};
use crate::cli::output::{self, confirm, operator_actor, Confirmed, Failure};
use crate::perspective::{ApplyError, EventEnvelope, Perspective, SqlPerspective};
use crate::store::{resolve_dead_letter_in, DeadLetter, Store, StoreError, StoredEvent};

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

pub(super) async fn run(ctx: &Ctx<'_>, args: ReplayArgs) -> Result<Value, Failure> {
    let n = args.target.position;
    let dl = resolve(ctx.store, n, args.target.perspective.as_deref(), None).await?;
    let p = dl.perspective_name.clone();
    let Some(settings) = ctx.settings.perspectives.iter().find(|s| s.name == p) else {
        return Err(Failure::usage(msg::no_handler(&p, n)));
    };
    let handler = SqlPerspective::from_settings(settings);
    let event = reread(ctx.store, &dl).await?;
    if handler.statement(&event.event_type).is_none() {
        return Err(Failure::usage(msg::no_statement(&p, &event.event_type, n)));
    }
    check_not_queued(ctx.store, &dl, "replaying").await?;

    ctx.ui.note(msg::replay_warning(&p, n));
    let confirmed = confirm(&msg::replay_prompt(n, &p), args.yes).await?;
    let actor = operator_actor();

    let mut data = target_json(&dl);
    match dispatch(ctx.store, &handler, &dl, event, &actor, &confirmed)
        .await
        .map_err(|e| output::store_failure(&e))?
    {
        Dispatch::Resolved => {
            ctx.ui.say(msg::replayed(n, &p));
            data.insert("outcome".into(), "resolved".into());
            Ok(Value::Object(data))
        }
        Dispatch::Lost => Err(Failure::usage(msg::race(n))),
        Dispatch::Rebuilding => Err(Failure::usage(msg::being_rebuilt(&p))),
        Dispatch::AlreadyQueued => Err(Failure::usage(msg::already_queued(n, &p, "replaying"))),
        // The database went away mid-replay: not the event's fault, nothing to record.
        Dispatch::Failed(ApplyError::Unavailable(e)) => Err(Failure::usage(format!(
            "Database unreachable at {} during the replay of position {n}: {e}. Nothing was done.",
            ctx.store.target()
        ))),
        Dispatch::Failed(error) => {
            let error = error.message().to_owned();
            let recorded = ctx
                .store
                .record_replay_failure(dl.dead_letter_id, &actor, &error)
                .await
                .map_err(|e| output::store_failure(&e))?;
            if !recorded {
                // Purged or replayed by someone else while this replay ran.
                return Err(Failure::usage(msg::race(n)));
            }
            let mut failure = Failure::failed(msg::replay_failed(n, &error));
            failure.data = data;
            Err(failure
                .with("outcome", "failed")
                .with("replay_error", error))
        }
    }
}

/// Applies the event and resolves the dead letter in one transaction (the only way this
/// command changes anything, hence the token).
async fn dispatch(
    store: &Store,
    handler: &SqlPerspective,
    dl: &DeadLetter,
    event: StoredEvent,
    actor: &str,
    _confirmed: &Confirmed,
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
    if let Err(e) = handler.apply(&envelope, &mut tx).await {
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
