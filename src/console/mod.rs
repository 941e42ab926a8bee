//! The operator console (SPEC §4.4): server-rendered pages on `console.listen`.
//!
//! What is here so far (the read side):
//! - `GET /` — the overview ([`pages::overview`]): per perspective pending, leased, parked, open
//!   dead letters and the oldest pending age, then the live instances; it refreshes itself
//!   every [`REFRESH_SECONDS`] with a `<meta http-equiv="refresh">`, paused by `?refresh=off`;
//! - `GET /dead-letters` — the list ([`pages::dead_letters`]), every filter in the URL (a GET
//!   form), a count, keyset pages;
//! - `GET /dead-letters/{position}/{perspective}` — the detail ([`pages::detail`]), the event
//!   re-read live from `wh_event_store` as `vantage dlq inspect` does;
//! - `GET /console.css` — the one stylesheet, embedded in the binary;
//! - `POST /actions` — a placeholder that answers 501 (403 in read-only mode): the seam where
//!   replay, requeue and purge will go. It exists so every POST already passes the CSRF check.
//!
//! Safety, in the order a request meets it (outermost first): the security headers on every
//! response ([`security::headers`]), the cross-site check of every unsafe method
//! ([`security::reject_cross_site`]), then authentication ([`auth`]) when credentials are
//! configured. No JavaScript, nothing loaded from elsewhere, no CORS. Every statement runs with
//! [`STATEMENT_TIMEOUT`] ([`Store::with_statement_timeout`]).

pub mod auth;
mod error;
mod pages;
pub mod security;
mod view;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::ConsoleSettings;
use crate::store::Store;

pub use auth::{ConsoleUser, Credentials};

/// Every statement of the console is cancelled by the server after this long.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Seconds between the overview's own refreshes.
pub const REFRESH_SECONDS: u32 = 10;

/// Rows of a dead-letter page unless `limit` says otherwise.
pub const DEFAULT_PAGE_SIZE: u32 = 50;

/// Most rows a `limit` may ask for.
pub const MAX_PAGE_SIZE: u32 = 500;

/// What every handler reads. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ConsoleState {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    store: Store,
    credentials: Credentials,
    read_only: bool,
}

impl ConsoleState {
    /// The console over `store` (give it one from [`Store::with_statement_timeout`]) with the
    /// `[console]` settings' credentials and mode.
    pub fn new(store: Store, settings: &ConsoleSettings) -> Self {
        ConsoleState {
            inner: Arc::new(Inner {
                store,
                credentials: Credentials::from_settings(settings),
                read_only: settings.read_only,
            }),
        }
    }

    fn store(&self) -> &Store {
        &self.inner.store
    }

    fn read_only(&self) -> bool {
        self.inner.read_only
    }
}

/// Every route, with the security layers.
pub fn router(state: ConsoleState) -> Router {
    let routes = Router::new()
        .route("/", get(pages::overview::show))
        .route("/dead-letters", get(pages::dead_letters::show))
        .route(
            "/dead-letters/{position}/{perspective}",
            get(pages::detail::show),
        )
        .route("/console.css", get(view::stylesheet))
        .route("/actions", post(pages::actions::placeholder))
        .fallback(pages::not_found)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require,
        ))
        .with_state(state);
    security::headers(routes.layer(axum::middleware::from_fn(security::reject_cross_site)))
}

/// Binds `listen` (port 0 picks a free one) and returns the listener with its real address.
///
/// # Errors
/// The address cannot be bound.
pub async fn bind(listen: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(listen).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

/// Serves the console on `listener` until `shutdown` is cancelled, then returns once open
/// requests are answered.
///
/// # Errors
/// The server failed.
pub async fn serve(
    listener: TcpListener,
    state: ConsoleState,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    // The same request-head timeout and connection cap as the probes' server.
    let listener = crate::telemetry::http::BoundedListener::new(
        listener,
        crate::telemetry::http::Limits::default(),
    );
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}
