//! Process signals, handled only here at the binary's edge (the daemon takes its stop as a
//! [`CancellationToken`], as mini-redis's `server::run(listener, shutdown)` does).
//!
//! - The first SIGTERM or SIGINT cancels the returned token: a graceful stop (during start-up
//!   it abandons the start; once running it drains).
//! - A second one exits at once with [`exit::FORCED`].
//! - SIGHUP is ignored (vantage does not reload its configuration; restart it to apply a
//!   change): without a handler it would kill the process with no shutdown at all.
//!
//! [`install`] registers every handler before it returns, so call it before anything slow
//! (connecting, migrating): from then on no signal can kill the process unannounced.
//!
//! `vantage run` uses [`Notices::log`]; `vantage demo` can pass its own words for a person
//! at a terminal (`Notices { stopping, forced, hangup }`) and use the token as its interrupt.

use std::io;

use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

use super::exit;

/// A signal that asks the process to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopSignal {
    /// SIGTERM (systemd, Kubernetes, `kill`).
    Terminate,
    /// SIGINT (Ctrl-C).
    Interrupt,
}

impl StopSignal {
    /// `SIGTERM` or `SIGINT`.
    pub fn name(self) -> &'static str {
        match self {
            StopSignal::Terminate => "SIGTERM",
            StopSignal::Interrupt => "SIGINT",
        }
    }
}

type Notice = Box<dyn Fn(StopSignal) + Send + Sync>;

/// What to say when a signal arrives.
pub struct Notices {
    /// The first stop signal, said before the token is cancelled.
    pub stopping: Notice,
    /// A second stop signal, said just before the process exits with [`exit::FORCED`].
    pub forced: Notice,
    /// A SIGHUP (ignored).
    pub hangup: Box<dyn Fn() + Send + Sync>,
}

impl Notices {
    /// Log lines (the daemon's).
    pub fn log() -> Notices {
        Notices {
            stopping: Box::new(|s| {
                tracing::info!(
                    signal = s.name(),
                    "signal received: shutting down gracefully (send it again to exit at once)"
                )
            }),
            forced: Box::new(|s| {
                tracing::warn!(
                    signal = s.name(),
                    code = exit::FORCED,
                    "second signal: exiting at once"
                )
            }),
            hangup: Box::new(|| {
                tracing::warn!("SIGHUP received and ignored: vantage does not reload its configuration; restart it to apply a change")
            }),
        }
    }
}

/// Installs the handlers of SIGTERM, SIGINT and SIGHUP and returns the token the first stop
/// signal cancels. Needs a Tokio runtime.
///
/// # Errors
/// The operating system refused a handler.
pub fn install(notices: Notices) -> io::Result<CancellationToken> {
    // Registered here, not in the task, so a signal right after this call is already ours.
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut hangup = signal(SignalKind::hangup())?;
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        let mut stopping = true;
        loop {
            let received = tokio::select! {
                _ = terminate.recv() => StopSignal::Terminate,
                _ = interrupt.recv() => StopSignal::Interrupt,
                _ = hangup.recv() => {
                    (notices.hangup)();
                    continue;
                }
            };
            if stopping {
                (notices.stopping)(received);
                cancel.cancel();
                stopping = false;
            } else {
                (notices.forced)(received);
                std::process::exit(exit::FORCED);
            }
        }
    });
    Ok(token)
}

/// What a long-running command (`run`, `console`) does first: logging from `[log]` (and traces,
/// when `traces` is given), then the signal handlers, with log lines as notices. `Err` is the
/// exit code to return (78 for a bad log filter or trace exporter, 1 when the handlers cannot
/// be installed).
pub fn start_service(
    log: &crate::config::LogSettings,
    traces: Option<&crate::telemetry::traces::TraceSettings>,
) -> Result<CancellationToken, i32> {
    if let Err(e) = crate::telemetry::logging::init_with_writer(log, traces, std::io::stderr, {
        use std::io::IsTerminal;
        std::io::stderr().is_terminal()
    }) {
        eprintln!("vantage: {e}");
        return Err(exit::CONFIG);
    }
    install(Notices::log()).map_err(|e| {
        eprintln!("vantage: cannot install the signal handlers: {e}");
        exit::FAILURE
    })
}
