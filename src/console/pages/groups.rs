//! `GET /groups`: open dead letters grouped by error fingerprint, biggest first, as
//! `vantage dlq groups` shows them (`?perspective=` narrows it). Each group links to the list
//! filtered by it (`/dead-letters?group=FP`) and to the bulk previews of that filter
//! (`/bulk?action=requeue&group=FP`, …): acting on a group goes through the same preview, count
//! and confirmation as every bulk action. Each group shows its open dead letters' arrivals over
//! `?window=` (1h by default, 6h, 24h) as a sparkline, so whether it is still happening reads at
//! a glance; one statement for all groups.

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::actions::Action;
use super::dead_letters::given;
use crate::console::error::PageError;
use crate::console::history::{self, Span};
use crate::console::view::{self, GroupRow, GroupsPage};
use crate::console::ConsoleState;

/// The query: an optional perspective, the sparklines' window.
#[derive(Debug, Default, Deserialize)]
pub struct GroupsQuery {
    perspective: Option<String>,
    flash: Option<String>,
    window: Option<String>,
}

/// `GET /groups`.
pub async fn show(
    State(state): State<ConsoleState>,
    Query(q): Query<GroupsQuery>,
) -> Result<Response, PageError> {
    let span = Span::parse(q.window.as_deref())?;
    let perspective = given(&q.perspective);
    let store = state.store();
    let groups = store.error_groups(perspective.as_deref()).await?;
    let now = store.database_now().await?;
    let mut arrivals = history::group_sparklines(store, perspective.as_deref(), span, now).await?;
    let total: i64 = groups.iter().map(|g| g.count).sum();
    let window_links = history::links(
        "/groups",
        span,
        &[("perspective", perspective.as_deref().unwrap_or(""))],
    );
    let page = GroupsPage {
        window_label: span.label(),
        window_links,
        read_only: state.read_only(),
        flash: state.flash(q.flash.as_deref()),
        perspective: perspective.unwrap_or_default(),
        total,
        groups: groups
            .into_iter()
            .map(|g| {
                let fp = g.fingerprint.as_str();
                let bulk = if state.read_only() {
                    Vec::new()
                } else {
                    [Action::Requeue, Action::Purge, Action::Replay]
                        .into_iter()
                        .map(|a| {
                            (
                                a.label(),
                                view::href("/bulk", &[("action", a.name()), ("group", fp)]),
                            )
                        })
                        .collect()
                };
                let (recent, sparkline) = arrivals
                    .remove(fp)
                    .unwrap_or_else(|| (0, history::quiet_sparkline(span)));
                GroupRow {
                    recent,
                    sparkline,
                    list_href: view::dead_letters_href(&[("group", fp)]),
                    sample_href: view::detail_href(g.sample_position, &g.perspective_name),
                    fingerprint: g.fingerprint.clone(),
                    perspective: g.perspective_name,
                    event_type: g.event_type.unwrap_or_else(|| "(unknown)".to_owned()),
                    sqlstate: g.sqlstate.unwrap_or_else(|| "-".to_owned()),
                    message: g.message,
                    count: g.count,
                    first_seen: view::at(&g.first_seen),
                    last_seen: view::at(&g.last_seen),
                    sample_position: g.sample_position,
                    bulk,
                }
            })
            .collect(),
    };
    Ok(view::render(&page).into_response())
}
