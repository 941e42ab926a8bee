//! One connection's reads and writes: the head deadline, eviction, and when a request ends.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use super::conn::ConnState;
use super::head::HeadScan;

/// A connection under [`Limits`]: while it waits for a request head, its reads fail once the
/// head deadline has passed; once the head is complete, nothing times out until the response
/// is written (the server polls reads while a handler runs, and a long request must not be
/// cut). Evicted by the listener, its reads fail, which makes the server close it.
pub(super) struct BoundedIo {
    stream: TcpStream,
    conn: Arc<ConnState>,
    head: HeadScan,
    /// Bytes read when it was accepted, not yet handed to the server.
    early: Vec<u8>,
    timeout: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl BoundedIo {
    /// A connection just admitted: `early` holds what was read from it then (already fed to
    /// `head`); its head deadline starts now.
    pub(super) fn new(
        stream: TcpStream,
        conn: Arc<ConnState>,
        head: HeadScan,
        early: Vec<u8>,
        timeout: Duration,
    ) -> Self {
        BoundedIo {
            stream,
            conn,
            head,
            early,
            timeout,
            deadline: Box::pin(tokio::time::sleep(timeout)),
        }
    }

    /// What the listener knows about this connection.
    pub(super) fn conn(&self) -> &Arc<ConnState> {
        &self.conn
    }

    /// `written` went out. A response (not an interim `100 Continue`) ends the request: the
    /// connection waits for its next head, under a fresh deadline.
    fn wrote(&mut self, written: &[u8]) {
        if self.conn.serving.load(Ordering::Acquire) && written.starts_with(b"HTTP/1.1 1") {
            return;
        }
        self.conn.answered.store(true, Ordering::Release);
        self.conn.serving.store(false, Ordering::Release);
        self.conn.started_head.store(false, Ordering::Release);
        self.conn.handling.store(false, Ordering::Release);
        self.head = HeadScan::default();
        self.deadline.as_mut().reset(Instant::now() + self.timeout);
        // A read that went pending while the request was served did not arm the deadline:
        // wake it, so that it is polled again and does.
        let reader = self
            .conn
            .reader
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(waker) = reader {
            waker.wake();
        }
    }
}

fn evicted() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "closed to make room for another connection",
    )
}

impl AsyncRead for BoundedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.conn.evicted.load(Ordering::Acquire) {
            return Poll::Ready(Err(evicted()));
        }
        this.conn.polled.store(true, Ordering::Release);
        if !this.early.is_empty() {
            // Already fed to the head scan when accepted.
            let n = this.early.len().min(buf.remaining());
            buf.put_slice(&this.early[..n]);
            this.early.drain(..n);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let read = &buf.filled()[before..];
                if !this.conn.serving.load(Ordering::Acquire) && !read.is_empty() {
                    this.conn.started_head.store(true, Ordering::Release);
                    if this.head.feed(read) {
                        this.conn.head_complete(this.head.announces_body());
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                *this
                    .conn
                    .reader
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = Some(cx.waker().clone());
                // Evicted between the check above and storing the waker: nobody will wake us.
                if this.conn.evicted.load(Ordering::Acquire) {
                    return Poll::Ready(Err(evicted()));
                }
                if !this.conn.serving.load(Ordering::Acquire)
                    && this.deadline.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no complete request in time",
                    )));
                }
                Poll::Pending
            }
        }
    }
}

impl AsyncWrite for BoundedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = written {
            if n > 0 {
                this.wrote(&buf[..n]);
            }
        }
        written
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = written {
            if n > 0 {
                let first = bufs
                    .iter()
                    .find(|b| !b.is_empty())
                    .map_or(&[][..], |b| &b[..]);
                this.wrote(first);
            }
        }
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl Drop for BoundedIo {
    fn drop(&mut self) {
        self.conn.closed.store(true, Ordering::Release);
    }
}
