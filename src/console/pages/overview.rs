//! `GET /`: what `vantage status` shows, per perspective and per live instance, refreshing
//! itself unless `?refresh=off`.

use axum::extract::{Query, State};
use axum::response::{Html, IntoResponse, Response};
use serde::Deserialize;

use crate::console::error::PageError;
use crate::console::view::{self, InstanceRow, OverviewPage, PerspectiveRow, VersionRow};
use crate::console::{ConsoleState, REFRESH_SECONDS};

/// The overview's query: `refresh=off` pauses the auto-refresh.
#[derive(Debug, Default, Deserialize)]
pub struct OverviewQuery {
    refresh: Option<String>,
    flash: Option<String>,
}

/// `GET /`.
pub async fn show(
    State(state): State<ConsoleState>,
    Query(query): Query<OverviewQuery>,
) -> Result<Response, PageError> {
    let store = state.store();
    let perspectives = store.perspective_status().await?;
    let instances = store.live_instances().await?;
    let now = store.database_now().await?;
    let blocked = store.blocked_totals(None).await?;
    let versions = store.all_version_status().await?;

    let paused = query.refresh.as_deref() == Some("off");
    let page = OverviewPage {
        read_only: state.read_only(),
        flash: state.flash(query.flash.as_deref()),
        now: view::at(&now),
        refresh_seconds: (!paused).then_some(REFRESH_SECONDS),
        refresh_every: REFRESH_SECONDS,
        perspectives: perspectives
            .into_iter()
            .map(|p| PerspectiveRow {
                blocked_lanes: blocked
                    .iter()
                    .find(|b| b.perspective_name == p.perspective_name)
                    .map_or(0, |b| b.lanes),
                blocked_events: blocked
                    .iter()
                    .find(|b| b.perspective_name == p.perspective_name)
                    .map_or(0, |b| b.events),
                blocked_href: view::href(
                    "/blocked",
                    &[("perspective", p.perspective_name.as_str())],
                ),
                paused: p.paused_at.map(|since| {
                    let mut text = format!(
                        "paused since {} ({} ago)",
                        view::at(&since),
                        view::age((now - since).num_milliseconds() as f64 / 1000.0)
                    );
                    if let Some(by) = &p.paused_by {
                        text.push_str(&format!(" by {by}"));
                    }
                    if let Some(reason) = &p.paused_reason {
                        text.push_str(&format!(": {reason}"));
                    }
                    text
                }),
                dead_letters_href: view::dead_letters_href(&[(
                    "perspective",
                    p.perspective_name.as_str(),
                )]),
                oldest_age: p
                    .oldest_pending_age_seconds
                    .map(view::age)
                    .unwrap_or_else(|| "-".to_owned()),
                lag_seconds: p
                    .oldest_pending_age_seconds
                    .map(|s| format!("{:.0}", s.max(0.0).floor()))
                    .unwrap_or_else(|| "-".to_owned()),
                name: p.perspective_name,
                pending: p.pending,
                leased: p.leased,
                parked: p.parked,
                dead_lettered: p.dead_lettered,
            })
            .collect(),
        versions: versions
            .into_iter()
            .map(|v| VersionRow {
                backfill: v.backfill_summary(),
                since: v
                    .live_since
                    .filter(|_| v.state == "live")
                    .map(|at| format!("live since {}", view::at(&at)))
                    .unwrap_or_else(|| format!("registered {}", view::at(&v.created_at))),
                live: v.state == "live",
                perspective: v.perspective_name,
                version: v.version,
                state: v.state,
                behind: v.behind,
                schema: v.version_schema,
            })
            .collect(),
        instances: instances
            .into_iter()
            .map(|i| InstanceRow {
                instance_id: i.instance_id.to_string(),
                host_name: i.host_name,
                process_id: i.process_id,
                version: i.version,
                started_at: view::at(&i.started_at),
                heartbeat_age: view::age(
                    (now - i.last_heartbeat_at).num_milliseconds() as f64 / 1000.0,
                ),
            })
            .collect(),
    };
    let html: Html<String> = view::render(&page);
    Ok(html.into_response())
}
