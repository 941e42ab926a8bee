//! `vantage dlq requeue`: hand dead letters back to the running daemon (attempts reset), one
//! by position or many with `--all` or `--group FINGERPRINT` and filters (`--limit N` bounds
//! them; see [`super::bulk`]). A bulk requeue shows the count first and confirms; `--dry-run`
//! shows what would be requeued and changes nothing.
//!
//! A requeue never queues an event twice: `requeue_dead_letter` refuses (and changes nothing)
//! when a work row for the event exists, and while the perspective is being rebuilt. A single
//! position is checked before asking too; a bulk requeue skips the ones already queued and
//! stops at a perspective being rebuilt.

use serde_json::{json, Value};

use super::bulk::{self, describe, BulkAction, Selection};
use super::{msg, Ctx, RequeueArgs};
use crate::cli::output::{self, confirm, operator_actor, Confirmed, Failure};
use crate::dlq::{self, check_not_queued, check_perspective, resolve, Requeued};
use crate::store::{DeadLetter, DeadLetterFilter, Store, StoreError};

pub(super) async fn run(ctx: &Ctx<'_>, args: RequeueArgs) -> Result<Value, Failure> {
    let perspective = args.perspective.as_deref();
    let reason = args.reason.as_deref();
    let Some(n) = args.position else {
        // --all or --group: the bulk walk, bounded by --limit.
        check_perspective(ctx.store, perspective).await?;
        let selection = Selection {
            filter: DeadLetterFilter {
                perspective: args.perspective.clone(),
                reason: args.reason.clone(),
                group: args.group.clone(),
                status: Some("exhausted".to_owned()),
                ..DeadLetterFilter::default()
            },
            limit: args.limit,
            dry_run: args.dry_run,
            yes: args.yes,
        };
        return bulk::run(ctx, BulkAction::Requeue, selection).await;
    };
    let dl = resolve(ctx.store, n, perspective, reason).await?;
    if !args.dry_run {
        check_not_queued(ctx.store, &dl, "requeuing").await?;
    }
    let item = |d: &DeadLetter, outcome: &str| {
        json!({
            "outcome": outcome,
            "perspective": d.perspective_name,
            "position": d.global_position,
            "reason": d.failure_reason,
        })
    };

    if args.dry_run {
        ctx.ui.say(msg::would_requeue(1));
        ctx.ui.say(describe(&dl));
        return Ok(
            json!({"count": 1, "dry_run": true, "items": [item(&dl, "would_requeue")], "requeued": 0}),
        );
    }

    let confirmed = confirm(&msg::requeue_prompt_one(n, &dl.perspective_name), args.yes).await?;
    let p = dl.perspective_name.as_str();
    match requeue(ctx.store, &dl, &operator_actor(), &confirmed).await {
        Ok(Requeued::HandedBack) => {
            ctx.ui.say(msg::requeued_one(n, p));
            Ok(
                json!({"count": 1, "dry_run": false, "items": [item(&dl, "requeued")], "requeued": 1}),
            )
        }
        Ok(Requeued::Lost) => Err(Failure::usage(msg::race(n))),
        Ok(Requeued::AlreadyQueued) => Err(Failure::usage(msg::already_queued(n, p, "requeuing"))),
        Ok(Requeued::Rebuilding) => Err(Failure::usage(msg::being_rebuilt(p)).with("requeued", 0)),
        Err(e) => Err(output::store_failure(&e).with("requeued", 0)),
    }
}

/// The compare-and-set ([`dlq::requeue`]): nothing changes unless it says `Requeued`.
async fn requeue(
    store: &Store,
    dl: &DeadLetter,
    actor: &str,
    _confirmed: &Confirmed,
) -> Result<Requeued, StoreError> {
    dlq::requeue(store, dl, actor).await
}
