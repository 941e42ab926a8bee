//! The producer rule: a producer's append latency while vantage is busy with its streams.
//!
//! The producer is measured on a thread and runtime of its own, with its own connection
//! ([`measured`]): the daemon, the rebuild's re-queue and the operator's requeues run as tasks of
//! this process's runtime, and a producer sharing its workers would wait for their polls (a
//! batch being decoded, say) before it saw its own answer. In production a producer is another
//! process; only the machine's cores are shared, here as there.

use std::time::Duration;

use super::{payload, CheckOutcome, Target};
use crate::bench::measure::{percentiles, Percentiles};
use crate::bench::seed::{self, Part, PerspectiveSpec, Seed};
use crate::bench::{Bench, BenchError, Check};

/// Appends `n` single events of `event_type`, one statement each, round robin over `streams`;
/// returns each append's latency.
async fn append_latencies(
    store: &crate::store::Store,
    streams: &[uuid::Uuid],
    event_type: &str,
    n: usize,
) -> Result<Vec<Duration>, BenchError> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let event = crate::store::NewEvent::new(event_type, serde_json::json!({ "i": i }));
        let started = std::time::Instant::now();
        store
            .append_events(
                streams[i % streams.len()],
                None,
                std::slice::from_ref(&event),
            )
            .await?;
        out.push(started.elapsed());
    }
    Ok(out)
}

/// Appends `n` single events to `streams` (type `event_type`) and, alternating with them, `n`
/// to `others` (a type no perspective reads), so both sets see the same moment; returns the two
/// sets of latencies.
async fn paired_append_latencies(
    store: &crate::store::Store,
    streams: &[uuid::Uuid],
    event_type: &str,
    others: &[uuid::Uuid],
    n: usize,
) -> Result<(Vec<Duration>, Vec<Duration>), BenchError> {
    let (mut read, mut unread) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        for (targets, kind, out) in [
            (streams, event_type, &mut read),
            (others, "Unsubscribed", &mut unread),
        ] {
            let event = crate::store::NewEvent::new(kind, serde_json::json!({ "i": i }));
            let started = std::time::Instant::now();
            store
                .append_events(
                    targets[i % targets.len()],
                    None,
                    std::slice::from_ref(&event),
                )
                .await?;
            out.push(started.elapsed());
        }
    }
    Ok((read, unread))
}

/// A producer's run of appends: to `streams` (type `event_type`), alternating with as many to
/// `others` (a type no perspective reads) when there are any.
struct Appends {
    streams: Vec<uuid::Uuid>,
    event_type: &'static str,
    others: Vec<uuid::Uuid>,
    n: usize,
}

/// Runs `appends` as a producer on a thread and runtime of its own, with a connection of its
/// own (made and warmed up there, so its socket is polled by that runtime alone); returns the
/// latencies of the appends to `streams` and of those to `others`.
async fn measured(
    options: &crate::store::StoreOptions,
    appends: Appends,
) -> Result<(Vec<Duration>, Vec<Duration>), BenchError> {
    let options = options.clone();
    let (done, result) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("bench-producer".into())
        .spawn(move || {
            let run = async {
                let producer = crate::store::Store::connect(&options).await?;
                // A warm-up no perspective reads: the connection and its statements ready.
                let fresh: Vec<uuid::Uuid> = (0..50).map(|_| uuid::Uuid::new_v4()).collect();
                append_latencies(&producer, &fresh, "Unsubscribed", fresh.len()).await?;
                let latencies = if appends.others.is_empty() {
                    let read = append_latencies(
                        &producer,
                        &appends.streams,
                        appends.event_type,
                        appends.n,
                    )
                    .await?;
                    (read, Vec::new())
                } else {
                    paired_append_latencies(
                        &producer,
                        &appends.streams,
                        appends.event_type,
                        &appends.others,
                        appends.n,
                    )
                    .await?
                };
                producer.close().await;
                Ok::<_, BenchError>(latencies)
            };
            let outcome = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| BenchError::Incorrect(format!("no runtime for the producer: {e}")))
                .and_then(|rt| rt.block_on(run));
            let _ = done.send(outcome);
        })
        .map_err(|e| BenchError::Incorrect(format!("no thread for the producer: {e}")))?;
    result
        .await
        .map_err(|_| BenchError::Incorrect("the producer's thread died".into()))?
}

/// The producer rule, measured: a producer appends to streams whose lanes vantage is busy with,
/// and its append latency p99 is compared with the same appends while vantage does nothing.
/// Target: at most 1.5 times idle, in each of these:
/// * the daemon retries those streams' failing heads with its default retry policy;
/// * a rebuild re-queues their history in chunks, over and over;
/// * an operator bulk-requeues their dead letters, one compare-and-set each, as `dlq requeue
///   --group` does.
///
/// Also reported, with no target: a failure storm (every head retried every 50–200 ms), whose
/// cost on a small machine is the CPU it takes, not any lock; the control appends to streams no
/// perspective reads, at the same moment, show that.
pub(super) async fn run(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    const APPENDS: usize = 2_000;
    const STREAMS: u64 = 200;
    let mut out = CheckOutcome::new(Check::Producers);
    let failing = PerspectiveSpec {
        name: "bench_failing".into(),
        event_type: "Fail".into(),
        parked: false,
        exhausted: false,
    };
    let seed = Seed {
        perspectives: vec![failing.clone()],
        parts: vec![Part {
            salt: "producers".into(),
            streams: STREAMS,
            per_stream: 50,
            event_type: "Fail".into(),
        }],
        payload_bytes: payload(bench),
        traced: false,
    };
    seed::apply(bench, &seed).await?;
    let streams = bench.db.stream_ids("producers", STREAMS as i64).await?;
    let appends = |others: Vec<uuid::Uuid>| Appends {
        streams: streams.clone(),
        event_type: "Fail",
        others,
        n: APPENDS,
    };
    // Vantage idle. (Idle is measured before and after the busy phases, and taken over both:
    // the machine's own load drifts during a run.)
    let (mut idle_samples, _) = measured(&bench.daemon_options, appends(Vec::new())).await?;

    // The daemon retries every stream's failing head (its statement always fails), forever:
    // first with the default retry policy, then as a storm.
    let defaults = crate::config::Settings::default().worker;
    let failing_heads = |base: Duration, max: Duration| {
        let mut settings = bench.base_settings.clone();
        let mut spec = failing.settings();
        spec.sql = [(
            "Fail".to_string(),
            crate::store::bench::POISON_STATEMENT.to_string(),
        )]
        .into();
        settings.perspectives = vec![spec];
        settings.worker.max_perspective_event_attempts = None;
        settings.worker.retry_backoff_base = base;
        settings.worker.retry_backoff_max = max;
        settings
    };
    let mut busy = Vec::new();
    for (base, max) in [
        (defaults.retry_backoff_base, defaults.retry_backoff_max),
        (Duration::from_millis(50), Duration::from_millis(200)),
    ] {
        let daemon_store = crate::store::Store::connect(&bench.daemon_options).await?;
        let daemon = crate::daemon::DaemonBuilder::new(failing_heads(base, max))
            .store(daemon_store.clone())
            .without_http()
            .start()
            .await?;
        // Let it get going: every head has failed at least once.
        let before = bench.db.failures_recorded(&failing.name).await?;
        while bench.db.failures_recorded(&failing.name).await? < before + STREAMS as i64 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let from = bench.db.failures_recorded(&failing.name).await?;
        let started = std::time::Instant::now();
        // The control, at the same moment: appends to streams and a type no perspective has,
        // alternating with the others (the daemon's CPU is shared with the producer on a small
        // machine; locks are not).
        let others: Vec<uuid::Uuid> = (0..STREAMS).map(|_| uuid::Uuid::new_v4()).collect();
        let (mut read, mut unread) = measured(&bench.daemon_options, appends(others)).await?;
        let failures = bench.db.failures_recorded(&failing.name).await? - from;
        let per_second = failures as f64 / started.elapsed().as_secs_f64().max(1e-9);
        let (during, control) = (percentiles(&mut read), percentiles(&mut unread));
        daemon.shutdown().await?;
        daemon_store.close().await;
        busy.push((base, max, during, control, per_second));
    }

    // A rebuild's re-queue: chunks of the perspective's history, each its own transaction,
    // over and over, while the producer appends.
    let stop = tokio_util::sync::CancellationToken::new();
    let requeue = {
        let db = bench.db.clone();
        let stop = stop.clone();
        let name = failing.name.clone();
        tokio::spawn(async move {
            let mut chunks = 0u64;
            while !stop.is_cancelled() {
                db.requeue_history_chunks(&name, 1_000).await?;
                chunks += 1;
            }
            Ok::<u64, BenchError>(chunks)
        })
    };
    let rebuilding = percentiles(
        &mut measured(&bench.daemon_options, appends(Vec::new()))
            .await?
            .0,
    );
    stop.cancel();
    let chunks = requeue
        .await
        .map_err(|e| BenchError::Incorrect(format!("the re-queue task crashed: {e}")))??;

    // An operator's bulk requeue: every queued row of those streams dead-lettered first, then
    // handed back one dead letter at a time while the producer appends.
    let letters = bench.db.dead_letter_queued(&failing.name).await?;
    let stop = tokio_util::sync::CancellationToken::new();
    let operator_store = crate::store::Store::connect(&bench.daemon_options).await?;
    let operator = {
        let store = operator_store.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut requeued = 0u64;
            for id in letters {
                if stop.is_cancelled() {
                    break;
                }
                if store.requeue_dead_letter(id, "bench-operator").await? {
                    requeued += 1;
                }
            }
            Ok::<u64, BenchError>(requeued)
        })
    };
    let requeueing = percentiles(
        &mut measured(&bench.daemon_options, appends(Vec::new()))
            .await?
            .0,
    );
    stop.cancel();
    let requeued = operator
        .await
        .map_err(|e| BenchError::Incorrect(format!("the operator task crashed: {e}")))??;
    let idle_before = percentiles(&mut idle_samples);
    operator_store.close().await;
    let (mut idle_after_samples, _) = measured(&bench.daemon_options, appends(Vec::new())).await?;
    let idle_after = percentiles(&mut idle_after_samples);
    idle_samples.extend(idle_after_samples);
    let idle = percentiles(&mut idle_samples);

    let [(d_base, _, default_busy, default_control, default_rate), (s_base, s_max, storm, storm_control, storm_rate)] =
        [busy[0], busy[1]];
    out.details.push(format!(
        "append latency p50/p99, {APPENDS} appends over {STREAMS} streams: idle {:.2}/{:.2} ms \
         (before the busy phases {:.2}/{:.2} ms, after them {:.2}/{:.2} ms)",
        idle.p50_ms,
        idle.p99_ms,
        idle_before.p50_ms,
        idle_before.p99_ms,
        idle_after.p50_ms,
        idle_after.p99_ms
    ));
    out.details.push(format!(
        "heads failing, default retry policy ({} base, {default_rate:.0} failures/s): \
         {:.2}/{:.2} ms (the same moment, streams no perspective reads: {:.2}/{:.2} ms)",
        humantime::format_duration(d_base),
        default_busy.p50_ms,
        default_busy.p99_ms,
        default_control.p50_ms,
        default_control.p99_ms
    ));
    out.details.push(format!(
        "failure storm ({}–{} backoff, {storm_rate:.0} failures/s): {:.2}/{:.2} ms (the same \
         moment, streams no perspective reads: {:.2}/{:.2} ms)",
        humantime::format_duration(s_base),
        humantime::format_duration(s_max),
        storm.p50_ms,
        storm.p99_ms,
        storm_control.p50_ms,
        storm_control.p99_ms
    ));
    out.details.push(format!(
        "rebuild re-queueing ({chunks} passes) {:.2}/{:.2} ms; operator bulk requeue \
         ({requeued} dead letters handed back) {:.2}/{:.2} ms",
        rebuilding.p50_ms, rebuilding.p99_ms, requeueing.p50_ms, requeueing.p99_ms
    ));
    let over_idle = |p: Percentiles| p.p99_ms / idle.p99_ms.max(1e-9);
    out.ratio(
        "append p99 while heads fail (default policy) / idle",
        over_idle(default_busy),
        Some(Target::AtMost(1.5)),
    );
    out.ratio(
        "append p99 during a rebuild's re-queue / idle",
        over_idle(rebuilding),
        Some(Target::AtMost(1.5)),
    );
    out.ratio(
        "append p99 during an operator's bulk requeue / idle",
        over_idle(requeueing),
        Some(Target::AtMost(1.5)),
    );
    out.ratio(
        "append p99 in a failure storm / idle (CPU; no target)",
        over_idle(storm),
        None,
    );
    out.ratio(
        "append p99 to failing lanes / to unread streams, same moment, in the storm",
        storm.p99_ms / storm_control.p99_ms.max(1e-9),
        None,
    );
    Ok(out)
}
