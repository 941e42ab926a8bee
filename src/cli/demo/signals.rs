//! Ctrl-C and SIGTERM while the demo runs: the first stops it gracefully, a second exits at
//! once (exit 130, as for `vantage run`); SIGHUP is ignored. The handling itself is `vantage
//! run`'s ([`crate::cli::signals`]); the demo only words the notices for a person.

use tokio_util::sync::CancellationToken;

use super::progress::CLEAR_LINE;
use crate::cli::signals::{self, Notices};

/// Cancels the returned token on the first SIGINT or SIGTERM; a second one exits at once.
pub(super) fn watch_signals(tty: bool) -> std::io::Result<CancellationToken> {
    let lead = if tty { CLEAR_LINE } else { "" };
    // The throwaway server's exit hook still stops it and removes its directory.
    signals::install(Notices {
        stopping: Box::new(move |_| {
            eprintln!(
                "{lead}Stopping: shutting the daemon down gracefully (press Ctrl-C again to exit at once)."
            )
        }),
        forced: Box::new(|_| eprintln!("vantage demo: second signal, exiting at once.")),
        hangup: Box::new(|| {}),
    })
}
