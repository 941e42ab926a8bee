//! LISTEN `vantage_work`: wakes an idle consumer loop as soon as producers append
//! (`daemon::wake`: one per notification; a notification that arrives while every loop is busy
//! is kept for the next to wait).

use std::time::Duration;

use sqlx::postgres::PgListener;
use tokio_util::sync::CancellationToken;

use super::wake::Wake;
use crate::store::{Store, WORK_CHANNEL};

/// Listens until `shutdown`, reconnecting with backoff; bumps `wake` on every notification and
/// after every reconnect (notifications sent while disconnected are lost).
pub async fn run(
    store: Store,
    wake: std::sync::Arc<Wake>,
    shutdown: CancellationToken,
    beat: impl Fn() + Send,
) {
    let mut delay = Duration::from_millis(100);
    while !shutdown.is_cancelled() {
        // Reconnecting is this loop doing its job: it stays live while the database is away.
        beat();
        let mut listener = match connect(&store).await {
            Ok(l) => {
                delay = Duration::from_millis(100);
                wake.work_arrived();
                l
            }
            Err(error) => {
                tracing::warn!(%error, retry_in = ?delay, "cannot LISTEN for work; polling until it is back");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        loop {
            beat();
            tokio::select! {
                _ = shutdown.cancelled() => return,
                msg = listener.try_recv() => match msg {
                    Ok(Some(_)) => wake.work_arrived(),
                    // The connection dropped; try_recv would reconnect silently, but we want the
                    // backoff and the catch-up wake above.
                    Ok(None) => break,
                    Err(error) => {
                        tracing::warn!(%error, "work listener failed; reconnecting");
                        break;
                    }
                },
                // Keep the liveness heartbeat fresh while idle.
                _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            }
        }
    }
}

async fn connect(store: &Store) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(store.pool()).await?;
    listener.ignore_pool_close_event(true);
    listener.listen(WORK_CHANNEL).await?;
    Ok(listener)
}
