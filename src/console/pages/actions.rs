//! The seam of the action pages (replay, requeue, purge; bulk with a preview): not in this
//! version. `POST /actions` exists so that every POST already meets the cross-site check and
//! authentication; it answers 403 in read-only mode and 501 otherwise, and changes nothing.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::console::{error, ConsoleState};

/// `POST /actions`.
pub async fn placeholder(State(state): State<ConsoleState>) -> Response {
    let (status, message) = if state.read_only() {
        (
            StatusCode::FORBIDDEN,
            "This console is read-only (console.read_only = true): it changes nothing.",
        )
    } else {
        (
            StatusCode::NOT_IMPLEMENTED,
            "Actions are not available in this version of the console; use `vantage dlq replay`, `requeue` or `purge`. Nothing was done.",
        )
    };
    (status, error::page(status, "No action taken", message)).into_response()
}
