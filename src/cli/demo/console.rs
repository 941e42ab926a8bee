//! The operator console beside the demo's daemon, so a newcomer can open the dead letters in a
//! browser (issue 10): on `console.listen`, or on a free port when that one is taken.

use std::net::SocketAddr;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::console::{self, ConsoleState};
use crate::store::Store;

/// The console the demo serves.
pub(super) struct DemoConsole {
    /// Where it listens.
    pub(super) addr: SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<std::io::Result<()>>,
}

impl DemoConsole {
    /// Binds and serves; `None` (with a line on stderr) when no port can be had: the demo goes on
    /// without it.
    pub(super) async fn start(settings: &Settings, store: &Store) -> Option<DemoConsole> {
        let listen = settings.console.listen;
        let bound = match console::bind(listen).await {
            Ok(bound) => Ok(bound),
            Err(first) => {
                let fallback = console::bind(SocketAddr::new(listen.ip(), 0)).await;
                if let Ok((_, addr)) = &fallback {
                    eprintln!("{listen} is not available ({first}); serving the console on {addr} instead.");
                }
                fallback
            }
        };
        let (listener, addr) = match bound {
            Ok(bound) => bound,
            Err(e) => {
                eprintln!("vantage demo: no console ({e}); the CLI commands below still work.");
                return None;
            }
        };
        let state = ConsoleState::new(
            store.with_statement_timeout(console::STATEMENT_TIMEOUT),
            settings,
        );
        let stop = CancellationToken::new();
        let task = tokio::spawn(console::serve(listener, state, stop.clone()));
        Some(DemoConsole { addr, stop, task })
    }

    /// Stops serving (open requests are answered first).
    pub(super) async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}
