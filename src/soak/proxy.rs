//! The TCP proxy the daemons reach the database through, so the soak can make the database
//! unreachable without touching it: black-holed, the proxy keeps every socket open and accepts
//! new ones, but forwards nothing in either direction (what a network partition looks like to
//! a client: no reset, no answer). Opened again, what was held is forwarded.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A running proxy on 127.0.0.1.
pub struct Proxy {
    port: u16,
    open: watch::Sender<bool>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free port of 127.0.0.1 and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let port = listener.local_addr()?.port();
        let (open, watcher) = watch::channel(true);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let _ = client.set_nodelay(true);
                tokio::spawn(forward(client, upstream, watcher.clone()));
            }
        });
        Ok(Proxy { port, open, accept })
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops forwarding (true) or forwards again (false).
    pub fn blackhole(&self, on: bool) {
        let _ = self.open.send(!on);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn wait_open(open: &mut watch::Receiver<bool>) {
    // An error means the proxy is gone: then nothing waits any more.
    let _ = open.wait_for(|o| *o).await;
}

async fn forward(client: TcpStream, upstream: SocketAddr, mut open: watch::Receiver<bool>) {
    wait_open(&mut open).await;
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    tokio::join!(pipe(cr, sw, open.clone()), pipe(sr, cw, open));
}

async fn pipe<R, W>(mut from: R, mut to: W, mut open: watch::Receiver<bool>)
where
    R: AsyncReadExt + Unpin,
    W: AsyncWriteExt + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // Black-holed: hold what was read (and, by not reading more, everything behind it).
        wait_open(&mut open).await;
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn forwards_and_holds_while_blackholed() {
        let echo = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let upstream = echo.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let mut b = [0u8; 64];
                    while let Ok(n) = s.read(&mut b).await {
                        if n == 0 || s.write_all(&b[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let proxy = Proxy::start(upstream).await.unwrap();
        let mut c = TcpStream::connect(("127.0.0.1", proxy.port()))
            .await
            .unwrap();
        let mut b = [0u8; 4];
        c.write_all(b"ping").await.unwrap();
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"ping");

        proxy.blackhole(true);
        c.write_all(b"held").await.unwrap();
        let held = tokio::time::timeout(Duration::from_millis(300), c.read_exact(&mut b)).await;
        assert!(held.is_err(), "nothing may come back while black-holed");
        proxy.blackhole(false);
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"held");
    }
}
