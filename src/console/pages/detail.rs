//! `GET /dead-letters/{position}/{perspective}`: the permalink of one dead letter. Its event is
//! re-read live from `wh_event_store` (never a copy), with the check `vantage dlq inspect`
//! makes: what was read must be that global position and that event id. Then the dead letter
//! (the latest of that event in that perspective, whatever its status) and its whole history.

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use crate::console::error::PageError;
use crate::console::view::{
    self, ActionsView, DeadLetterView, DetailPage, EventView, HistoryRow, PreviewRow,
    ReplayPreviewView,
};
use crate::console::ConsoleState;
use crate::dlq::{self, msg, DryRun, Preview};
use crate::present::sort_keys;
use crate::store::{DeadLetter, StoredEvent};

/// The event, if what was read really is the dead letter's event.
fn same_event(dl: &DeadLetter, event: Option<StoredEvent>) -> Option<StoredEvent> {
    event.filter(|e| e.global_position == dl.global_position && e.event_id == dl.event_id)
}

/// The value as indented JSON, capped ([`crate::text::cap`]).
fn pretty(value: &serde_json::Value) -> String {
    let sorted = sort_keys(value.clone());
    let text = serde_json::to_string_pretty(&sorted).unwrap_or_else(|_| sorted.to_string());
    capped(text)
}

/// What a page renders of one text: at most [`crate::text::MAX_TEXT`] bytes and the count of
/// the rest.
fn capped(text: String) -> String {
    match crate::text::cap(&text) {
        std::borrow::Cow::Borrowed(_) => text,
        std::borrow::Cow::Owned(cut) => cut,
    }
}

/// The detail's query: the message of the action that redirected here. (A `preview` in the
/// query is ignored: a GET never runs a perspective's statement; the preview is a POST.)
#[derive(Debug, Default, Deserialize)]
pub struct DetailQuery {
    flash: Option<String>,
}

/// The form of `POST /dead-letters/{position}/{perspective}`: `preview=replay` (the replay
/// form's fields, also sent, are ignored).
#[derive(Debug, Default, Deserialize)]
pub struct PreviewForm {
    #[serde(default)]
    preview: String,
}

/// Runs the replay's dry run ([`dlq::dry_run`], as `vantage dlq replay --dry-run` does) for the
/// page: what it would write, or the error, or why it cannot run.
async fn replay_preview(state: &ConsoleState, dl: &DeadLetter) -> ReplayPreviewView {
    let store = state.store();
    let outcome = async {
        let prepared = dlq::prepare_replay(store, state.perspectives(), dl).await?;
        dlq::dry_run(store, &prepared, dl).await
    }
    .await;
    let (n, p) = (dl.global_position, dl.perspective_name.as_str());
    let mut view = ReplayPreviewView {
        header: msg::dry_run_header(n, p),
        ok: false,
        summary: String::new(),
        rows: Vec::new(),
        returned: Vec::new(),
    };
    match outcome {
        Err(e) => view.summary = e.to_string(),
        Ok(DryRun {
            error: Some(error), ..
        }) => view.summary = msg::dry_run_would_fail(&error),
        Ok(DryRun {
            error: None,
            preview,
        }) => {
            view.ok = true;
            view.summary = msg::dry_run_would_resolve(n);
            // Every value of a dry run is capped already (`dlq::DRY_RUN_ROWS`).
            let text = |v: &Option<String>| v.clone().unwrap_or_else(|| "(none)".to_owned());
            match preview {
                Preview::Rows(rows) => {
                    if rows.is_empty() {
                        view.summary.push_str(" It writes no row of the read model.");
                    }
                    view.rows = rows
                        .into_iter()
                        .map(|r| PreviewRow {
                            key: r
                                .key
                                .as_ref()
                                .map_or_else(|| "(no primary key)".to_owned(), |k| k.join(", ")),
                            before: if r.key.is_some() {
                                text(&r.before)
                            } else {
                                "(not known: no primary key)".to_owned()
                            },
                            after: if r.key.is_some() {
                                text(&r.after)
                            } else {
                                r.written.clone()
                            },
                            table: r.table,
                        })
                        .collect();
                }
                Preview::Returned(rows) => view.returned = rows,
                Preview::Unavailable => view.summary.push_str(
                    " Which rows it writes could not be read (the statement is not a plain INSERT, UPDATE or DELETE).",
                ),
            }
        }
    }
    view
}

/// `GET /dead-letters/{position}/{perspective}`: reads only, runs no statement of a
/// perspective.
pub async fn show(
    State(state): State<ConsoleState>,
    Path((position, perspective)): Path<(i64, String)>,
    Query(query): Query<DetailQuery>,
) -> Result<Response, PageError> {
    page(
        &state,
        position,
        &perspective,
        query.flash.as_deref(),
        false,
    )
    .await
}

/// `POST /dead-letters/{position}/{perspective}` with `preview=replay`: the page with what a
/// replay would change, from a dry run (the statement runs, rolled back). Executing a
/// perspective's statement is an action: a POST (so the CSRF check applies), refused by a
/// read-only console.
pub async fn preview(
    State(state): State<ConsoleState>,
    Path((position, perspective)): Path<(i64, String)>,
    axum::extract::Form(form): axum::extract::Form<PreviewForm>,
) -> Result<Response, PageError> {
    if let Some(refused) = super::actions::refuse_read_only(&state) {
        return Ok(refused);
    }
    if form.preview != "replay" {
        return Err(PageError::BadRequest(format!(
            "preview = {:?} is not a preview: use replay.",
            form.preview
        )));
    }
    page(&state, position, &perspective, None, true).await
}

async fn page(
    state: &ConsoleState,
    position: i64,
    perspective: &str,
    flash: Option<&str>,
    with_preview: bool,
) -> Result<Response, PageError> {
    let state = state.clone();
    let perspective = perspective.to_owned();
    let store = state.store();
    let mut letters = store.dead_letters_of(position, &perspective).await?;
    if letters.is_empty() {
        return Err(PageError::NotFound(format!(
            "No dead-lettered event at position {position} in perspective '{perspective}'."
        )));
    }
    let dl = letters.remove(0);
    let event = same_event(&dl, store.event_at(dl.global_position).await?);
    let history = store.dead_letter_history(dl.dead_letter_id).await?;
    let preview = if with_preview && dl.status == "exhausted" {
        Some(replay_preview(&state, &dl).await)
    } else {
        None
    };

    let actions = (!state.read_only() && dl.status == "exhausted").then(|| {
        let (n, p) = (dl.global_position, dl.perspective_name.as_str());
        ActionsView {
            dead_letter_id: dl.dead_letter_id.to_string(),
            replay_warning: msg::replay_warning(p, n),
            preview_href: view::detail_href(n, p),
            replay_unavailable: (!state.perspectives().iter().any(|s| s.name == p))
                .then(|| msg::no_handler(p, n)),
            purge_note: "Closes it for good without running anything; a terminal record is kept in the history.".to_owned(),
        }
    });
    let page = DetailPage {
        read_only: state.read_only(),
        flash: state.flash(flash),
        actions,
        preview,
        list_href: view::dead_letters_href(&[("perspective", dl.perspective_name.as_str())]),
        event: event.map(|e| EventView {
            event_type: e.event_type,
            global_position: e.global_position,
            event_id: e.event_id.to_string(),
            stream_id: e.stream_id.to_string(),
            stream_version: e.stream_version,
            created_at: view::at(&e.created_at),
            data: pretty(&e.event_data),
            metadata: e
                .metadata
                .as_object()
                .is_some_and(|m| !m.is_empty())
                .then(|| pretty(&e.metadata)),
        }),
        reread_error: format!("Could not re-read the event at position {position}."),
        earlier: letters.len(),
        history: history
            .into_iter()
            .map(|h| HistoryRow {
                at: view::at(&h.at),
                kind: h.kind,
                actor: h.actor,
                detail: capped(h.detail.unwrap_or_default()),
            })
            .collect(),
        dl: DeadLetterView {
            position: dl.global_position,
            reason: dl.failure_reason,
            error: capped(
                dl.error_text
                    .unwrap_or_else(|| "(none recorded)".to_owned()),
            ),
            attempts: dl.attempts_when_dlq,
            failures: dl.failures_when_dlq,
            at: view::at(&dl.dead_lettered_at),
            by: dl.dead_lettered_by.map_or_else(
                || "(no instance recorded)".to_owned(),
                |i| format!("instance {i}"),
            ),
            status: dl.status,
            status_changed_at: view::at(&dl.status_changed_at),
            perspective: dl.perspective_name,
        },
    };
    Ok(view::render(&page).into_response())
}
