//! `POST /actions`: replay, requeue or purge one dead letter, then 303 to its detail page with
//! what happened.
//!
//! The form names the dead letter by its id (with its position and perspective), so the action
//! applies to exactly the dead letter the operator was looking at, never to a newer one of the
//! same event. The action itself is [`crate::dlq`]'s, the CLI's code: the same compare-and-set
//! (a lost race says so, nothing done), the same refusals, the same history, with the console
//! user as actor. Each action is one audit line ([`AUDIT_TARGET`]).

use axum::extract::{Form, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Deserialize;
use uuid::Uuid;

use crate::console::error::{self, PageError};
use crate::console::flash::Flash;
use crate::console::{view, ConsoleState, ConsoleUser, AUDIT_TARGET};
use crate::dlq::{self, msg, DlqError, Replayed, Requeued};
use crate::store::{DeadLetter, StoreError};

/// What an operator can do to a dead letter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Dispatch once more through the perspective's handler (`vantage dlq replay`).
    Replay,
    /// Hand back to the daemon, attempts reset (`vantage dlq requeue`).
    Requeue,
    /// Close for good, history kept (`vantage dlq purge`).
    Purge,
}

impl Action {
    /// From a form's `action`.
    pub fn parse(text: &str) -> Result<Action, PageError> {
        match text {
            "replay" => Ok(Action::Replay),
            "requeue" => Ok(Action::Requeue),
            "purge" => Ok(Action::Purge),
            other => Err(PageError::BadRequest(format!(
                "action = {other:?} is not an action: use replay, requeue or purge."
            ))),
        }
    }

    /// `replay`, `requeue`, `purge`.
    pub fn name(self) -> &'static str {
        match self {
            Action::Replay => "replay",
            Action::Requeue => "requeue",
            Action::Purge => "purge",
        }
    }

    /// `Replay`, `Requeue`, `Purge`: a button's verb.
    pub fn label(self) -> &'static str {
        match self {
            Action::Replay => "Replay",
            Action::Requeue => "Requeue",
            Action::Purge => "Purge",
        }
    }
}

/// What one action on one dead letter came to.
#[derive(Debug)]
pub enum Outcome {
    /// Done: replayed and resolved, requeued, or purged.
    Done,
    /// It was no longer open: another command changed it first. Nothing done.
    Lost,
    /// A work row for its event exists: replaying or requeuing would apply it twice.
    Queued,
    /// Its perspective is being rebuilt: nothing done.
    Rebuilding,
    /// The replay ran and the handler failed again: it stays dead-lettered (history records it).
    ReplayFailed(String),
    /// Refused before anything ran (no handler, no statement, the event cannot be re-read, …).
    Refused(DlqError),
}

impl Outcome {
    /// The audit line's `outcome`.
    pub fn label(&self, action: Action) -> &'static str {
        match (self, action) {
            (Outcome::Done, Action::Replay) => "resolved",
            (Outcome::Done, Action::Requeue) => "requeued",
            (Outcome::Done, Action::Purge) => "purged",
            (Outcome::Lost, _) => "no_longer_dead_lettered",
            (Outcome::Queued, _) => "already_queued",
            (Outcome::Rebuilding, _) => "being_rebuilt",
            (Outcome::ReplayFailed(_), _) => "replay_failed",
            (Outcome::Refused(_), _) => "refused",
        }
    }

    /// What the CLI would say about it (the messages of docs/cli.md, "vantage dlq").
    pub fn message(&self, action: Action, dl: &DeadLetter) -> Flash {
        let (n, p) = (dl.global_position, dl.perspective_name.as_str());
        let verb = match action {
            Action::Replay => "replaying",
            _ => "requeuing",
        };
        match self {
            Outcome::Done => Flash::done(match action {
                Action::Replay => msg::replayed(n, p),
                Action::Requeue => msg::requeued_one(n, p),
                Action::Purge => msg::purged(n),
            }),
            Outcome::Lost => Flash::refused(msg::race(n)),
            Outcome::Queued => Flash::refused(msg::already_queued(n, p, verb)),
            Outcome::Rebuilding => Flash::refused(msg::being_rebuilt(p)),
            Outcome::ReplayFailed(e) => Flash::refused(msg::replay_failed(n, e)),
            Outcome::Refused(e) => Flash::refused(e.to_string()),
        }
    }
}

/// Does `action` to `dl` as `actor` through [`crate::dlq`], and writes its audit line. A dead
/// letter that is no longer open is a lost race before anything is tried.
pub async fn perform(
    state: &ConsoleState,
    action: Action,
    dl: &DeadLetter,
    actor: &ConsoleUser,
) -> Result<Outcome, StoreError> {
    let outcome = if dl.status != "exhausted" {
        Outcome::Lost
    } else {
        run(state, action, dl, &actor.0).await?
    };
    let detail = match &outcome {
        Outcome::ReplayFailed(e) => e.clone(),
        Outcome::Refused(e) => e.to_string(),
        _ => String::new(),
    };
    tracing::info!(
        target: AUDIT_TARGET,
        actor = %actor.0,
        action = action.name(),
        position = dl.global_position,
        perspective = %dl.perspective_name,
        dead_letter_id = %dl.dead_letter_id,
        outcome = outcome.label(action),
        detail = %detail,
        "console action"
    );
    Ok(outcome)
}

async fn run(
    state: &ConsoleState,
    action: Action,
    dl: &DeadLetter,
    actor: &str,
) -> Result<Outcome, StoreError> {
    let store = state.store();
    Ok(match action {
        Action::Purge => match dlq::purge(store, dl, actor).await? {
            true => Outcome::Done,
            false => Outcome::Lost,
        },
        Action::Requeue => match dlq::requeue(store, dl, actor).await? {
            Requeued::HandedBack => Outcome::Done,
            Requeued::Lost => Outcome::Lost,
            Requeued::AlreadyQueued => Outcome::Queued,
            Requeued::Rebuilding => Outcome::Rebuilding,
        },
        Action::Replay => {
            let replayed = match dlq::prepare_replay(store, state.perspectives(), dl).await {
                Ok(prepared) => dlq::replay(store, prepared, dl, actor).await,
                Err(e) => Err(e),
            };
            match replayed {
                Ok(Replayed::Resolved) => Outcome::Done,
                Ok(Replayed::Failed(e)) => Outcome::ReplayFailed(e),
                Err(DlqError::Race(_)) => Outcome::Lost,
                Err(DlqError::AlreadyQueued { .. }) => Outcome::Queued,
                Err(DlqError::BeingRebuilt(_)) => Outcome::Rebuilding,
                Err(DlqError::Store(e)) => return Err(e),
                Err(other) => Outcome::Refused(other),
            }
        }
    })
}

/// The single action's form.
#[derive(Debug, Deserialize)]
pub struct ActionForm {
    action: String,
    dead_letter_id: String,
    position: i64,
    perspective: String,
}

/// 303 to `location`.
pub fn see_other(location: &str) -> Response {
    (StatusCode::SEE_OTHER, [(header::LOCATION, location)]).into_response()
}

/// `location` with `?flash=ID` (or `&flash=ID`) for `flash`.
pub fn with_flash(state: &ConsoleState, location: &str, flash: Flash) -> String {
    let id = state.flashes().put(flash);
    let sep = if location.contains('?') { '&' } else { '?' };
    format!("{location}{sep}flash={id}")
}

/// 403 in read-only mode, whatever was asked.
pub fn refuse_read_only(state: &ConsoleState) -> Option<Response> {
    state.read_only().then(|| {
        let status = StatusCode::FORBIDDEN;
        (
            status,
            error::page(
                status,
                "No action taken",
                "This console is read-only (console.read_only = true): it changes nothing.",
            ),
        )
            .into_response()
    })
}

/// `POST /actions`.
pub async fn act(
    State(state): State<ConsoleState>,
    Extension(user): Extension<ConsoleUser>,
    Form(form): Form<ActionForm>,
) -> Result<Response, PageError> {
    if let Some(refused) = refuse_read_only(&state) {
        return Ok(refused);
    }
    let action = Action::parse(&form.action)?;
    let (n, p) = (form.position, form.perspective.as_str());
    let back = view::detail_href(n, p);
    let found = match Uuid::parse_str(&form.dead_letter_id) {
        Ok(id) => state.store().dead_letter(id).await?,
        Err(_) => None,
    };
    let Some(dl) = found.filter(|d| d.global_position == n && d.perspective_name == p) else {
        let flash = Flash::refused(msg::no_dead_letter(n));
        return Ok(see_other(&with_flash(&state, &back, flash)));
    };
    let outcome = perform(&state, action, &dl, &user).await?;
    let flash = outcome.message(action, &dl);
    Ok(see_other(&with_flash(&state, &back, flash)))
}
