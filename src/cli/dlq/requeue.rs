//! `vantage dlq requeue`: hand dead letters back to the running daemon (attempts reset), one
//! by position or many with `--all` and filters. A bulk requeue shows the count first and
//! confirms; `--dry-run` shows what would be requeued and changes nothing.
//!
//! A requeue never queues an event twice: `requeue_dead_letter` refuses (and changes nothing)
//! when a work row for the event exists, and while the perspective is being rebuilt. A single
//! position is checked before asking too; a bulk requeue skips the ones already queued and
//! stops at a perspective being rebuilt.

use serde_json::{json, Value};

use super::{msg, Ctx, RequeueArgs};
use crate::cli::output::{self, confirm, operator_actor, Confirmed, Failure};
use crate::dlq::{self, check_not_queued, check_perspective, resolve, Requeued};
use crate::store::{DeadLetter, Store, StoreError};

pub(super) async fn run(ctx: &Ctx<'_>, args: RequeueArgs) -> Result<Value, Failure> {
    let perspective = args.perspective.as_deref();
    let reason = args.reason.as_deref();
    let letters = match args.position {
        Some(n) => {
            let dl = resolve(ctx.store, n, perspective, reason).await?;
            if !args.dry_run {
                check_not_queued(ctx.store, &dl, "requeuing").await?;
            }
            vec![dl]
        }
        None => {
            check_perspective(ctx.store, perspective).await?;
            let mut all = ctx
                .store
                .open_dead_letters(perspective)
                .await
                .map_err(|e| output::store_failure(&e))?;
            if let Some(reason) = reason {
                all.retain(|d| d.failure_reason == reason);
            }
            all
        }
    };
    let count = letters.len();
    let item = |d: &DeadLetter, outcome: &str| {
        json!({
            "outcome": outcome,
            "perspective": d.perspective_name,
            "position": d.global_position,
            "reason": d.failure_reason,
        })
    };

    if count == 0 {
        ctx.ui.say(msg::none_to_requeue());
        return Ok(json!({"count": 0, "dry_run": args.dry_run, "items": [], "requeued": 0}));
    }

    if args.dry_run {
        ctx.ui.say(msg::would_requeue(count));
        for d in &letters {
            ctx.ui.say(describe(d));
        }
        let items: Vec<Value> = letters.iter().map(|d| item(d, "would_requeue")).collect();
        return Ok(json!({"count": count, "dry_run": true, "items": items, "requeued": 0}));
    }

    let question = match (args.position, letters.first()) {
        (Some(n), Some(d)) => msg::requeue_prompt_one(n, &d.perspective_name),
        _ => {
            // The count (and what it covers) is shown before the operator is asked.
            ctx.ui.note(msg::will_requeue(count));
            for d in &letters {
                ctx.ui.note(describe(d));
            }
            msg::requeue_prompt_many(count)
        }
    };
    let confirmed = confirm(&question, args.yes).await?;
    let actor = operator_actor();

    let mut items = Vec::with_capacity(count);
    let mut requeued = 0;
    let mut queued = 0;
    for d in &letters {
        let (n, p) = (d.global_position, d.perspective_name.as_str());
        match requeue(ctx.store, d, &actor, &confirmed).await {
            Ok(Requeued::Requeued) => {
                requeued += 1;
                ctx.ui.say(msg::requeued_one(n, p));
                items.push(item(d, "requeued"));
            }
            Ok(Requeued::Lost) => {
                // A single position that lost the race gets the race message alone, below.
                if args.position.is_none() {
                    ctx.ui.say(msg::skipped_one(n, p));
                }
                items.push(item(d, "no_longer_dead_lettered"));
            }
            Ok(Requeued::AlreadyQueued) => {
                if args.position.is_some() {
                    return Err(Failure::usage(msg::already_queued(n, p, "requeuing")));
                }
                queued += 1;
                ctx.ui.say(msg::skipped_queued(n, p));
                items.push(item(d, "already_queued"));
            }
            Ok(Requeued::Rebuilding) => {
                return Err(Failure::usage(msg::being_rebuilt(p)).with("requeued", requeued));
            }
            Err(e) => return Err(output::store_failure(&e).with("requeued", requeued)),
        }
    }

    let data = json!({"count": count, "dry_run": false, "items": items, "requeued": requeued});
    match args.position {
        Some(n) if requeued == 0 => Err(Failure::usage(msg::race(n))),
        _ if requeued < count => {
            ctx.ui.say(msg::requeued_total(requeued, count));
            let lost = count - requeued - queued;
            let mut message = Vec::new();
            if lost > 0 {
                message.push(msg::requeue_partial(lost, count));
            }
            if queued > 0 {
                message.push(msg::requeue_partial_queued(queued, count));
            }
            let mut failure = Failure::usage(message.join(" "));
            if let Value::Object(m) = data {
                failure.data = m;
            }
            Err(failure)
        }
        Some(_) => Ok(data),
        None => {
            ctx.ui.say(msg::requeued_total(requeued, count));
            Ok(data)
        }
    }
}

/// `  position 42 of 'order_summary' (MaxAttemptsExceeded)`
fn describe(d: &DeadLetter) -> String {
    format!(
        "  position {} of '{}' ({})",
        d.global_position, d.perspective_name, d.failure_reason
    )
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
