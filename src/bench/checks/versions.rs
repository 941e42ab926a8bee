//! Versioned perspectives (docs/versions.md): a version's backfill against the drain of the same
//! events by the same statement, the age of the oldest transaction while it backfills, the live
//! version's append → applied latency while a new version backfills under a steady producer,
//! and how long a cutover and a rollback take.

use std::time::{Duration, Instant};

use super::{payload, CheckOutcome, Target};
use crate::bench::drain;
use crate::bench::seed::{self, Seed};
use crate::bench::{Bench, BenchError, Check};
use crate::config::PerspectiveSettings;
use crate::daemon::{DaemonBuilder, RunningDaemon};
use crate::store::bench::{BENCH_EVENT_TYPE, VERSIONED, VERSIONED_READ_SCHEMA};
use crate::store::{Store, Switch};

/// The version's statement: the same upsert as the drain's perspective, into its own table
/// (which also records when each row was written, for the latency).
fn versioned(version: u32) -> PerspectiveSettings {
    PerspectiveSettings {
        name: VERSIONED.into(),
        version,
        read_schema: Some(VERSIONED_READ_SCHEMA.into()),
        tables: vec!["applied".into()],
        setup: Some(format!(
            "CREATE TABLE applied (stream_id uuid NOT NULL, stream_version int NOT NULL, \
             event_id uuid NOT NULL, global_position bigint NOT NULL, applied int NOT NULL DEFAULT 1, \
             applied_at timestamptz NOT NULL DEFAULT clock_timestamp(), v int NOT NULL DEFAULT {version}, \
             PRIMARY KEY (stream_id, stream_version))"
        )),
        events: vec![BENCH_EVENT_TYPE.into()],
        sql: [(
            BENCH_EVENT_TYPE.to_string(),
            "INSERT INTO applied (stream_id, stream_version, event_id, global_position) \
             VALUES ($2, $6, $3, $5) ON CONFLICT (stream_id, stream_version) \
             DO UPDATE SET applied = applied.applied + 1"
                .to_string(),
        )]
        .into(),
        ..Default::default()
    }
}

async fn start(bench: &Bench, version: u32) -> Result<(RunningDaemon, Store), BenchError> {
    let mut settings = bench.base_settings.clone();
    settings.perspectives = vec![versioned(version)];
    let store = Store::connect(&bench.daemon_options).await?;
    let daemon = DaemonBuilder::new(settings)
        .store(store.clone())
        .without_http()
        .start()
        .await?;
    Ok((daemon, store))
}

/// Waits until `version` is in one of `states`, sampling the oldest daemon transaction
/// meanwhile; returns the time it took and the oldest transaction seen (seconds, and what it
/// ran).
async fn until(
    bench: &Bench,
    version: i32,
    states: &[&str],
    what: &str,
) -> Result<(Duration, (f64, String)), BenchError> {
    let started = Instant::now();
    let mut oldest = (0f64, String::new());
    loop {
        let versions = bench.db.store().version_status(VERSIONED).await?;
        if versions
            .iter()
            .any(|v| v.version == version && states.contains(&v.state.as_str()))
        {
            return Ok((started.elapsed(), oldest));
        }
        let now = bench.db.oldest_daemon_transaction().await?;
        if now.0 > oldest.0 {
            oldest = now;
        }
        if started.elapsed() > bench.config.drain_timeout {
            return Err(BenchError::Timeout {
                what: what.into(),
                done: 0,
                expected: 1,
                waited: started.elapsed(),
            });
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub(super) async fn run(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::Versions);
    let n = bench.config.events.clamp(1_000, 1_000_000);
    let streams = bench.config.streams.min(n).max(1);
    let seed = Seed::healthy(n, streams, 1, payload(bench));

    // The drain of these events by the same statement, for reference.
    bench.db.drop_version_schemas().await?;
    seed::apply(bench, &seed).await?;
    let drained = drain::drain(bench, &seed, "drain of the events (reference)").await?;
    out.drain_line(&drained);

    // Version 1 backfills all of them. The same events as history only: with the drain's
    // perspective registered they would also be a backlog of its work rows that nobody drains,
    // which is no part of a backfill beside a current live system (and every count of the work
    // table, such as the metrics sampler's, would read it).
    let history = Seed {
        perspectives: Vec::new(),
        ..seed.clone()
    };
    seed::apply(bench, &history).await?;
    bench.db.drop_version_schemas().await?;
    let bar = bench
        .progress
        .spinner(&format!("backfilling version 1 over {n} events"));
    let (v1, v1_store) = start(bench, 1).await?;
    let (took, oldest) = until(bench, 1, &["live"], "backfill of version 1").await?;
    bar.finish_and_clear();
    let backfill_rate = n as f64 / took.as_secs_f64().max(1e-9);
    let batch = f64::from(bench.base_settings.worker.backfill_batch_size);
    let batches = (n as f64 / batch).ceil().max(1.0);
    let per_batch = took.as_secs_f64() / batches;
    out.details.push(format!(
        "backfill of version 1: {n} events in {:.2} s = {backfill_rate:.0} events/s ({batches:.0} batches of {batch:.0}, {:.1} ms each); oldest daemon transaction meanwhile {:.1} ms ({})",
        took.as_secs_f64(),
        per_batch * 1000.0,
        oldest.0 * 1000.0,
        crate::text::one_line(&oldest.1)
    ));
    if let Some((calls, mean, max)) = bench.db.backfill_batch_times().await? {
        out.details.push(format!(
            "backfill batches seen by pg_stat_statements: {calls} calls, mean {mean:.1} ms, longest {max:.1} ms"
        ));
    }
    out.ratio(
        "backfill rate / drain rate (same statement)",
        backfill_rate / drained.rate().max(1e-9),
        Some(Target::AtLeast(0.5)),
    );
    out.ratio(
        "oldest transaction during backfill / 2 batches",
        oldest.0 / (2.0 * per_batch).max(1e-9),
        Some(Target::AtMost(1.0)),
    );

    // Version 2 backfills while a producer appends at a steady 1 000 events/s: the live
    // version keeps up.
    let from = bench.db.max_position().await? + 1;
    let producer = {
        let db = bench.db.clone();
        tokio::spawn(async move {
            const STREAMS: usize = 100;
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut versions = [0i32; STREAMS];
            let mut appended = 0u64;
            // (stopped by the check once version 2 is built; bounded in case it never is)
            for t in 0..60_000usize {
                tick.tick().await;
                let s = t % STREAMS;
                db.append_ticks("versions-steady", s as i64, versions[s], 10)
                    .await?;
                versions[s] += 10;
                appended += 10;
            }
            Ok::<_, BenchError>(appended)
        })
    };
    let bar = bench
        .progress
        .spinner("backfilling version 2 beside the live version 1");
    let (v2, v2_store) = start(bench, 2).await?;
    let built = until(bench, 2, &["ready"], "backfill of version 2").await;
    producer.abort();
    bar.finish_and_clear();
    let (took2, _) = built?;
    let lag = bench.db.version_latency(1, from).await?;
    out.details.push(format!(
        "while version 2 backfilled {n}+ events ({:.2} s) under 1 000 appends/s: version 1's append -> applied p50 {:.1} ms, p99 {:.1} ms over {} events",
        took2.as_secs_f64(),
        lag.p50,
        lag.p99,
        lag.count
    ));
    out.ratio(
        "live version's append -> applied p99 during a backfill / 5 s",
        lag.p99 / 5_000.0,
        Some(Target::AtMost(1.0)),
    );

    // Cutover and rollback, alternately: enough of them that the p99 is not just the slowest.
    const SWITCHES: usize = 100;
    let mut times = Vec::new();
    for i in 0..SWITCHES {
        let kind = if i % 2 == 0 {
            Switch::Cutover
        } else {
            Switch::Rollback
        };
        let to = (i % 2 == 0).then_some(2);
        // (a refusal because the other version is a moment behind is tried again; the time is
        // that of the call that switched)
        let (outcome, took) = loop {
            let started = Instant::now();
            let o = bench
                .db
                .store()
                .switch_version(VERSIONED, kind, to, "vantage bench")
                .await?;
            if o.outcome != "behind_live" {
                break (o, started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        if outcome.outcome != "done" {
            return Err(BenchError::Incorrect(format!(
                "switch {i} of the versions check was refused: {}",
                outcome.outcome
            )));
        }
        times.push(took.as_secs_f64() * 1000.0);
    }
    // Which switch was slowest tells a lock wait at the first one (catalog, autovacuum of the
    // freshly backfilled tables) from noise spread over all of them.
    let (slowest, slowest_ms) = times
        .iter()
        .copied()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap_or((0, 0.0));
    times.sort_by(f64::total_cmp);
    let p50 = times[times.len() / 2];
    let p99 = times[((times.len() as f64 * 0.99).ceil() as usize).min(times.len()) - 1];
    out.details.push(format!(
        "{} cutovers and rollbacks: p50 {p50:.1} ms, p99 {p99:.1} ms (slowest: switch {} of {}, {slowest_ms:.1} ms)",
        times.len(),
        slowest + 1,
        times.len()
    ));
    out.ratio(
        "cutover/rollback p99 / 100 ms",
        p99 / 100.0,
        Some(Target::AtMost(1.0)),
    );
    v2.shutdown().await?;
    v1.shutdown().await?;
    v2_store.close().await;
    v1_store.close().await;
    bench.db.drop_version_schemas().await?;
    Ok(out)
}
