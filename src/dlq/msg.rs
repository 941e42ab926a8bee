//! What the dead-letter operations say (docs/cli.md, "vantage dlq"), defined once for
//! `vantage dlq` and the console.

/// Says: `No perspective named '{name}' is registered.`
pub fn unknown_perspective(name: &str) -> String {
    format!("No perspective named '{name}' is registered.")
}
/// Says: `No dead-lettered event at position {position}.`
pub fn no_dead_letter(position: i64) -> String {
    format!("No dead-lettered event at position {position}.")
}
/// Says: `Could not re-read the event at position {position}.`
pub fn cannot_reread(position: i64) -> String {
    format!("Could not re-read the event at position {position}.")
}
/// Says: `Position {position} is dead-lettered in several perspectives ({}). Pass --perspective to choose one.`
pub fn ambiguous(position: i64, perspectives: &[&str]) -> String {
    format!(
        "Position {position} is dead-lettered in several perspectives ({}). Pass --perspective to choose one.",
        perspectives.join(", ")
    )
}
/// Says: `Position {position} is no longer dead-lettered: another command changed it while this one was waiting. Nothing was done.`
pub fn race(position: i64) -> String {
    format!("Position {position} is no longer dead-lettered: another command changed it while this one was waiting. Nothing was done.")
}
/// Says: `Perspective '{perspective}' has no handler in this configuration; cannot replay position {position}.`
pub fn no_handler(perspective: &str, position: i64) -> String {
    format!("Perspective '{perspective}' has no handler in this configuration; cannot replay position {position}.")
}
/// Says: `Perspective '{perspective}' has no statement for event type '{event_type}' in this configuration; cannot replay position {position}.`
pub fn no_statement(perspective: &str, event_type: &str, position: i64) -> String {
    format!("Perspective '{perspective}' has no statement for event type '{event_type}' in this configuration; cannot replay position {position}.")
}
/// Says: `Warning: replay re-runs the handler's side effects out of order: '{perspective}' applies position {position} now, after later events of its stream may already have been applied.`
pub fn replay_warning(perspective: &str, position: i64) -> String {
    format!("Warning: replay re-runs the handler's side effects out of order: '{perspective}' applies position {position} now, after later events of its stream may already have been applied.")
}
/// Says: `Replay dead-lettered position {position} through '{perspective}'? [y/N]`
pub fn replay_prompt(position: i64, perspective: &str) -> String {
    format!("Replay dead-lettered position {position} through '{perspective}'? [y/N]")
}
/// Says: `Replayed position {position} through '{perspective}': resolved.`
pub fn replayed(position: i64, perspective: &str) -> String {
    format!("Replayed position {position} through '{perspective}': resolved.")
}
/// Says: `Replay of position {position} failed again: {error}. It stays dead-lettered.`
pub fn replay_failed(position: i64, error: &str) -> String {
    format!("Replay of position {position} failed again: {error}. It stays dead-lettered.")
}
/// Says: `Purge dead-lettered position {position}? A terminal record is kept in the history. [y/N]`
pub fn purge_prompt(position: i64) -> String {
    format!(
        "Purge dead-lettered position {position}? A terminal record is kept in the history. [y/N]"
    )
}
/// Says: `Purged position {position}.`
pub fn purged(position: i64) -> String {
    format!("Purged position {position}.")
}
/// Says: `No dead-lettered events.`
pub fn none_listed() -> &'static str {
    "No dead-lettered events."
}
/// Says: `{events} dead-lettered event(s) across {perspectives} perspective(s).`
pub fn listed(events: usize, perspectives: usize) -> String {
    format!("{events} dead-lettered event(s) across {perspectives} perspective(s).")
}
/// Says: `Requeue dead-lettered position {position} of '{perspective}'? [y/N]`
pub fn requeue_prompt_one(position: i64, perspective: &str) -> String {
    format!("Requeue dead-lettered position {position} of '{perspective}'? [y/N]")
}
/// Says: `Requeue {count} dead-lettered event(s)? [y/N]`
pub fn requeue_prompt_many(count: usize) -> String {
    format!("Requeue {count} dead-lettered event(s)? [y/N]")
}
/// Says: `Counting the matching dead letters took longer than the database's statement_timeout, and a bulk action needs the count. Nothing was done; narrow the filter and try again.`
pub fn count_timed_out() -> &'static str {
    "Counting the matching dead letters took longer than the database's statement_timeout, and a bulk action needs the count. Nothing was done; narrow the filter and try again."
}
/// Says: `No dead-lettered events match; nothing to requeue.`
pub fn none_to_requeue() -> &'static str {
    "No dead-lettered events match; nothing to requeue."
}
/// Says: `Would requeue {count} dead-lettered event(s) (dry run; nothing was changed):`
pub fn would_requeue(count: usize) -> String {
    format!("Would requeue {count} dead-lettered event(s) (dry run; nothing was changed):")
}
/// Says: `{count} dead-lettered event(s) to requeue:`
pub fn will_requeue(count: usize) -> String {
    format!("{count} dead-lettered event(s) to requeue:")
}
/// Says: `Requeued position {position} of '{perspective}'.`
pub fn requeued_one(position: i64, perspective: &str) -> String {
    format!("Requeued position {position} of '{perspective}'.")
}
/// Says: `Position {position} of '{perspective}' is no longer dead-lettered; skipped.`
pub fn skipped_one(position: i64, perspective: &str) -> String {
    format!("Position {position} of '{perspective}' is no longer dead-lettered; skipped.")
}
/// Says: `Requeued {requeued} of {count} dead-lettered event(s).`
pub fn requeued_total(requeued: usize, count: usize) -> String {
    format!("Requeued {requeued} of {count} dead-lettered event(s).")
}
/// Says: `Position {position} of '{perspective}' is already queued for the daemon (a work row for its event exists), so {verb} it would apply it twice. Nothing was done; purge the dead letter if the queued event should stand.`
pub fn already_queued(position: i64, perspective: &str, verb: &str) -> String {
    format!("Position {position} of '{perspective}' is already queued for the daemon (a work row for its event exists), so {verb} it would apply it twice. Nothing was done; purge the dead letter if the queued event should stand.")
}
/// Says: `Perspective '{perspective}' is being rebuilt; try again when 'vantage perspectives rebuild {perspective}' has finished. Nothing was done.`
pub fn being_rebuilt(perspective: &str) -> String {
    format!("Perspective '{perspective}' is being rebuilt; try again when `vantage perspectives rebuild {perspective}` has finished. Nothing was done.")
}
/// Says: `Position {position} of '{perspective}' is already queued for the daemon; skipped.`
pub fn skipped_queued(position: i64, perspective: &str) -> String {
    format!("Position {position} of '{perspective}' is already queued for the daemon; skipped.")
}
/// Says: `{skipped} of {count} dead-lettered event(s) were already queued for the daemon: requeuing them would apply them twice. They were skipped.`
pub fn requeue_partial_queued(skipped: usize, count: usize) -> String {
    format!("{skipped} of {count} dead-lettered event(s) were already queued for the daemon: requeuing them would apply them twice. They were skipped.")
}
/// Says: `{skipped} of {count} dead-lettered event(s) were no longer dead-lettered: another command changed them while this one was waiting. They were skipped.`
pub fn requeue_partial(skipped: usize, count: usize) -> String {
    format!("{skipped} of {count} dead-lettered event(s) were no longer dead-lettered: another command changed them while this one was waiting. They were skipped.")
}
/// Says: `No dead-lettered events match; nothing to purge.`
pub fn none_to_purge() -> &'static str {
    "No dead-lettered events match; nothing to purge."
}
/// Says: `Would purge {count} dead-lettered event(s) (dry run; nothing was changed):`
pub fn would_purge(count: usize) -> String {
    format!("Would purge {count} dead-lettered event(s) (dry run; nothing was changed):")
}
/// Says: `{count} dead-lettered event(s) to purge:`
pub fn will_purge(count: usize) -> String {
    format!("{count} dead-lettered event(s) to purge:")
}
/// Says: `Purge {count} dead-lettered event(s)? A terminal record is kept in the history. [y/N]`
pub fn purge_prompt_many(count: usize) -> String {
    format!("Purge {count} dead-lettered event(s)? A terminal record is kept in the history. [y/N]")
}
/// Says: `Purged position {position} of '{perspective}'.`
pub fn purged_one(position: i64, perspective: &str) -> String {
    format!("Purged position {position} of '{perspective}'.")
}
/// Says: `Purged {purged} of {count} dead-lettered event(s).`
pub fn purged_total(purged: usize, count: usize) -> String {
    format!("Purged {purged} of {count} dead-lettered event(s).")
}
/// Says: `  … and {more} more (only the first {listed} are listed; the count covers them all)`
pub fn and_more_listed(more: usize, listed: usize) -> String {
    format!("  … and {more} more (only the first {listed} are listed; the count covers them all)")
}
/// Says: `{more} more match beyond --limit; they are left as they are.`
pub fn beyond_limit(more: usize) -> String {
    format!("{more} more match beyond --limit; they are left as they are.")
}
/// Says: `{done_key}: {seen} of {count} processed`
pub fn progress(done_key: &str, seen: usize, count: usize) -> String {
    format!("{done_key}: {seen} of {count} processed")
}
/// Says: `Interrupted: {done} of {count} dead-lettered event(s) {done_key}; each one is either done or untouched. Run the command again for the rest.`
pub fn bulk_interrupted(done: usize, count: usize, done_key: &str) -> String {
    format!("Interrupted: {done} of {count} dead-lettered event(s) {done_key}; each one is either done or untouched. Run the command again for the rest.")
}
/// Says: `{events} dead-lettered event(s) in {groups} error group(s).`
pub fn grouped(events: i64, groups: usize) -> String {
    format!("{events} dead-lettered event(s) in {groups} error group(s).")
}
/// Says: `Biggest group: vantage dlq inspect {sample} --perspective {perspective}; vantage dlq replay {sample} --perspective {perspective} --dry-run; vantage dlq requeue --group {fingerprint} --dry-run`
pub fn groups_hint(fingerprint: &str, sample: i64, perspective: &str) -> String {
    format!("Biggest group: vantage dlq inspect {sample} --perspective {perspective}; vantage dlq replay {sample} --perspective {perspective} --dry-run; vantage dlq requeue --group {fingerprint} --dry-run")
}
/// Says: `Dry run of the replay of position {position} through '{perspective}' (in a transaction that was rolled back: nothing was written, no history).`
pub fn dry_run_header(position: i64, perspective: &str) -> String {
    format!("Dry run of the replay of position {position} through '{perspective}' (in a transaction that was rolled back: nothing was written, no history).")
}
/// Says: `The handler succeeds: a replay would resolve position {position}.`
pub fn dry_run_would_resolve(position: i64) -> String {
    format!("The handler succeeds: a replay would resolve position {position}.")
}
/// Says: `The handler fails: {error}`
pub fn dry_run_would_fail(error: &str) -> String {
    format!("The handler fails: {error}")
}
/// Says: `A replay of position {position} would fail again: {error}. Nothing was done.`
pub fn dry_run_failed(position: i64, error: &str) -> String {
    format!("A replay of position {position} would fail again: {error}. Nothing was done.")
}
/// Says: `To replay it: vantage dlq replay {position} --perspective {perspective}`
pub fn dry_run_footer(position: i64, perspective: &str) -> String {
    format!("To replay it: vantage dlq replay {position} --perspective {perspective}")
}
