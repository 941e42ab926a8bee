//! The limits under attack: half-sent, trickled and returning connections against the probes,
//! and requests that outlast the head deadline (issue 19, defects 2 and 3: the head timeout
//! bounds reading a request head and nothing else, and connections that were answered cannot
//! crowd the probes out).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::routing;
use axum::Router;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use super::super::test_support::{get, start, start_with};
use super::super::{bind, router, serve_with, Health, HttpState};
use super::{Limits, MAX_CONNECTIONS};

/// Opens `n` connections that each send part of a request head and then nothing; each
/// waits for the server to close it and counts that in the returned counter.
async fn half_sent(addr: SocketAddr, n: usize) -> Arc<std::sync::atomic::AtomicUsize> {
    let closed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for _ in 0..n {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .expect("write");
        let closed = Arc::clone(&closed);
        tokio::spawn(async move {
            let mut buf = [0u8; 256];
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
            closed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
    }
    closed
}

async fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let started = std::time::Instant::now();
    while !done() {
        assert!(started.elapsed() < limit, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_half_sent_requests_cannot_starve_the_probes() {
    let (addr, shutdown, task) = start(Health::new()).await;
    let closed = half_sent(addr, 1000).await;
    // The probe answers at once, although 1000 requests hang half-sent.
    let (status, _, body) = tokio::time::timeout(Duration::from_secs(2), get(addr, "/healthz"))
        .await
        .expect("/healthz answers promptly");
    assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));
    // The server keeps at most its cap of them open: the others are closed (and with them
    // their file descriptors).
    wait_until(
        Duration::from_secs(10),
        "the connections over the cap are closed",
        || closed.load(std::sync::atomic::Ordering::SeqCst) >= 1000 - MAX_CONNECTIONS,
    )
    .await;
    shutdown.cancel();
    task.await.expect("server stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_not_sent_in_time_is_closed_and_answered_connections_are_kept() {
    let handle = crate::telemetry::recorder::install().expect("recorder");
    let (listener, addr) = bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .expect("bind");
    let shutdown = CancellationToken::new();
    let limits = Limits {
        max_connections: 8,
        request_head_timeout: Duration::from_millis(300),
    };
    let task = tokio::spawn(serve_with(
        listener,
        HttpState::new(handle, Health::new()),
        shutdown.clone(),
        limits,
    ));

    // Half-sent, and trickled a byte at a time (slowloris): both closed after the timeout.
    let closed = half_sent(addr, 1).await;
    let mut trickle = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let trickled = tokio::spawn(async move {
        for b in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: "
            .iter()
            .cycle()
            .take(200)
        {
            if trickle.write_all(&[*b]).await.is_err() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    });
    wait_until(
        Duration::from_secs(5),
        "the half-sent request is closed",
        || closed.load(std::sync::atomic::Ordering::SeqCst) == 1,
    )
    .await;
    assert!(
        tokio::time::timeout(Duration::from_secs(5), trickled)
            .await
            .expect("the trickled request is closed")
            .expect("join"),
        "the trickled request was kept open"
    );

    // A keep-alive connection that sends its requests promptly is served, request after
    // request, beyond the cap's worth of half-sent ones that come and go.
    let mut alive = tokio::net::TcpStream::connect(addr).await.expect("connect");
    for round in 0..3 {
        // Once answered, it is not the one that makes room for newcomers.
        let _more = if round > 0 {
            Some(half_sent(addr, 10).await)
        } else {
            None
        };
        alive
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = vec![0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(2), alive.read(&mut buf))
            .await
            .expect("answered promptly")
            .expect("read");
        let text = String::from_utf8_lossy(&buf[..n]);
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    shutdown.cancel();
    task.await.expect("join").expect("server stops");
}

fn probes() -> Router {
    let handle = crate::telemetry::recorder::install().expect("recorder");
    router(HttpState::new(handle, Health::new()))
}

/// Reads one response (head and `Content-Length` body) from `stream`.
async fn read_response(stream: &mut TcpStream) -> String {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        raw.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&raw);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if body.len() >= len {
                break;
            }
        }
    }
    String::from_utf8_lossy(&raw).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answered_connections_that_start_a_next_request_cannot_starve_the_probes() {
    // A long head timeout, so eviction is what has to make room.
    let limits = Limits {
        max_connections: 8,
        request_head_timeout: Duration::from_secs(60),
    };
    let (addr, shutdown, task) = start_with(probes(), limits).await;
    // Fill every slot with connections that got one answer and then sent one byte of a
    // next request.
    let mut attackers = Vec::new();
    for _ in 0..8 {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        let answer = read_response(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        s.write_all(b"G").await.expect("write");
        attackers.push(s);
    }
    let mut answered = 0;
    for _ in 0..27 {
        let probe = async {
            let mut s = TcpStream::connect(addr).await.ok()?;
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .ok()?;
            let mut raw = Vec::new();
            s.read_to_end(&mut raw).await.ok()?;
            Some(String::from_utf8_lossy(&raw).starts_with("HTTP/1.1 200"))
        };
        if let Ok(Some(true)) = tokio::time::timeout(Duration::from_secs(2), probe).await {
            answered += 1;
        }
        // The attack goes on: the evicted attacker comes back in the same shape.
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        let _ = tokio::time::timeout(Duration::from_secs(2), read_response(&mut s)).await;
        let _ = s.write_all(b"G").await;
        attackers.push(s);
    }
    assert_eq!(answered, 27, "probes answered during the attack");
    shutdown.cancel();
    drop(attackers);
    task.await.expect("server stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_longer_than_the_head_timeout_is_answered() {
    let limits = Limits {
        max_connections: 8,
        request_head_timeout: Duration::from_millis(300),
    };
    let slow = Router::new().route(
        "/slow",
        routing::get(|| async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            "done"
        })
        .post(|body: String| async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            format!("got {}", body.len())
        }),
    );
    let (addr, shutdown, task) = start_with(slow, limits).await;
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let answer = tokio::time::timeout(Duration::from_secs(10), read_response(&mut s))
        .await
        .expect("answered");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("done"), "{answer}");
    // The same keep-alive connection, a POST with a body: also answered in full.
    s.write_all(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        .await
        .expect("write");
    let answer = tokio::time::timeout(Duration::from_secs(10), read_response(&mut s))
        .await
        .expect("answered");
    assert!(answer.ends_with("got 3"), "{answer}");
    // And an idle keep-alive connection is still closed after the head timeout.
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("the idle connection is closed");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    shutdown.cancel();
    task.await.expect("server stops");
}
