//! `vantage dlq replay`: dispatch a dead-lettered event once more through its perspective's
//! handler, in this process ([`crate::dlq::replay`], which the console calls too).
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

use super::{msg, target_json, Ctx, ReplayArgs};
use crate::cli::output::{confirm, operator_actor, Confirmed, Failure};
use crate::dlq::{self, prepare_replay, resolve, DlqError, PreparedReplay, Replayed};
use crate::store::{DeadLetter, Store};

pub(super) async fn run(ctx: &Ctx<'_>, args: ReplayArgs) -> Result<Value, Failure> {
    let n = args.target.position;
    let dl = resolve(ctx.store, n, args.target.perspective.as_deref(), None).await?;
    let p = dl.perspective_name.clone();
    let prepared = prepare_replay(ctx.store, &ctx.settings.perspectives, &dl).await?;

    ctx.ui.note(msg::replay_warning(&p, n));
    let confirmed = confirm(&msg::replay_prompt(n, &p), args.yes).await?;
    let actor = operator_actor();

    let mut data = target_json(&dl);
    match replay(ctx.store, prepared, &dl, &actor, &confirmed).await? {
        Replayed::Resolved => {
            ctx.ui.say(msg::replayed(n, &p));
            data.insert("outcome".into(), "resolved".into());
            Ok(Value::Object(data))
        }
        Replayed::Failed(error) => {
            let mut failure = Failure::failed(msg::replay_failed(n, &error));
            failure.data = data;
            Err(failure
                .with("outcome", "failed")
                .with("replay_error", error))
        }
    }
}

/// The only way this command changes anything, hence the token.
async fn replay(
    store: &Store,
    prepared: PreparedReplay,
    dl: &DeadLetter,
    actor: &str,
    _confirmed: &Confirmed,
) -> Result<Replayed, DlqError> {
    dlq::replay(store, prepared, dl, actor).await
}
