//! Bulk requeue and purge (`requeue --all | --group FP`, `purge --group FP`), bounded by
//! `--limit N`: the count first (from the database, in one statement with the first page, so
//! both describe one moment), a dry run or a confirmation, then one compare-and-set per dead
//! letter, with progress.
//!
//! - The set is walked a page at a time by (perspective, position), so millions of dead letters
//!   are never loaded at once; the first page is read before the confirmation (it is what the
//!   listing shows), and a dead letter another command changed after that is skipped and counted.
//! - The walk acts on what was counted: the pages after the first only hold dead letters
//!   dead-lettered before the count (its `as_of`), and without `--limit` it goes on to the last
//!   page rather than stopping after as many items as were counted. Dead letters keep arriving
//!   while an operator reads the prompt, at positions among the counted ones; a walk that stopped
//!   at the count acted on those (never confirmed) and left as many counted ones untouched while
//!   saying it had done them all.
//! - Every item is its own statement (`requeue_dead_letter`, `purge_dead_letter`): an
//!   interrupted run leaves each dead letter either done or untouched, never half done. Ctrl-C
//!   stops after the item in flight, says how far it got (exit 130), and changes nothing more.
//! - Progress: a bar on stderr when stderr is a terminal (indicatif); otherwise a plain line
//!   every [`PROGRESS_EVERY`] items. Each item's own line goes to stdout as before.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Value};

use super::{msg, Ctx};
use crate::cli::exit;
use crate::cli::output::{self, confirm, operator_actor, Confirmed, Failure};
use crate::dlq::{self, Requeued};
use crate::store::{BulkOrder, DeadLetter, DeadLetterFilter, Store, StoreError};

/// Dead letters read per round trip.
const PAGE: i64 = 500;
/// Lines of the listing shown before the confirmation (the count covers them all).
const LISTED: usize = 100;
/// Lines of a dry run's listing (and items of its JSON); the count covers them all.
const DRY_RUN_LISTED: usize = 1000;
/// Without a terminal: one progress line on stderr per this many items.
const PROGRESS_EVERY: usize = 1000;

/// What a bulk run does to each dead letter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BulkAction {
    Requeue,
    Purge,
}

impl BulkAction {
    fn done_key(self) -> &'static str {
        match self {
            BulkAction::Requeue => "requeued",
            BulkAction::Purge => "purged",
        }
    }
    fn would(self) -> &'static str {
        match self {
            BulkAction::Requeue => "would_requeue",
            BulkAction::Purge => "would_purge",
        }
    }
}

/// Which dead letters, and how many at most.
pub(super) struct Selection {
    pub filter: DeadLetterFilter,
    pub limit: Option<u64>,
    pub dry_run: bool,
    pub yes: bool,
}

/// With `--limit`, the JSON also says how many matched in all.
fn with_matching(mut data: Value, sel: &Selection, matching: u64) -> Value {
    if sel.limit.is_some() {
        data["matching"] = matching.into();
    }
    data
}

/// One item of the JSON.
fn item(d: &DeadLetter, outcome: &str) -> Value {
    json!({
        "outcome": outcome,
        "perspective": d.perspective_name,
        "position": d.global_position,
        "reason": d.failure_reason,
    })
}

/// `  position 42 of 'order_summary' (MaxAttemptsExceeded)`
pub(super) fn describe(d: &DeadLetter) -> String {
    format!(
        "  position {} of '{}' ({})",
        d.global_position, d.perspective_name, d.failure_reason
    )
}

/// Reads the next page after `last`, at most `want`.
async fn page(
    store: &Store,
    filter: &DeadLetterFilter,
    last: Option<&DeadLetter>,
    want: usize,
) -> Result<Vec<DeadLetter>, Failure> {
    store
        .open_dead_letters_after(
            filter,
            last.map(|d| (d.perspective_name.as_str(), d.global_position)),
            PAGE.min(want as i64),
        )
        .await
        .map_err(|e| output::store_failure(&e))
}

pub(super) async fn run(
    ctx: &Ctx<'_>,
    action: BulkAction,
    mut sel: Selection,
) -> Result<Value, Failure> {
    let store = ctx.store;
    // The count and the first page in one statement, so the count shown and the listing under
    // it describe the same moment.
    let first_page = sel.limit.map_or(PAGE, |l| PAGE.min(l.max(1) as i64)) as u32;
    let counted = store
        .open_dead_letters_counted(&sel.filter, BulkOrder::PerspectivePosition, first_page)
        .await
        .map_err(|e| output::store_failure(&e))?
        .ok_or_else(|| Failure::usage(msg::count_timed_out()))?;
    let matching = counted.matching.max(0) as u64;
    // From here on every page is of what the count covered (see the module's doc).
    sel.filter.until = Some(
        sel.filter
            .until
            .map_or(counted.as_of, |u| u.min(counted.as_of)),
    );
    let target = sel.limit.map_or(matching, |l| l.min(matching)) as usize;
    let beyond = matching as usize - target;
    let done_key = action.done_key();

    if target == 0 {
        ctx.ui.say(match action {
            BulkAction::Requeue => msg::none_to_requeue(),
            BulkAction::Purge => msg::none_to_purge(),
        });
        return Ok(with_matching(
            json!({"count": 0, "dry_run": sel.dry_run, "items": [], done_key: 0}),
            &sel,
            matching,
        ));
    }

    let mut first = counted.first;
    first.truncate(target);

    if sel.dry_run {
        ctx.ui.say(match action {
            BulkAction::Requeue => msg::would_requeue(target),
            BulkAction::Purge => msg::would_purge(target),
        });
        let mut items = Vec::new();
        let mut shown = first;
        'listing: loop {
            for d in &shown {
                if items.len() >= target.min(DRY_RUN_LISTED) {
                    break 'listing;
                }
                ctx.ui.say(describe(d));
                items.push(item(d, action.would()));
            }
            if shown.is_empty() || items.len() >= target.min(DRY_RUN_LISTED) {
                break;
            }
            let next = page(store, &sel.filter, shown.last(), target - items.len()).await?;
            shown = next;
        }
        if items.len() < target {
            ctx.ui
                .say(msg::and_more_listed(target - items.len(), DRY_RUN_LISTED));
        }
        if beyond > 0 {
            ctx.ui.say(msg::beyond_limit(beyond));
        }
        return Ok(with_matching(
            json!({"count": target, "dry_run": true, "items": items, done_key: 0}),
            &sel,
            matching,
        ));
    }

    // The count (and what it covers) is shown before the operator is asked.
    ctx.ui.note(match action {
        BulkAction::Requeue => msg::will_requeue(target),
        BulkAction::Purge => msg::will_purge(target),
    });
    for d in first.iter().take(LISTED.min(target)) {
        ctx.ui.note(describe(d));
    }
    if target > LISTED.min(first.len()) {
        ctx.ui.note(msg::and_more_listed(
            target - LISTED.min(first.len()),
            LISTED,
        ));
    }
    if beyond > 0 {
        ctx.ui.note(msg::beyond_limit(beyond));
    }
    let question = match action {
        BulkAction::Requeue => msg::requeue_prompt_many(target),
        BulkAction::Purge => msg::purge_prompt_many(target),
    };
    let confirmed = confirm(&question, sel.yes).await?;
    act(ctx, action, &sel, first, (target, matching), &confirmed).await
}

/// What the walk came to.
#[derive(Default)]
struct Tally {
    done: usize,
    lost: usize,
    queued: usize,
    seen: usize,
}

async fn act(
    ctx: &Ctx<'_>,
    action: BulkAction,
    sel: &Selection,
    first: Vec<DeadLetter>,
    (target, matching): (usize, u64),
    confirmed: &Confirmed,
) -> Result<Value, Failure> {
    let store = ctx.store;
    let actor = operator_actor();
    let done_key = action.done_key();
    let interrupted = Arc::new(AtomicBool::new(false));
    let watcher = {
        let flag = interrupted.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                flag.store(true, Ordering::SeqCst);
            }
        })
    };
    let bar = progress_bar(target, action);
    let say = |line: String| bar.suspend(|| ctx.ui.say(line));

    let mut tally = Tally::default();
    let mut items = Vec::new();
    let mut current = first;
    let mut stop: Option<Failure> = None;
    // With `--limit` the walk ends after `target` items; without, at the last page (a dead
    // letter dead-lettered before the count but committed after it is on a later page and is
    // done too; the totals then count it).
    let bounded = sel.limit.is_some();
    'walk: while !bounded || tally.seen < target {
        if current.is_empty() {
            break;
        }
        for d in &current {
            if bounded && tally.seen >= target {
                break 'walk;
            }
            if interrupted.load(Ordering::SeqCst) {
                break 'walk;
            }
            tally.seen += 1;
            let (n, p) = (d.global_position, d.perspective_name.as_str());
            let outcome = one(store, action, d, &actor, confirmed).await;
            match outcome {
                Ok(One::Done) => {
                    tally.done += 1;
                    say(match action {
                        BulkAction::Requeue => msg::requeued_one(n, p),
                        BulkAction::Purge => msg::purged_one(n, p),
                    });
                    items.push(item(d, done_key));
                }
                Ok(One::Lost) => {
                    tally.lost += 1;
                    say(msg::skipped_one(n, p));
                    items.push(item(d, "no_longer_dead_lettered"));
                }
                Ok(One::Queued) => {
                    tally.queued += 1;
                    say(msg::skipped_queued(n, p));
                    items.push(item(d, "already_queued"));
                }
                Ok(One::Rebuilding) => {
                    stop = Some(Failure::usage(msg::being_rebuilt(p)));
                    break 'walk;
                }
                Err(e) => {
                    stop = Some(output::store_failure(&e));
                    break 'walk;
                }
            }
            bar.inc(1);
            if tally.seen > target {
                bar.set_length(tally.seen as u64);
            }
            if bar.is_hidden() && tally.seen % PROGRESS_EVERY == 0 && tally.seen < target {
                ctx.ui.note(msg::progress(done_key, tally.seen, target));
            }
        }
        let want = if bounded {
            target - tally.seen
        } else {
            PAGE as usize
        };
        let next = page(store, &sel.filter, current.last(), want).await;
        current = match next {
            Ok(rows) => rows,
            Err(f) => {
                stop = Some(f);
                break;
            }
        };
    }
    bar.finish_and_clear();
    watcher.abort();
    let target = target.max(tally.seen);

    let total_line = match action {
        BulkAction::Requeue => msg::requeued_total(tally.done, target),
        BulkAction::Purge => msg::purged_total(tally.done, target),
    };
    if let Some(failure) = stop {
        return Err(failure.with(done_key, tally.done as u64));
    }
    let data = with_matching(
        json!({"count": target, "dry_run": false, "items": items, done_key: tally.done}),
        sel,
        matching,
    );
    if interrupted.load(Ordering::SeqCst) && tally.seen < target {
        ctx.ui.say(total_line);
        let mut failure = Failure::with_code(
            exit::FORCED,
            msg::bulk_interrupted(tally.done, target, done_key),
        );
        if let Value::Object(m) = data {
            failure.data = m;
        }
        return Err(failure);
    }
    // Dead letters changed by others after the first page was read are simply no longer there.
    tally.lost += target.saturating_sub(tally.seen);
    ctx.ui.say(total_line);
    if tally.done < target {
        let mut message = Vec::new();
        if tally.lost > 0 {
            message.push(msg::requeue_partial(tally.lost, target));
        }
        if tally.queued > 0 {
            message.push(msg::requeue_partial_queued(tally.queued, target));
        }
        let mut failure = Failure::usage(message.join(" "));
        if let Value::Object(m) = data {
            failure.data = m;
        }
        return Err(failure);
    }
    Ok(data)
}

/// What one compare-and-set came to.
enum One {
    Done,
    Lost,
    Queued,
    Rebuilding,
}

/// The only place a bulk run changes anything, hence the token.
async fn one(
    store: &Store,
    action: BulkAction,
    dl: &DeadLetter,
    actor: &str,
    _confirmed: &Confirmed,
) -> Result<One, StoreError> {
    Ok(match action {
        BulkAction::Requeue => match dlq::requeue(store, dl, actor).await? {
            Requeued::HandedBack => One::Done,
            Requeued::Lost => One::Lost,
            Requeued::AlreadyQueued => One::Queued,
            Requeued::Rebuilding => One::Rebuilding,
        },
        BulkAction::Purge => match dlq::purge(store, dl, actor).await {
            Ok(true) => One::Done,
            Ok(false) => One::Lost,
            Err(e) if e.is_rebuild_in_progress() => One::Rebuilding,
            Err(e) => return Err(e),
        },
    })
}

/// A bar on stderr when it is a terminal; hidden otherwise.
fn progress_bar(len: usize, action: BulkAction) -> ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(len as u64), target);
    bar.set_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(match action {
        BulkAction::Requeue => "requeue",
        BulkAction::Purge => "purge",
    });
    bar
}
