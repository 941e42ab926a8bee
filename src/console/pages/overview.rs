//! `GET /`: what `vantage status` shows, per perspective and per live instance, refreshing
//! itself unless `?refresh=off`, and the charts of the whole system over `?window=` (1h by
//! default, 6h, 24h: [`Span`]).

use axum::extract::{Query, State};
use axum::response::{Html, IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::Deserialize;

use crate::console::error::PageError;
use crate::console::history::{self, Span};
use crate::console::view::{
    self, HistoryView, InstanceRow, OverviewPage, PerspectiveRow, VersionRow,
};
use crate::console::{ConsoleState, REFRESH_SECONDS};
use crate::store::{BlockedTotals, PerspectiveStatus, VersionStatus};

/// The overview's query: `refresh=off` pauses the auto-refresh; `window` picks the charts'
/// window (`1h`, `6h`, `24h`; anything else is a 400).
#[derive(Debug, Default, Deserialize)]
pub struct OverviewQuery {
    refresh: Option<String>,
    flash: Option<String>,
    window: Option<String>,
}

/// The overview's (and a perspective page's) row of one perspective.
pub(super) fn perspective_row(
    p: PerspectiveStatus,
    blocked: &[BlockedTotals],
    now: DateTime<Utc>,
) -> PerspectiveRow {
    let blocked = blocked
        .iter()
        .find(|b| b.perspective_name == p.perspective_name);
    PerspectiveRow {
        blocked_lanes: blocked.map_or(0, |b| b.lanes),
        blocked_events: blocked.map_or(0, |b| b.events),
        blocked_href: view::href("/blocked", &[("perspective", p.perspective_name.as_str())]),
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
        dead_letters_href: view::dead_letters_href(&[("perspective", p.perspective_name.as_str())]),
        oldest_age: p
            .oldest_pending_age_seconds
            .map(view::age)
            .unwrap_or_else(|| "-".to_owned()),
        lag_seconds: p
            .oldest_pending_age_seconds
            .map(|s| format!("{:.0}", s.max(0.0).floor()))
            .unwrap_or_else(|| "-".to_owned()),
        href: view::perspective_href(&p.perspective_name),
        name: p.perspective_name,
        pending: p.pending,
        leased: p.leased,
        parked: p.parked,
        dead_lettered: p.dead_lettered,
    }
}

/// A row of the versions table.
pub(super) fn version_row(v: VersionStatus) -> VersionRow {
    VersionRow {
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
    }
}

/// `GET /`.
pub async fn show(
    State(state): State<ConsoleState>,
    Query(query): Query<OverviewQuery>,
) -> Result<Response, PageError> {
    let span = Span::parse(query.window.as_deref())?;
    let store = state.store();
    let perspectives = store.perspective_status().await?;
    let instances = store.live_instances().await?;
    let now = store.database_now().await?;
    let blocked = store.blocked_totals(None).await?;
    let versions = store.all_version_status().await?;
    let names: Vec<String> = perspectives
        .iter()
        .map(|p| p.perspective_name.clone())
        .collect();
    let charts = history::charts(store, None, &names, span, now).await?;

    let paused = query.refresh.as_deref() == Some("off");
    let window = span.link_param();
    let keep: &[(&str, &str)] = if paused { &[("refresh", "off")] } else { &[] };
    let page = OverviewPage {
        read_only: state.read_only(),
        flash: state.flash(query.flash.as_deref()),
        now: view::at(&now),
        refresh_seconds: (!paused).then_some(REFRESH_SECONDS),
        refresh_every: REFRESH_SECONDS,
        pause_href: view::href("/", &[("window", window), ("refresh", "off")]),
        resume_href: view::href("/", &[("window", window)]),
        perspectives: perspectives
            .into_iter()
            .map(|p| perspective_row(p, &blocked, now))
            .collect(),
        versions: versions.into_iter().map(version_row).collect(),
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
        history: HistoryView {
            label: span.label(),
            links: history::links("/", span, keep),
            charts,
        },
    };
    let html: Html<String> = view::render(&page);
    Ok(html.into_response())
}
