//! The systemd watchdog ping.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::telemetry::health::Health;

/// Pings the systemd watchdog (when `WatchdogSec=` is set) at half its interval, as long as
/// every loop of the process is alive. Deliberately not tied to the database: a lost database
/// is not fatal (docs/cli.md, "Exit codes"), so systemd must not restart us for it. Not a
/// [`BackgroundTask`](super::BackgroundTask): it is not itself a loop `/healthz` watches (it
/// watches them).
pub async fn systemd_watchdog(health: Health, shutdown: CancellationToken) {
    let mut usec = 0;
    if !sd_notify::watchdog_enabled(false, &mut usec) || usec == 0 {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_micros(usec) / 2);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        if health.liveness().is_ok() {
            let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
        }
    }
}
