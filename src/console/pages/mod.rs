//! The pages, one file each. Each handler reads through the console's [`Store`](crate::store::Store)
//! (statement timeout included) and renders one template of [`view`](super::view).

pub mod actions;
pub mod blocked;
pub mod bulk;
pub mod dead_letters;
pub mod detail;
pub mod groups;
pub mod overview;
pub mod perspective;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// Any other path: 404.
pub async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        super::error::page(
            StatusCode::NOT_FOUND,
            "Not found",
            "There is no such page in this console.",
        ),
    )
        .into_response()
}
