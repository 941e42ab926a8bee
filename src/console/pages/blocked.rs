//! `GET /blocked`: the lanes whose head is parked or failing, the most events waiting first, as
//! `vantage status --blocked` shows them (`?perspective=` narrows it): the head's position,
//! attempts, failures, next retry, its error fingerprint (linking to that group's dead
//! letters), and how many events wait behind it and since when.

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::dead_letters::given;
use crate::console::error::PageError;
use crate::console::view::{self, BlockedPage, BlockedRow};
use crate::console::ConsoleState;

/// Lanes listed (the totals count them all).
pub const BLOCKED_SHOWN: i64 = 200;

/// The query: an optional perspective.
#[derive(Debug, Default, Deserialize)]
pub struct BlockedQuery {
    perspective: Option<String>,
    flash: Option<String>,
}

/// `GET /blocked`.
pub async fn show(
    State(state): State<ConsoleState>,
    Query(q): Query<BlockedQuery>,
) -> Result<Response, PageError> {
    let perspective = given(&q.perspective);
    let store = state.store();
    let lanes = store
        .blocked_lanes(perspective.as_deref(), BLOCKED_SHOWN)
        .await?;
    let totals = store.blocked_totals(perspective.as_deref()).await?;
    let now = store.database_now().await?;
    let secs = |d: chrono::TimeDelta| d.num_milliseconds() as f64 / 1000.0;
    let total_lanes: i64 = totals.iter().map(|t| t.lanes).sum();
    let page = BlockedPage {
        truncated: (lanes.len() as i64) < total_lanes,
        read_only: state.read_only(),
        flash: state.flash(q.flash.as_deref()),
        now: view::at(&now),
        perspective: perspective.unwrap_or_default(),
        total_lanes,
        total_events: totals.iter().map(|t| t.events).sum(),
        totals: totals
            .into_iter()
            .map(|t| (t.perspective_name, t.lanes, t.events))
            .collect(),
        lanes: lanes
            .into_iter()
            .map(|l| BlockedRow {
                group_href: view::dead_letters_href(&[("group", l.fingerprint.as_str())]),
                fingerprint: l.fingerprint,
                stream: l.stream_id.to_string(),
                head_position: l.head_position,
                event_type: l.event_type.unwrap_or_else(|| "(unknown)".to_owned()),
                attempts: l.attempts,
                failures: l.failures,
                next_retry: if l.leased {
                    "retrying now".to_owned()
                } else {
                    match l.next_retry_at {
                        Some(at) if at > now => format!("in {}", view::age(secs(at - now))),
                        Some(_) => "due".to_owned(),
                        None => "-".to_owned(),
                    }
                },
                error: l
                    .last_error
                    .map(|e| crate::present::shorten(&e, 160))
                    .unwrap_or_default(),
                waiting: l.waiting,
                waiting_since: l
                    .waiting_since
                    .map(|t| format!("{} ago", view::age(secs(now - t))))
                    .unwrap_or_else(|| "-".to_owned()),
                perspective: l.perspective_name,
            })
            .collect(),
    };
    Ok(view::render(&page).into_response())
}
