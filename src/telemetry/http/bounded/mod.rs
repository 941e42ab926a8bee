//! Connection limits for every HTTP surface (the probes' server and the console both serve
//! through [`serve_router`]), so that slow or half-sent requests cannot starve the probes (nor
//! use up the process's file descriptors).
//!
//! A connection must send its request head within [`Limits::request_head_timeout`] of being
//! accepted or answered (that deadline bounds reading the head, nothing else: a long request is
//! never cut), its body within [`REQUEST_BODY_TIMEOUT`], and at most
//! [`Limits::max_connections`] are open at once. At the cap, a new connection is taken and the
//! oldest of the first kind there is is closed: one never answered that is part-way through a
//! head, then one answered that waits for (or is part-way through) its next head, then one whose
//! head is complete but whose announced body is still arriving, then one that has sent nothing
//! although the server tried to read it. A new connection's first bytes are read when it is
//! accepted, so a probe, which sends its request at once, is being served from its first moment;
//! a request being handled (no body, or its body read) is never closed. A newcomer finding
//! nothing to close looks again a few times, letting the connections accepted before it be
//! read, then is turned away. So a probe gets in unless every slot is handling a request,
//! whatever mix of slow, half-sent, trickled or returning connections an attacker keeps up.
//!
//! The pieces: [`listener`] admits connections and picks which to close, [`io`] enforces the
//! head deadline on each, [`conn`] is what both know about one connection, and [`head`] finds
//! where a request head ends.

mod conn;
mod head;
mod io;
mod listener;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Router;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use conn::Connection;
use listener::BoundedListener;

/// How long a connection may take to send a request head, counted from when it was accepted
/// or last answered (so it is also how long an idle keep-alive connection is kept). It bounds
/// reading the head and nothing else: a request whose head is complete runs as long as its
/// handler takes.
pub const REQUEST_HEAD_TIMEOUT: Duration = Duration::from_secs(5);

/// Most connections served at once (far below the unit's `LimitNOFILE`, leaving room for the
/// database pool).
pub const MAX_CONNECTIONS: usize = 256;

/// Bounds on the HTTP connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most connections served at once.
    pub max_connections: usize,
    /// Time to send a request head, from accept or from the last response.
    pub request_head_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: MAX_CONNECTIONS,
            request_head_timeout: REQUEST_HEAD_TIMEOUT,
        }
    }
}

/// How long a request body may take to arrive, in all (counted from when its head was read).
/// The head deadline no longer covers a request once its head is complete, so this is what
/// keeps a body sent a byte at a time from holding a connection slot.
pub const REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest request body read (the console's forms are far smaller): 2 MiB.
pub const MAX_REQUEST_BODY: usize = 2 * 1024 * 1024;

/// Serves any `router` on `listener` under `limits` until `shutdown` is cancelled (the probes'
/// server and the console's both go through here).
pub(crate) async fn serve_router(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
    limits: Limits,
) -> std::io::Result<()> {
    let listener = BoundedListener::new(listener, limits);
    let router = router.layer(axum::middleware::from_fn(read_body_in_time));
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<Connection>(),
    )
    .with_graceful_shutdown(shutdown.cancelled_owned())
    .await
}

/// Reads the whole request body within [`REQUEST_BODY_TIMEOUT`] and [`MAX_REQUEST_BODY`]
/// before the handler runs: `408` if it is too slow, `413` if it is too big.
///
/// Until its body is read, a request's connection may still be closed to make room (see
/// [`listener::BoundedListener`]): a body that trickles must not hold a slot the probes need.
/// From then on, while its handler runs, it never is.
async fn read_body_in_time(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (parts, body) = request.into_parts();
    let connection = parts
        .extensions
        .get::<axum::extract::ConnectInfo<Connection>>()
        .map(|c| Arc::clone(&c.0 .0));
    match tokio::time::timeout(
        REQUEST_BODY_TIMEOUT,
        axum::body::to_bytes(body, MAX_REQUEST_BODY),
    )
    .await
    {
        Ok(Ok(bytes)) => {
            if let Some(c) = connection {
                c.handling.store(true, Ordering::Release);
            }
            next.run(axum::extract::Request::from_parts(parts, bytes.into()))
                .await
        }
        Ok(Err(_)) => (StatusCode::PAYLOAD_TOO_LARGE, "request body too large\n").into_response(),
        Err(_) => (
            StatusCode::REQUEST_TIMEOUT,
            "request body not sent in time\n",
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests;
