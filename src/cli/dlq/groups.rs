//! `vantage dlq groups`: open dead letters grouped by error fingerprint (perspective, event
//! type, SQLSTATE, error text with its variable parts masked), biggest first. Grouped in the
//! database ([`Store::error_groups`](crate::store::Store::error_groups)); `requeue --group` and
//! `purge --group` act on one group.

use serde_json::{json, Value};

use super::{msg, Ctx, GroupsArgs};
use crate::cli::output::{self, timestamp, Failure};
use crate::dlq::check_perspective;

/// Characters of the masked message a table row shows (the JSON has it whole).
const MESSAGE_SHOWN: usize = 80;

pub(super) async fn run(ctx: &Ctx<'_>, args: GroupsArgs) -> Result<Value, Failure> {
    let perspective = args.perspective.as_deref();
    check_perspective(ctx.store, perspective).await?;
    let groups = ctx
        .store
        .error_groups(perspective)
        .await
        .map_err(|e| output::store_failure(&e))?;

    if groups.is_empty() {
        ctx.ui.say(msg::none_listed());
    } else {
        let mut t = output::table(&[
            "Group",
            "Perspective",
            "Event type",
            "SQLSTATE",
            "Count",
            "First seen",
            "Last seen",
            "Sample",
            "Error (masked)",
        ]);
        for g in &groups {
            t.add_row(vec![
                g.fingerprint.clone(),
                g.perspective_name.clone(),
                g.event_type.clone().unwrap_or_else(|| "-".to_owned()),
                g.sqlstate.clone().unwrap_or_else(|| "-".to_owned()),
                g.count.to_string(),
                timestamp(&g.first_seen),
                timestamp(&g.last_seen),
                g.sample_position.to_string(),
                output::shorten(&g.message, MESSAGE_SHOWN),
            ]);
        }
        output::align_right(&mut t, &[4, 7]);
        ctx.ui.say(t);
        let total: i64 = groups.iter().map(|g| g.count).sum();
        ctx.ui.say(msg::grouped(total, groups.len()));
        if let Some(first) = groups.first() {
            ctx.ui.say(msg::groups_hint(
                &first.fingerprint,
                first.sample_position,
                &first.perspective_name,
            ));
        }
    }

    let groups: Vec<Value> = groups
        .iter()
        .map(|g| {
            json!({
                "count": g.count,
                "event_type": g.event_type,
                "fingerprint": g.fingerprint,
                "first_seen": timestamp(&g.first_seen),
                "last_seen": timestamp(&g.last_seen),
                "message": g.message,
                "perspective": g.perspective_name,
                "sample_position": g.sample_position,
                "sqlstate": g.sqlstate,
            })
        })
        .collect();
    Ok(json!({ "groups": groups }))
}
