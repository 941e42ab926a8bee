//! What a page says when it cannot show what was asked: a small HTML page with the status,
//! never a stack trace, a query or a secret.

use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};

use super::view::{render, ErrorPage};
use crate::store::StoreError;

/// The error page body for `status`.
pub fn page(status: StatusCode, title: &str, message: &str) -> Html<String> {
    render(&ErrorPage {
        read_only: false,
        flash: None,
        status: status.as_u16(),
        title,
        message,
    })
}

/// Why a page could not be shown.
#[derive(Debug)]
pub enum PageError {
    /// A query parameter is wrong: 400, naming it.
    BadRequest(String),
    /// Nothing there: 404.
    NotFound(String),
    /// The database failed or took too long: 503.
    Store(StoreError),
    /// The page cannot be made now (e.g. a count that took too long): 503, saying what to do.
    Unavailable(String),
}

impl From<StoreError> for PageError {
    fn from(e: StoreError) -> Self {
        PageError::Store(e)
    }
}

/// SQLSTATE 57014: the statement ran into the console's `statement_timeout`.
fn timed_out(e: &StoreError) -> bool {
    matches!(e, StoreError::Database(sqlx::Error::Database(db)) if db.code().as_deref() == Some("57014"))
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let (status, title, message) = match self {
            PageError::BadRequest(m) => (StatusCode::BAD_REQUEST, "Bad request", m),
            PageError::NotFound(m) => (StatusCode::NOT_FOUND, "Not found", m),
            PageError::Unavailable(m) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "Not available now",
                m,
            ),
            PageError::Store(e) if timed_out(&e) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "The database took too long",
                format!(
                    "The query was cancelled after {} s (the console's statement_timeout). Narrow the filter and try again.",
                    super::STATEMENT_TIMEOUT.as_secs()
                ),
            ),
            PageError::Store(e) => {
                tracing::warn!(error = %e, "console: a page could not read the database");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "The database did not answer",
                    format!("{e}. Try again in a moment."),
                )
            }
        };
        (status, page(status, title, &message)).into_response()
    }
}
