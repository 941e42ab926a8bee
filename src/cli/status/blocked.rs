//! `vantage status --blocked`: the lanes (stream × perspective) whose head is parked or failing
//! (`failures > 0`), the most events waiting first: the head's position, attempts, failures,
//! next retry, its error fingerprint (the group its dead letter will join), and how many events
//! wait behind it and since when. Then the totals per perspective (what the metrics
//! `vantage_blocked_lanes` and `vantage_blocked_events` export).

use chrono::{DateTime, Utc};
use serde_json::{json, Value};

use super::StatusArgs;
use crate::cli::output::{self, human_age, timestamp, Failure, Ui};
use crate::dlq::check_perspective;
use crate::store::Store;

/// `Paused: order_summary since … (3m 2s) by operator x@y: deploy`.
pub(super) fn paused_line(
    perspective: &str,
    since: &DateTime<Utc>,
    by: Option<&str>,
    reason: Option<&str>,
    age_seconds: f64,
) -> String {
    let mut line = format!(
        "Paused: '{perspective}' since {} ({} ago)",
        timestamp(since),
        human_age(age_seconds)
    );
    if let Some(by) = by {
        line.push_str(&format!(" by {by}"));
    }
    if let Some(reason) = reason {
        line.push_str(&format!(": {reason}"));
    }
    line.push_str(&format!(
        ". Its work waits, nothing is charged; resume with: vantage perspectives resume {perspective}"
    ));
    line
}

/// `2 blocked lane(s) holding 17 event(s) behind a parked or failing head: vantage status --blocked`
pub(super) fn summary_line(lanes: i64, events: i64) -> String {
    format!(
        "{lanes} blocked lane(s) holding {events} event(s) behind a parked or failing head: vantage status --blocked"
    )
}

pub(super) async fn run(store: &Store, ui: &Ui, args: &StatusArgs) -> Result<Value, Failure> {
    let perspective = args.perspective.as_deref();
    check_perspective(store, perspective).await?;
    let read = async {
        Ok::<_, crate::store::StoreError>((
            store
                .blocked_lanes(perspective, i64::from(args.limit))
                .await?,
            store.blocked_totals(perspective).await?,
            store.database_now().await?,
        ))
    }
    .await;
    let (lanes, totals, now) = read.map_err(|e| output::store_failure(&e))?;
    let age = |t: &DateTime<Utc>| human_age((now - *t).num_milliseconds() as f64 / 1000.0);

    let total_lanes: i64 = totals.iter().map(|t| t.lanes).sum();
    let total_events: i64 = totals.iter().map(|t| t.events).sum();
    if lanes.is_empty() {
        ui.say("No blocked lanes.");
    } else {
        let mut t = output::table(&[
            "Perspective",
            "Stream",
            "Head",
            "Event type",
            "Attempts",
            "Failures",
            "Next retry",
            "Group",
            "Waiting",
            "Waiting since",
        ]);
        for l in &lanes {
            let next = if l.leased {
                "retrying now".to_owned()
            } else {
                match l.next_retry_at {
                    Some(at) if at > now => format!(
                        "in {}",
                        human_age((at - now).num_milliseconds() as f64 / 1000.0)
                    ),
                    Some(_) => "due".to_owned(),
                    None => "-".to_owned(),
                }
            };
            t.add_row(vec![
                l.perspective_name.clone(),
                l.stream_id.to_string(),
                l.head_position.to_string(),
                l.event_type.clone().unwrap_or_else(|| "-".to_owned()),
                l.attempts.to_string(),
                l.failures.to_string(),
                next,
                l.fingerprint.clone(),
                l.waiting.to_string(),
                l.waiting_since
                    .map(|t| format!("{} ago", age(&t)))
                    .unwrap_or_else(|| "-".to_owned()),
            ]);
        }
        output::align_right(&mut t, &[2, 4, 5, 8]);
        ui.say(t);
        if (lanes.len() as i64) < total_lanes {
            ui.say(format!(
                "Showing the {} lane(s) with the most events waiting (--limit).",
                lanes.len()
            ));
        }
        ui.say(format!(
            "{total_lanes} blocked lane(s) holding {total_events} event(s) in {} perspective(s).",
            totals.len()
        ));
        ui.say("A failing head is retried at its next retry; once dead-lettered it joins its error group (the Group column) in: vantage dlq groups");
    }

    let lanes: Vec<Value> = lanes
        .iter()
        .map(|l| {
            json!({
                "attempts": l.attempts,
                "event_type": l.event_type,
                "failures": l.failures,
                "fingerprint": l.fingerprint,
                "head_position": l.head_position,
                "head_queued_at": timestamp(&l.head_queued_at),
                "head_version": l.head_version,
                "last_error": l.last_error,
                "leased": l.leased,
                "next_retry_at": l.next_retry_at.as_ref().map(timestamp),
                "perspective": l.perspective_name,
                "stream_id": l.stream_id.to_string(),
                "waiting": l.waiting,
                "waiting_since": l.waiting_since.as_ref().map(timestamp),
            })
        })
        .collect();
    let totals: Vec<Value> = totals
        .iter()
        .map(|t| json!({"events": t.events, "lanes": t.lanes, "perspective": t.perspective_name}))
        .collect();
    Ok(json!({"lanes": lanes, "totals": totals}))
}
