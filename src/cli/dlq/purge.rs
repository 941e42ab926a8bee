//! `vantage dlq purge`: close a dead letter (or, with `--group FINGERPRINT`, every open one of
//! an error group: count, `--dry-run`, confirmation, `--limit N`, see [`super::bulk`]) for good. Runs no handler and reads no event, so it
//! works for an event that can no longer be read; the history keeps a terminal record.

use serde_json::{json, Value};

use super::bulk::{self, describe, BulkAction, Selection};
use super::{msg, target_json, Ctx, PurgeArgs};
use crate::cli::output::{self, confirm, operator_actor, Confirmed, Failure};
use crate::dlq::{self, check_perspective, resolve};
use crate::store::{DeadLetter, DeadLetterFilter, Store, StoreError};

pub(super) async fn run(ctx: &Ctx<'_>, args: PurgeArgs) -> Result<Value, Failure> {
    let Some(n) = args.position else {
        // --group: the bulk walk, bounded by --limit (see super::bulk).
        check_perspective(ctx.store, args.perspective.as_deref()).await?;
        let selection = Selection {
            filter: DeadLetterFilter {
                perspective: args.perspective.clone(),
                group: args.group.clone(),
                status: Some("exhausted".to_owned()),
                ..DeadLetterFilter::default()
            },
            limit: args.limit,
            dry_run: args.dry_run,
            yes: args.yes,
        };
        return bulk::run(ctx, BulkAction::Purge, selection).await;
    };
    let dl = resolve(ctx.store, n, args.perspective.as_deref(), None).await?;
    if args.dry_run {
        // A dry run of one position: the same listing as a bulk one, nothing changed.
        ctx.ui.say(msg::would_purge(1));
        ctx.ui.say(describe(&dl));
        return Ok(json!({
            "count": 1, "dry_run": true, "purged": 0,
            "items": [{
                "outcome": "would_purge",
                "perspective": dl.perspective_name,
                "position": dl.global_position,
                "reason": dl.failure_reason,
            }],
        }));
    }
    let confirmed = confirm(&msg::purge_prompt(n), args.yes).await?;
    if !purge(ctx.store, &dl, &operator_actor(), &confirmed)
        .await
        .map_err(|e| output::store_failure(&e))?
    {
        return Err(Failure::usage(msg::race(n)));
    }
    ctx.ui.say(msg::purged(n));
    let mut data = target_json(&dl);
    data.insert("outcome".into(), "purged".into());
    Ok(Value::Object(data))
}

/// The compare-and-set ([`dlq::purge`]); false if the dead letter was no longer open.
async fn purge(
    store: &Store,
    dl: &DeadLetter,
    actor: &str,
    _confirmed: &Confirmed,
) -> Result<bool, StoreError> {
    dlq::purge(store, dl, actor).await
}
