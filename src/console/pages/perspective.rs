//! `GET /perspectives/{name}`: one perspective's numbers (as on the overview), its versions,
//! and its charts over `?window=` (1h by default, 6h, 24h). 404 for a name that is neither
//! registered nor has work or dead letters.

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::overview::{perspective_row, version_row};
use crate::console::error::PageError;
use crate::console::history::{self, Span};
use crate::console::view::{self, HistoryView, PerspectivePage};
use crate::console::ConsoleState;

/// The query: the charts' window.
#[derive(Debug, Default, Deserialize)]
pub struct PerspectiveQuery {
    window: Option<String>,
    flash: Option<String>,
}

/// `GET /perspectives/{name}`.
pub async fn show(
    State(state): State<ConsoleState>,
    Path(name): Path<String>,
    Query(query): Query<PerspectiveQuery>,
) -> Result<Response, PageError> {
    let span = Span::parse(query.window.as_deref())?;
    let store = state.store();
    let Some(status) = store
        .perspective_status()
        .await?
        .into_iter()
        .find(|p| p.perspective_name == name)
    else {
        return Err(PageError::NotFound(format!(
            "There is no perspective named {:?}.",
            crate::text::one_line(&crate::text::cap_at(&name, 200))
        )));
    };
    let now = store.database_now().await?;
    let blocked = store.blocked_totals(Some(&name)).await?;
    let versions = store
        .all_version_status()
        .await?
        .into_iter()
        .filter(|v| v.perspective_name == name)
        .map(version_row)
        .collect();
    let charts =
        history::charts(store, Some(&name), std::slice::from_ref(&name), span, now).await?;
    let path = view::perspective_href(&name);
    let page = PerspectivePage {
        read_only: state.read_only(),
        flash: state.flash(query.flash.as_deref()),
        now: view::at(&now),
        p: perspective_row(status, &blocked, now),
        versions,
        history: HistoryView {
            label: span.label(),
            links: history::links(&path, span, &[]),
            charts,
        },
    };
    Ok(view::render(&page).into_response())
}
