//! `GET /dead-letters`: the filtered list. Every filter is a query parameter (the form is a
//! GET), so a filtered view is a link one can share:
//!
//! `perspective`, `reason`, `event_type` (exact), `error` (substring of the error text, any
//! case), `since`, `until` (UTC: RFC 3339, `YYYY-MM-DDTHH:MM[:SS]` or `YYYY-MM-DD`), `status`
//! (`exhausted` — open, the default — `resolved`, `requeued`, `purged` or `any`), `limit` (rows
//! per page, default [`DEFAULT_PAGE_SIZE`]), `after` (the keyset cursor `POSITION.ID` of the
//! next-page link).

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, NaiveDate, NaiveDateTime, Utc};
use serde::Deserialize;
use uuid::Uuid;

use crate::console::error::PageError;
use crate::console::pages::actions::Action;
use crate::console::view::{self, Choice, DeadLetterRow, DeadLettersPage, FilterForm};
use crate::console::{
    ConsoleState, BULK_LIMIT, DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, STATEMENT_TIMEOUT,
};
use crate::store::{DeadLetterCursor, DeadLetterFilter, FAILURE_MAX_ATTEMPTS, FAILURE_PERMANENT};

/// The statuses one can filter by, the open one first.
const STATUSES: &[&str] = &["exhausted", "resolved", "requeued", "purged", "any"];

/// The query string, as typed: empty values count as absent.
#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    pub perspective: Option<String>,
    pub reason: Option<String>,
    pub event_type: Option<String>,
    pub error: Option<String>,
    pub since: Option<String>,
    pub until: Option<String>,
    pub status: Option<String>,
    /// An error fingerprint (`/groups` links here with it).
    pub group: Option<String>,
    pub limit: Option<String>,
    pub after: Option<String>,
    /// The message of the action that redirected here (see [`crate::console::flash`]).
    pub flash: Option<String>,
}

impl ListQuery {
    /// The filter's parameters as given (trimmed, empty ones left out), in the form's order:
    /// what a bulk action carries from the list to its preview and its confirmation.
    pub fn filter_params(&self) -> Vec<(&'static str, String)> {
        [
            ("perspective", &self.perspective),
            ("reason", &self.reason),
            ("event_type", &self.event_type),
            ("error", &self.error),
            ("since", &self.since),
            ("until", &self.until),
            ("status", &self.status),
            ("group", &self.group),
        ]
        .into_iter()
        .filter_map(|(k, v)| given(v).map(|v| (k, v)))
        .collect()
    }
}

pub(crate) fn given(v: &Option<String>) -> Option<String> {
    v.as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// `since` / `until`: RFC 3339, or a UTC date and time as a `datetime-local` input sends it,
/// or a date.
pub fn parse_time(name: &str, text: &str) -> Result<DateTime<Utc>, PageError> {
    use chrono::Datelike as _;
    let t = parse_any_time(name, text)?;
    // PostgreSQL's timestamptz ends in 4713 BC and 294276 AD, and a console filter needs no
    // more than years 1 to 9999: outside them the database would refuse the query (a 503).
    if !(1..=9999).contains(&t.year()) {
        return Err(PageError::BadRequest(format!(
            "{name} = {text:?} is out of range: use a year from 1 to 9999."
        )));
    }
    Ok(t)
}

fn parse_any_time(name: &str, text: &str) -> Result<DateTime<Utc>, PageError> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    for format in [
        "%Y-%m-%dT%H:%M:%S",
        "%Y-%m-%dT%H:%M",
        "%Y-%m-%d %H:%M:%S",
        "%Y-%m-%d %H:%M",
    ] {
        if let Ok(t) = NaiveDateTime::parse_from_str(text, format) {
            return Ok(t.and_utc());
        }
    }
    if let Ok(d) = NaiveDate::parse_from_str(text, "%Y-%m-%d") {
        return Ok(d.and_hms_opt(0, 0, 0).unwrap_or_default().and_utc());
    }
    Err(PageError::BadRequest(format!(
        "{name} = {text:?} is not a time: use RFC 3339 (2026-01-31T12:00:00Z), or a UTC date and time such as 2026-01-31T12:00, or a date such as 2026-01-31."
    )))
}

/// `after`: `POSITION.DEAD_LETTER_ID`.
pub fn parse_cursor(text: &str) -> Result<DeadLetterCursor, PageError> {
    text.split_once('.')
        .and_then(|(p, id)| {
            Some(DeadLetterCursor {
                global_position: p.parse().ok()?,
                dead_letter_id: Uuid::parse_str(id).ok()?,
            })
        })
        .ok_or_else(|| {
            PageError::BadRequest(format!(
                "after = {text:?} is not a page cursor (POSITION.ID, as the Next page link writes it)."
            ))
        })
}

/// The query as a filter, or the 400 naming the parameter that is wrong.
pub fn filter_of(q: &ListQuery) -> Result<DeadLetterFilter, PageError> {
    let status = match given(&q.status).as_deref() {
        None => Some("exhausted".to_owned()),
        Some("any") => None,
        Some(s) if STATUSES.contains(&s) => Some(s.to_owned()),
        Some(s) => {
            return Err(PageError::BadRequest(format!(
                "status = {s:?} is not a status: use one of {}.",
                STATUSES.join(", ")
            )))
        }
    };
    Ok(DeadLetterFilter {
        perspective: given(&q.perspective),
        reason: given(&q.reason),
        event_type: given(&q.event_type),
        error_contains: given(&q.error),
        since: given(&q.since)
            .map(|s| parse_time("since", &s))
            .transpose()?,
        until: given(&q.until)
            .map(|s| parse_time("until", &s))
            .transpose()?,
        status,
        group: given(&q.group),
    })
}

fn limit_of(q: &ListQuery) -> Result<u32, PageError> {
    match given(&q.limit) {
        None => Ok(DEFAULT_PAGE_SIZE),
        Some(s) => s
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=MAX_PAGE_SIZE).contains(n))
            .ok_or_else(|| {
                PageError::BadRequest(format!(
                    "limit = {s:?} is not a page size: use a whole number from 1 to {MAX_PAGE_SIZE}."
                ))
            }),
    }
}

/// `GET /dead-letters`.
pub async fn show(
    State(state): State<ConsoleState>,
    Query(q): Query<ListQuery>,
) -> Result<Response, PageError> {
    let filter = filter_of(&q)?;
    let limit = limit_of(&q)?;
    let after = given(&q.after).map(|s| parse_cursor(&s)).transpose()?;
    let store = state.store();

    let page = store.dead_letter_page(&filter, after, limit).await?;
    let count = store.dead_letter_count(&filter).await?;
    let registered = store.perspectives().await?;

    // The URL of this view without the cursor, to which a page's cursor is added.
    let status = given(&q.status).unwrap_or_default();
    let limit_text = if limit == DEFAULT_PAGE_SIZE {
        String::new()
    } else {
        limit.to_string()
    };
    let text = |v: &Option<String>| given(v).unwrap_or_default();
    let (perspective, reason) = (text(&q.perspective), text(&q.reason));
    let group = text(&q.group);
    let form = FilterForm {
        group: group.clone(),
        event_type: text(&q.event_type),
        error: text(&q.error),
        since: text(&q.since),
        until: text(&q.until),
    };
    let params = |after: &str| -> String {
        view::dead_letters_href(&[
            ("perspective", &perspective),
            ("reason", &reason),
            ("event_type", &form.event_type),
            ("error", &form.error),
            ("since", &form.since),
            ("until", &form.until),
            ("status", &status),
            ("group", &group),
            ("limit", &limit_text),
            ("after", after),
        ])
    };

    let mut perspective_names: Vec<&str> = registered
        .iter()
        .map(|p| p.perspective_name.as_str())
        .collect();
    if !perspective.is_empty() && !perspective_names.contains(&perspective.as_str()) {
        perspective_names.push(&perspective);
    }
    let mut reasons = vec![FAILURE_MAX_ATTEMPTS, FAILURE_PERMANENT];
    if !reason.is_empty() && !reasons.contains(&reason.as_str()) {
        reasons.push(&reason);
    }
    let current_status = if status.is_empty() {
        "exhausted"
    } else {
        status.as_str()
    };

    // Bulk actions act on open dead letters: offered when the list shows those and some match.
    let bulk = if state.read_only() || current_status != "exhausted" || count == Some(0) {
        Vec::new()
    } else {
        let filter_params = q.filter_params();
        [Action::Requeue, Action::Purge, Action::Replay]
            .into_iter()
            .map(|a| {
                let mut all: Vec<(&str, &str)> = vec![("action", a.name())];
                all.extend(filter_params.iter().map(|(k, v)| (*k, v.as_str())));
                (a.label(), view::href("/bulk", &all))
            })
            .collect()
    };

    let body = DeadLettersPage {
        read_only: state.read_only(),
        flash: state.flash(q.flash.as_deref()),
        bulk,
        bulk_limit: BULK_LIMIT,
        perspective_options: Choice::list(perspective_names, &perspective),
        reason_options: Choice::list(reasons, &reason),
        status_options: Choice::list(STATUSES.iter().copied(), current_status),
        limit_param: limit_text.clone(),
        count,
        timeout: STATEMENT_TIMEOUT.as_secs(),
        is_continuation: after.is_some(),
        after_position: after.map_or(0, |c| c.global_position),
        first_href: params(""),
        next_href: page
            .next
            .map(|c| params(&format!("{}.{}", c.global_position, c.dead_letter_id))),
        rows: page
            .rows
            .into_iter()
            .map(|r| DeadLetterRow {
                href: view::detail_href(r.global_position, &r.perspective_name),
                position: r.global_position,
                event_type: r.event_type.unwrap_or_else(|| "(unknown)".to_owned()),
                reason: r.failure_reason,
                error: match r.error_preview {
                    Some(e) if r.error_truncated => format!("{e}…"),
                    Some(e) => e,
                    None => String::new(),
                },
                attempts: r.attempts_when_dlq,
                at: view::at(&r.dead_lettered_at),
                status: r.status,
                perspective: r.perspective_name,
            })
            .collect(),
        form,
    };
    Ok(view::render(&body).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_in_the_forms_people_type() {
        let t = parse_time("since", "2026-01-31T12:00").unwrap();
        assert_eq!(t.to_rfc3339(), "2026-01-31T12:00:00+00:00");
        let t = parse_time("since", "2026-01-31T13:00:00+01:00").unwrap();
        assert_eq!(t.to_rfc3339(), "2026-01-31T12:00:00+00:00");
        assert!(parse_time("since", "2026-01-31").is_ok());
        assert!(parse_time("since", "yesterday").is_err());
    }

    #[test]
    fn cursors_round_trip() {
        let id = Uuid::new_v4();
        let c = parse_cursor(&format!("42.{id}")).unwrap();
        assert_eq!((c.global_position, c.dead_letter_id), (42, id));
        assert!(parse_cursor("42").is_err());
        assert!(parse_cursor("x.y").is_err());
    }
}
