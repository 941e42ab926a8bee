//! Bulk actions: replay, requeue or purge every open dead letter that matches a list filter.
//!
//! Never one click: `GET /bulk?action=…&<the list's filter>` only shows what would happen —
//! the server's count of the open dead letters that match, which of them this confirmation
//! covers (the lowest positions, at most [`BULK_LIMIT`]) and a sample of exactly those — and a
//! form that repeats the filter and the count. `POST /bulk` re-selects the set (the count and
//! the set in one statement, so they describe one moment) and refuses,
//! changing nothing, when it is not the one the preview showed (a different count, or the same
//! count of different dead letters: the form carries a digest of their ids); otherwise it does
//! the action to each one through [`perform`], the single action's code: its own
//! compare-and-set, history and audit line. A dead letter another operator changed in the
//! meantime is skipped and counted, never acted on twice. Then 303 to the list, with what was
//! done.

use axum::extract::{Form, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Deserialize;

use super::actions::{perform, refuse_read_only, see_other, with_flash, Action, Outcome};
use super::dead_letters::{filter_of, given, ListQuery};
use crate::console::error::PageError;
use crate::console::flash::Flash;
use crate::console::view::{self, BulkPage, BulkRow};
use crate::console::{ConsoleState, ConsoleUser, AUDIT_TARGET, BULK_LIMIT, BULK_SAMPLE};
use crate::dlq::msg;
use crate::store::{BulkOrder, CountedDeadLetters, DeadLetter, DeadLetterFilter};

/// `GET /bulk`: the action and the list's filter.
#[derive(Debug, Deserialize)]
pub struct BulkQuery {
    action: String,
    #[serde(flatten)]
    filter: ListQuery,
}

/// `POST /bulk`: the preview's form. Numbers travel as text (a flattened form reads every value
/// as a string).
#[derive(Debug, Deserialize)]
pub struct BulkForm {
    action: String,
    count: String,
    digest: String,
    #[serde(flatten)]
    filter: ListQuery,
}

/// FNV-1a (64 bit) over the ids of the set in order: changes when any member does. Not a
/// security boundary (the operator could edit the form anyway), a change detector.
pub fn digest(letters: &[DeadLetter]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for d in letters {
        for b in d.dead_letter_id.as_bytes() {
            hash ^= u64::from(*b);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{hash:016x}")
}

/// The open dead letters of the filter: (how many match, the ones this confirmation covers).
async fn select(
    state: &ConsoleState,
    q: &ListQuery,
) -> Result<(DeadLetterFilter, i64, Vec<DeadLetter>), PageError> {
    if let Some(status) = given(&q.status).filter(|s| s != "exhausted") {
        return Err(PageError::BadRequest(format!(
            "status = {status:?}: bulk actions act on open dead letters only; use status = exhausted or leave it out."
        )));
    }
    let filter = DeadLetterFilter {
        status: Some("exhausted".to_owned()),
        ..filter_of(q)?
    };
    // The count and the set in one statement: the refusal's reason compares both with the
    // preview, so they must describe the same moment.
    let counted = state
        .store()
        .open_dead_letters_counted(&filter, BulkOrder::Position, BULK_LIMIT)
        .await?;
    let Some(CountedDeadLetters {
        matching, first, ..
    }) = counted
    else {
        return Err(PageError::Unavailable(format!(
            "Counting the matching dead letters took longer than {} s, and a bulk action needs the count. Narrow the filter and try again.",
            crate::console::STATEMENT_TIMEOUT.as_secs()
        )));
    };
    Ok((filter, matching, first))
}

fn preview_href(action: Action, params: &[(&'static str, String)]) -> String {
    let mut all: Vec<(&str, &str)> = vec![("action", action.name())];
    all.extend(params.iter().map(|(k, v)| (*k, v.as_str())));
    view::href("/bulk", &all)
}

fn list_href(params: &[(&'static str, String)]) -> String {
    let all: Vec<(&str, &str)> = params.iter().map(|(k, v)| (*k, v.as_str())).collect();
    view::dead_letters_href(&all)
}

/// `GET /bulk`.
pub async fn preview(
    State(state): State<ConsoleState>,
    Query(q): Query<BulkQuery>,
) -> Result<Response, PageError> {
    if let Some(refused) = refuse_read_only(&state) {
        return Ok(refused);
    }
    let action = Action::parse(&q.action)?;
    let (_, count, letters) = select(&state, &q.filter).await?;
    let params = q.filter.filter_params();
    let page = BulkPage {
        read_only: false,
        flash: state.flash(q.filter.flash.as_deref()),
        action: action.name(),
        label: action.label(),
        filter: params
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect(),
        count,
        acting: letters.len(),
        capped: count > letters.len() as i64,
        limit: BULK_LIMIT,
        first_position: letters.first().map_or(0, |d| d.global_position),
        last_position: letters.last().map_or(0, |d| d.global_position),
        digest: digest(&letters),
        warning: (action == Action::Replay).then(|| {
            "Warning: replay re-runs the handler's side effects out of order: each perspective applies these events now, after later events of their streams may already have been applied.".to_owned()
        }),
        list_href: list_href(&params),
        more: letters.len().saturating_sub(BULK_SAMPLE),
        sample: letters
            .iter()
            .take(BULK_SAMPLE)
            .map(|d| BulkRow {
                href: view::detail_href(d.global_position, &d.perspective_name),
                position: d.global_position,
                perspective: d.perspective_name.clone(),
                event_type: d
                    .event_type
                    .clone()
                    .unwrap_or_else(|| "(unknown)".to_owned()),
                reason: d.failure_reason.clone(),
                error: d
                    .error_text
                    .as_deref()
                    .map(|e| preview_text(e, 120))
                    .unwrap_or_default(),
                attempts: d.attempts_when_dlq,
                at: view::at(&d.dead_lettered_at),
            })
            .collect(),
    };
    Ok(view::render(&page).into_response())
}

/// The first `max` characters of `text`, with `…` when cut.
fn preview_text(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}

/// What a confirmed bulk action did, for its message.
#[derive(Debug, Default)]
struct Tally {
    done: usize,
    lost: usize,
    queued: usize,
    failed: usize,
    refused: usize,
    first_refusal: Option<String>,
    stopped: Option<String>,
}

impl Tally {
    fn message(&self, action: Action, acting: usize, remaining: i64) -> Flash {
        let mut parts = vec![match action {
            Action::Requeue => msg::requeued_total(self.done, acting),
            Action::Purge => format!("Purged {} of {acting} dead-lettered event(s).", self.done),
            Action::Replay => format!(
                "Replayed {} of {acting} dead-lettered event(s): resolved.",
                self.done
            ),
        }];
        if let Some(why) = &self.stopped {
            parts.push(format!("Stopped: {why}"));
        }
        if self.lost > 0 {
            parts.push(msg::requeue_partial(self.lost, acting));
        }
        if self.queued > 0 {
            let verb = if action == Action::Replay {
                "replaying"
            } else {
                "requeuing"
            };
            parts.push(format!(
                "{} of {acting} dead-lettered event(s) were already queued for the daemon: {verb} them would apply them twice. They were skipped.",
                self.queued
            ));
        }
        if self.failed > 0 {
            parts.push(format!(
                "{} of {acting} failed again and stay dead-lettered (their history has the error).",
                self.failed
            ));
        }
        if let Some(first) = &self.first_refusal {
            parts.push(format!(
                "{} of {acting} could not be replayed; the first: {first}",
                self.refused
            ));
        }
        if remaining > 0 {
            parts.push(format!(
                "{remaining} more match the filter (at most {BULK_LIMIT} per confirmation); open the preview again for the next ones."
            ));
        }
        let text = parts.join(" ");
        if self.done == acting && self.stopped.is_none() {
            Flash::done(text)
        } else {
            Flash::refused(text)
        }
    }
}

/// `POST /bulk`.
pub async fn confirm(
    State(state): State<ConsoleState>,
    Extension(user): Extension<ConsoleUser>,
    Form(form): Form<BulkForm>,
) -> Result<Response, PageError> {
    if let Some(refused) = refuse_read_only(&state) {
        return Ok(refused);
    }
    let action = Action::parse(&form.action)?;
    let (_, count, letters) = select(&state, &form.filter).await?;
    let params = form.filter.filter_params();
    let shown: Option<i64> = form.count.trim().parse().ok();
    if shown != Some(count) || form.digest.trim() != digest(&letters) {
        let then = shown.map_or_else(|| "?".to_owned(), |n| n.to_string());
        let text = if shown == Some(count) {
            format!("The matching dead letters changed since the preview: {count} match, as before, but not the same ones. Nothing was done; check the preview again.")
        } else {
            format!("The matching dead letters changed since the preview: {then} matched then, {count} match now. Nothing was done; check the preview again.")
        };
        tracing::info!(target: AUDIT_TARGET, actor = %user.0, action = action.name(),
            filter = ?params, shown = %then, count, "console bulk action refused: the set changed");
        let back = with_flash(&state, &preview_href(action, &params), Flash::refused(text));
        return Ok(see_other(&back));
    }

    let acting = letters.len();
    // The walk runs in a task of its own: if the client goes away (or the connection is cut),
    // it still finishes, and its audit line and flash message say exactly what it did.
    let walk = {
        let state = state.clone();
        let user = user.clone();
        async move {
            let mut tally = Tally::default();
            let mut error = None;
            for dl in &letters {
                match perform(&state, action, dl, &user).await {
                    Ok(Outcome::Done) => tally.done += 1,
                    Ok(Outcome::Lost) => tally.lost += 1,
                    Ok(Outcome::Queued) => tally.queued += 1,
                    Ok(Outcome::ReplayFailed(_)) => tally.failed += 1,
                    Ok(Outcome::Rebuilding) => {
                        tally.stopped = Some(msg::being_rebuilt(&dl.perspective_name));
                        break;
                    }
                    Ok(Outcome::Refused(e)) => {
                        tally.refused += 1;
                        tally.first_refusal.get_or_insert_with(|| e.to_string());
                    }
                    Err(e) => {
                        tally.stopped = Some(e.to_string());
                        error = Some(e);
                        break;
                    }
                }
            }
            tracing::info!(target: AUDIT_TARGET, actor = %user.0, action = action.name(),
                filter = ?params, count, acting, done = tally.done, lost = tally.lost,
                queued = tally.queued, failed = tally.failed, refused = tally.refused,
                stopped = tally.stopped.is_some(), "console bulk action");
            (tally, error, params)
        }
    };
    let (tally, error, params) = tokio::spawn(walk).await.map_err(|e| {
        PageError::Unavailable(format!("The bulk action stopped unexpectedly: {e}"))
    })?;
    if let Some(e) = error {
        return Err(e.into());
    }
    let flash = tally.message(action, acting, count - acting as i64);
    Ok(see_other(&with_flash(&state, &list_href(&params), flash)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn previews_cut_on_characters() {
        assert_eq!(preview_text("abc", 5), "abc");
        assert_eq!(preview_text("äöüäöü", 3), "äöü…");
    }
}
