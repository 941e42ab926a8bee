//! The operator console (docs/cli.md, "The console"): server-rendered pages on
//! `console.listen`.
//!
//! The routes:
//! - `GET /` — the overview (`pages::overview`): per perspective pending, leased, parked, open
//!   dead letters and the oldest pending age, charts of the whole system (applied events per
//!   second, backlog, lag, dead letters per minute) over `?window=1h|6h|24h` (1h by default;
//!   any other value is a 400), then the live instances; it refreshes itself every
//!   [`REFRESH_SECONDS`] with a `<meta http-equiv="refresh">`, paused by `?refresh=off`;
//! - `GET /perspectives/{name}` — one perspective (`pages::perspective`): its numbers, its
//!   versions and the same four charts of it alone (`?window=` as on the overview); 404 for an
//!   unknown name. The charts are inline SVG rendered on the server (`chart`), from the
//!   history the daemons keep in `wh_metric_samples` (`history`, docs/operations.md);
//! - `GET /dead-letters` — the list (`pages::dead_letters`), every filter in the URL (a GET
//!   form), a count, keyset pages;
//! - `GET /dead-letters/{position}/{perspective}` — the detail (`pages::detail`), the event
//!   re-read live from `wh_event_store` as `vantage dlq inspect` does; `POST` to the same path
//!   with `preview=replay` adds a replay's dry run (it runs the statement, rolled back: an
//!   action, so CSRF-checked and refused when read-only; a GET never runs one);
//! - `GET /groups` — open dead letters grouped by error fingerprint (`pages::groups`), each
//!   with a sparkline of its arrivals over `?window=`, linking to the list filtered by it and
//!   to the bulk previews of that filter;
//! - `GET /blocked` — the lanes whose head is parked or failing and what waits behind them
//!   (`pages::blocked`), as `vantage status --blocked` shows them;
//! - `GET /console.css` — the one stylesheet, embedded in the binary;
//! - `POST /actions` — one action on one dead letter (`pages::actions`): replay, requeue or
//!   purge, through [`crate::dlq`] exactly as `vantage dlq` does, then 303 to its detail page;
//! - `GET /bulk` — the preview of an action on every open dead letter matching a list filter
//!   (`pages::bulk`): the server's count, what exactly will change, a confirmation form;
//!   `POST /bulk` — the confirmed action, refused when the matching set changed since the
//!   preview; at most [`BULK_LIMIT`] dead letters per confirmation.
//!
//! In read-only mode (`console.read_only`) the action routes answer 403 and no page shows a
//! button. Every mutation writes the dead letter's history with the console user
//! ([`ConsoleUser`]) as actor, and one audit line at INFO (target [`AUDIT_TARGET`]).
//!
//! Safety, in the order a request meets it (outermost first): the security headers on every
//! response ([`security::headers`]), the cross-site check of every unsafe method
//! ([`security::reject_cross_site`]), then authentication ([`auth`]) when credentials are
//! configured. No JavaScript, nothing loaded from elsewhere, no CORS. Every statement runs with
//! [`STATEMENT_TIMEOUT`] ([`Store::with_statement_timeout`]).

pub mod auth;
mod chart;
mod error;
pub mod flash;
mod history;
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

use crate::config::{PerspectiveSettings, Settings};
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

/// Most dead letters one confirmed bulk action changes; when more match, it takes the lowest
/// positions and the rest wait for the next confirmation.
pub const BULK_LIMIT: u32 = 1000;

/// Rows of a bulk preview's sample.
pub const BULK_SAMPLE: usize = 25;

/// The `tracing` target of the audit lines, one per mutation.
pub const AUDIT_TARGET: &str = "vantage::console::audit";

/// What every handler reads. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ConsoleState {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    store: Store,
    credentials: Arc<Credentials>,
    read_only: bool,
    perspectives: Vec<PerspectiveSettings>,
    flashes: flash::Flashes,
}

impl ConsoleState {
    /// The console over `store` (give it one from [`Store::with_statement_timeout`]) with the
    /// `[console]` settings' credentials and mode, and the configuration's perspectives (the
    /// handlers a replay runs, as `vantage dlq replay` does).
    pub fn new(store: Store, settings: &Settings) -> Self {
        ConsoleState {
            inner: Arc::new(Inner {
                store,
                credentials: Arc::new(Credentials::from_settings(&settings.console)),
                read_only: settings.console.read_only,
                perspectives: settings.perspectives.clone(),
                flashes: flash::Flashes::default(),
            }),
        }
    }

    fn store(&self) -> &Store {
        &self.inner.store
    }

    fn read_only(&self) -> bool {
        self.inner.read_only
    }

    fn perspectives(&self) -> &[PerspectiveSettings] {
        &self.inner.perspectives
    }

    fn flashes(&self) -> &flash::Flashes {
        &self.inner.flashes
    }

    /// The message `?flash=ID` names, if any.
    fn flash(&self, id: Option<&str>) -> Option<flash::Flash> {
        self.flashes().get(id?)
    }
}

/// Every route, with the security layers.
pub fn router(state: ConsoleState) -> Router {
    let routes = Router::new()
        .route("/", get(pages::overview::show))
        .route("/dead-letters", get(pages::dead_letters::show))
        .route("/perspectives/{name}", get(pages::perspective::show))
        .route("/groups", get(pages::groups::show))
        .route("/blocked", get(pages::blocked::show))
        .route(
            "/dead-letters/{position}/{perspective}",
            get(pages::detail::show).post(pages::detail::preview),
        )
        .route("/console.css", get(view::stylesheet))
        .route("/actions", post(pages::actions::act))
        .route(
            "/bulk",
            get(pages::bulk::preview).post(pages::bulk::confirm),
        )
        .fallback(pages::not_found)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state.inner.credentials),
            auth::require,
        ))
        .with_state(state);
    security::headers(
        routes
            .layer(axum::middleware::from_fn(security::reject_nul))
            .layer(axum::middleware::from_fn(security::reject_cross_site)),
    )
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
    // The same request-head and body timeouts and connection cap as the probes' server.
    crate::telemetry::http::serve_router(
        listener,
        router(state),
        shutdown,
        crate::telemetry::http::Limits::default(),
    )
    .await
}
