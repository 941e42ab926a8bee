//! Ctrl-C and SIGTERM while the demo runs: the first stops it gracefully, a second exits at
//! once. Kept apart so the demo can take the signal handling `vantage run` uses once that lives
//! in `cli/` for both.

use tokio_util::sync::CancellationToken;

use super::progress::CLEAR_LINE;
use crate::cli::exit;

/// Cancels the returned token on the first SIGINT or SIGTERM; a second one exits at once.
pub(super) fn watch_signals(tty: bool) -> std::io::Result<CancellationToken> {
    use tokio::signal::unix::{signal, SignalKind};
    // Registered here, not in the task, so a Ctrl-C right away is already ours.
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        let lead = if tty { CLEAR_LINE } else { "" };
        eprintln!(
            "{lead}Stopping: shutting the daemon down gracefully (press Ctrl-C again to exit at once)."
        );
        cancel.cancel();
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        eprintln!("vantage demo: second signal, exiting at once.");
        // The throwaway server's exit hook still stops it and removes its directory.
        std::process::exit(exit::FAILURE);
    });
    Ok(token)
}
