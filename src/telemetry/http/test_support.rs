//! What the HTTP tests share: a server on a free port, and a one-shot `GET`.

use std::net::SocketAddr;

use axum::Router;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::{bind, serve_on, serve_router, Health, HttpState, Limits};

pub(super) async fn get(addr: SocketAddr, path: &str) -> (u16, String, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.expect("read");
    let text = String::from_utf8(raw).expect("utf-8");
    let (head, body) = text.split_once("\r\n\r\n").expect("head and body");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status code");
    (status, head.to_owned(), body.to_owned())
}

pub(super) async fn start(
    health: Health,
) -> (SocketAddr, CancellationToken, tokio::task::JoinHandle<()>) {
    let handle = crate::telemetry::recorder::install().expect("recorder");
    let (listener, addr) = bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("bind");
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(serve_on(
        listener,
        HttpState::new(handle, health),
        shutdown.clone(),
    ));
    let task = tokio::spawn(async move { task.await.expect("join").expect("serve") });
    (addr, shutdown, task)
}

/// Serves `router` under `limits` on a free port.
pub(super) async fn start_with(
    router: Router,
    limits: Limits,
) -> (SocketAddr, CancellationToken, tokio::task::JoinHandle<()>) {
    let (listener, addr) = bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("bind");
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(serve_router(listener, router, shutdown.clone(), limits));
    let task = tokio::spawn(async move { task.await.expect("join").expect("serve") });
    (addr, shutdown, task)
}
