//! `vantage dlq inspect`: one dead letter, with its event re-read live from the event store.

use std::fmt::Write as _;

use serde_json::{json, Value};

use super::{Ctx, InspectArgs};
use crate::cli::output::{self, sort_keys, timestamp, Failure};
use crate::dlq::{reread, resolve};
use crate::store::{DeadLetter, HistoryEntry, StoredEvent};

/// Width of the label column of the human view.
const LABEL: usize = 18;

pub(super) async fn run(ctx: &Ctx<'_>, args: InspectArgs) -> Result<Value, Failure> {
    let dl = resolve(
        ctx.store,
        args.target.position,
        args.target.perspective.as_deref(),
        None,
    )
    .await?;
    let event = reread(ctx.store, &dl).await?;
    let history = ctx
        .store
        .dead_letter_history(dl.dead_letter_id)
        .await
        .map_err(|e| output::store_failure(&e))?;

    ctx.ui.say(render(&dl, &event, &history).trim_end());
    Ok(to_json(&dl, &event, &history))
}

/// Who dead-lettered it, for people.
fn by_whom(dl: &DeadLetter) -> String {
    match dl.dead_lettered_by {
        Some(instance) => format!("instance {instance}"),
        None => "(no instance recorded)".to_owned(),
    }
}

/// The human view: the event as read now, the dead letter, the history.
fn render(dl: &DeadLetter, event: &StoredEvent, history: &[HistoryEntry]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Dead-lettered position {} in perspective '{}'",
        dl.global_position, dl.perspective_name
    );
    out.push('\n');
    out.push_str("Event (read live from wh_event_store):\n");
    field(&mut out, "Type", &event.event_type);
    field(
        &mut out,
        "Global position",
        &event.global_position.to_string(),
    );
    field(&mut out, "Event id", &event.event_id.to_string());
    field(&mut out, "Stream", &event.stream_id.to_string());
    field(&mut out, "Version", &event.stream_version.to_string());
    field(&mut out, "Stored at", &timestamp(&event.created_at));
    let data = serde_json::to_string_pretty(&sort_keys(event.event_data.clone()))
        .unwrap_or_else(|_| event.event_data.to_string());
    // Each text of the human view is capped (crate::text::MAX_TEXT); --json has it all.
    let data = crate::text::cap(&data);
    out.push_str("  Data:\n");
    for line in data.lines() {
        let _ = writeln!(out, "    {line}");
    }
    if event.metadata.as_object().is_some_and(|m| !m.is_empty()) {
        field(
            &mut out,
            "Metadata",
            &sort_keys(event.metadata.clone()).to_string(),
        );
    }
    out.push('\n');
    out.push_str("Dead letter:\n");
    field(&mut out, "Reason", &dl.failure_reason);
    field(
        &mut out,
        "Error",
        &crate::text::cap(dl.error_text.as_deref().unwrap_or("(none recorded)")),
    );
    field(&mut out, "Attempts", &dl.attempts_when_dlq.to_string());
    field(&mut out, "Failures", &dl.failures_when_dlq.to_string());
    field(
        &mut out,
        "Dead-lettered at",
        &timestamp(&dl.dead_lettered_at),
    );
    field(&mut out, "Dead-lettered by", &by_whom(dl));
    field(&mut out, "Status", &dl.status);
    out.push('\n');
    out.push_str("History (oldest first):\n");
    if history.is_empty() {
        out.push_str("  (no records)\n");
    }
    for h in history {
        let _ = writeln!(out, "  {}  {} by {}", timestamp(&h.at), h.kind, h.actor);
        if let Some(detail) = &h.detail {
            for line in crate::text::cap(detail).lines() {
                let _ = writeln!(out, "      {line}");
            }
        }
    }
    out
}

/// `  Label:            value`, continuation lines of a multi-line value aligned under it.
fn field(out: &mut String, label: &str, value: &str) {
    let mut lines = value.lines();
    let first = lines.next().unwrap_or("");
    let _ = writeln!(out, "  {:<LABEL$}{first}", format!("{label}:"));
    for line in lines {
        let _ = writeln!(out, "  {:<LABEL$}{line}", "");
    }
}

fn to_json(dl: &DeadLetter, event: &StoredEvent, history: &[HistoryEntry]) -> Value {
    let history: Vec<Value> = history
        .iter()
        .map(|h| {
            json!({
                "actor": h.actor,
                "at": timestamp(&h.at),
                "detail": h.detail,
                "kind": h.kind,
            })
        })
        .collect();
    json!({
        "attempts": dl.attempts_when_dlq,
        "data": event.event_data,
        "dead_lettered_at": timestamp(&dl.dead_lettered_at),
        "dead_lettered_by": dl.dead_lettered_by.map(|i| i.to_string()),
        "error_text": dl.error_text,
        "event_id": event.event_id.to_string(),
        "failures": dl.failures_when_dlq,
        "global_position": event.global_position,
        "history": history,
        "metadata": event.metadata,
        "perspective": dl.perspective_name,
        "position": dl.global_position,
        "reason": dl.failure_reason,
        "stream_id": event.stream_id.to_string(),
        "stream_version": event.stream_version,
        "type": event.event_type,
    })
}
