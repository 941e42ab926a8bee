//! `vantage dlq replay`: dispatch a dead-lettered event once more through its perspective's
//! handler, in this process ([`crate::dlq::replay`], which the console calls too).
//!
//! The handler's effects and the resolution commit in one transaction, and the resolution is a
//! compare-and-set: if another command changed the dead letter meanwhile, the transaction is
//! rolled back and nothing the handler wrote survives. A replay that cannot run anything (no
//! handler, no statement for the event's type) is refused rather than recorded as resolved.
//!
//! `--dry-run` runs the handler in a transaction that is rolled back ([`dlq::dry_run`]) and
//! prints the read-model rows it would write, before and after, or the error it would fail
//! with; nothing is written and no history is recorded (exit 0, or 1 if it would fail).
//!
//! A replay never applies an event twice: it refuses while the perspective is being rebuilt
//! (the transaction holds the rebuild lock shared, so a rebuild cannot reset and re-queue under
//! it) and when the event is queued for the daemon again (a work row for it exists).

use serde_json::{json, Value};

use super::{msg, target_json, Ctx, ReplayArgs};
use crate::cli::output::{confirm, operator_actor, Confirmed, Failure};
use crate::dlq::{
    self, prepare_replay, resolve, DlqError, DryRun, PreparedReplay, Preview, Replayed,
};
use crate::store::{DeadLetter, Store};

pub(super) async fn run(ctx: &Ctx<'_>, args: ReplayArgs) -> Result<Value, Failure> {
    let n = args.target.position;
    let dl = resolve(ctx.store, n, args.target.perspective.as_deref(), None).await?;
    let p = dl.perspective_name.clone();
    let prepared = prepare_replay(ctx.store, &ctx.settings.perspectives, &dl).await?;
    if args.dry_run {
        let outcome = dlq::dry_run(ctx.store, &prepared, &dl).await?;
        return report_dry_run(ctx, &dl, outcome);
    }

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

/// Prints what a replay would change (or the error it would fail with): exit 0 when it would
/// resolve the dead letter, 1 when it would fail again.
fn report_dry_run(ctx: &Ctx<'_>, dl: &DeadLetter, outcome: DryRun) -> Result<Value, Failure> {
    let (n, p) = (dl.global_position, dl.perspective_name.as_str());
    let mut data = target_json(dl);
    data.insert("dry_run".into(), true.into());
    ctx.ui.say(msg::dry_run_header(n, p));
    if let Some(error) = outcome.error {
        ctx.ui.say(msg::dry_run_would_fail(&error));
        let mut failure = Failure::failed(msg::dry_run_failed(n, &error));
        failure.data = data;
        return Err(failure
            .with("outcome", "would_fail")
            .with("replay_error", error));
    }
    ctx.ui.say(msg::dry_run_would_resolve(n));
    let changes = match &outcome.preview {
        Preview::Rows(rows) if rows.is_empty() => {
            ctx.ui.say("It writes no row of the read model.");
            json!({"kind": "rows", "rows": []})
        }
        Preview::Rows(rows) => {
            ctx.ui.say(format!("Rows it would write ({}):", rows.len()));
            for r in rows {
                match &r.key {
                    Some(key) => {
                        ctx.ui
                            .say(format!("  {} (primary key {}):", r.table, key.join(", ")));
                        ctx.ui
                            .say(format!("    before: {}", row_text(r.before.as_ref())));
                        ctx.ui
                            .say(format!("    after:  {}", row_text(r.after.as_ref())));
                    }
                    None => {
                        ctx.ui
                            .say(format!("  {} (no primary key: before not known):", r.table));
                        ctx.ui.say(format!("    written: {}", r.written));
                    }
                }
            }
            json!({"kind": "rows", "rows": rows.iter().map(|r| json!({
                "after": r.after.as_deref().map(parse),
                "before": r.before.as_deref().map(parse),
                "key": r.key,
                "table": r.table,
                "written": parse(&r.written),
            })).collect::<Vec<_>>()})
        }
        Preview::Returned(rows) => {
            ctx.ui
                .say(format!("The statement returns ({}):", rows.len()));
            for r in rows {
                ctx.ui.say(format!("  {r}"));
            }
            json!({"kind": "returned", "rows": rows.iter().map(|r| parse(r)).collect::<Vec<_>>()})
        }
        Preview::Unavailable => {
            ctx.ui.say("Which rows it writes could not be read (the statement is not a plain INSERT, UPDATE or DELETE).");
            json!({"kind": "unavailable", "rows": []})
        }
    };
    ctx.ui.say(msg::dry_run_footer(n, p));
    data.insert("outcome".into(), "would_resolve".into());
    data.insert("changes".into(), changes);
    Ok(Value::Object(data))
}

fn row_text(row: Option<&String>) -> String {
    row.map_or_else(|| "(none)".to_owned(), String::clone)
}

/// A row's JSON text as a value for the envelope (the text output prints it exactly).
fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
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
