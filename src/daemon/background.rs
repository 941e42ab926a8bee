//! Background loops. Each is activated by a timer, takes no input, is idempotent, and survives
//! a lost database (it logs, reports unreadiness, and tries again on its next tick).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::pipeline::cooldown::CooldownCache;
use crate::pipeline::inflight::InFlight;
use crate::store::{InstanceId, InstanceInfo, Store, StoreError};
use crate::telemetry::http::{Health, LoopHeartbeat};
use crate::telemetry::metrics as m;

/// Heartbeat into `wh_service_instances`, dead-instance cleanup, and the systemd watchdog.
pub async fn heartbeat(
    store: Store,
    instance: InstanceId,
    info: InstanceInfo,
    settings: Arc<Settings>,
    health: Health,
    shutdown: CancellationToken,
    beat: LoopHeartbeat,
) {
    let mut tick = tokio::time::interval(settings.orphans.heartbeat_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        beat.beat();
        // Bounded by the interval: a database that does not answer must not stall the loop
        // (its liveness is about this process, not about the database).
        let limit = settings.orphans.heartbeat_interval;
        let answered = tokio::time::timeout(limit, store.heartbeat(instance, &info)).await;
        let Ok(answered) = answered else {
            health.set_database_ok(false);
            tracing::warn!(timeout = ?limit, "heartbeat got no answer from the database");
            continue;
        };
        match answered {
            Ok(true) => health.set_database_ok(true),
            Ok(false) => {
                health.set_database_ok(true);
                tracing::warn!(%instance, "this instance had been declared dead (silent past orphans.stale_after) and registered again; leases it held may have been taken over");
            }
            Err(error) => {
                health.set_database_ok(false);
                tracing::warn!(%error, "heartbeat failed");
                continue;
            }
        }
        let cleanup = store.cleanup_dead_instances(settings.orphans.stale_after);
        match tokio::time::timeout(limit, cleanup)
            .await
            .unwrap_or_else(|_| Err(StoreError::Conflict("no answer in time".into())))
        {
            Ok(dead) => {
                for id in dead {
                    tracing::warn!(dead_instance = %id, stale_after = ?settings.orphans.stale_after,
                        "removed a silent instance; its leases will be taken over");
                }
            }
            Err(error) => tracing::warn!(%error, "dead-instance cleanup failed"),
        }
    }
    beat.finish();
}

/// Pings the systemd watchdog (when `WatchdogSec=` is set) at half its interval, as long as
/// every loop of the process is alive. Deliberately not tied to the database: a lost database
/// is not fatal (SPEC §5), so systemd must not restart us for it.
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

/// Renews the leases of rows in flight, so a slow apply never loses its lease.
pub async fn renew_leases(
    store: Store,
    instance: InstanceId,
    inflight: Arc<InFlight>,
    lease: Duration,
    shutdown: CancellationToken,
    beat: LoopHeartbeat,
) {
    let mut tick = tokio::time::interval((lease / 3).max(Duration::from_millis(200)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        beat.beat();
        let rows = inflight.rows();
        if rows.is_empty() {
            continue;
        }
        match store.renew_leases(instance, &rows, lease).await {
            Ok(n) if (n as usize) < rows.len() => tracing::debug!(
                in_flight = rows.len(),
                renewed = n,
                "some rows in flight are no longer ours (completed meanwhile, or taken over)"
            ),
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "lease renewal failed"),
        }
    }
    beat.finish();
}

/// Readiness (database reachable, migrations current) every second; gauges from the database
/// and a cooldown sweep every 15 s (the gauges count the work table: a scan, so not more often
/// than Prometheus typically scrapes).
pub async fn sampler(
    store: Store,
    health: Health,
    cooldown: Option<Arc<CooldownCache>>,
    shutdown: CancellationToken,
    beat: LoopHeartbeat,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n: u64 = 0;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        beat.beat();
        // A ping waits at most a second: readiness must flip promptly when the database goes.
        let up = matches!(
            tokio::time::timeout(Duration::from_secs(1), store.ping()).await,
            Ok(Ok(()))
        );
        health.set_database_ok(up);
        if !up {
            continue;
        }
        if n % 30 == 0 {
            health.set_migrations_current(store.check_migrations().await.is_ok());
        }
        if n % 15 == 0 {
            if let Some(cache) = &cooldown {
                cache.sweep();
            }
            match tokio::time::timeout(Duration::from_secs(10), store.gauges())
                .await
                .unwrap_or_else(|_| Err(StoreError::Conflict("no answer in time".into())))
            {
                Ok(g) => {
                    for p in g.perspectives {
                        let label = p.perspective_name;
                        metrics::gauge!(m::BACKLOG_EVENTS, m::LABEL_PERSPECTIVE => label.clone())
                            .set((p.pending + p.leased + p.parked) as f64);
                        metrics::gauge!(m::DEAD_LETTERS, m::LABEL_PERSPECTIVE => label.clone())
                            .set(p.dead_lettered as f64);
                        metrics::gauge!(m::OLDEST_PENDING_AGE_SECONDS, m::LABEL_PERSPECTIVE => label)
                            .set(p.oldest_pending_age_seconds.unwrap_or(0.0));
                    }
                    metrics::gauge!(m::INSTANCES_LIVE).set(g.instances_live as f64);
                }
                Err(error) => tracing::debug!(%error, "gauge sampling failed"),
            }
        }
        n = n.wrapping_add(1);
    }
    beat.finish();
}
