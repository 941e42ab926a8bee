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

/// What one producer run measured.
struct Latencies {
    /// The appends to `streams`.
    read: Vec<Duration>,
    /// The appends to `others`.
    unread: Vec<Duration>,
}

/// Runs `appends` as a producer on a thread and runtime of its own, with a connection of its
/// own (made and warmed up there, so its socket is polled by that runtime alone); returns the
/// latencies of the appends to `streams` and of those to `others`. With `isolated`, the
/// producer's thread and its backend have a core to themselves for the appends
/// ([`crate::bench::cores`]); `Err` of the inner result says why they could not.
async fn measured(
    options: &crate::store::StoreOptions,
    appends: Appends,
    isolated: bool,
) -> Result<Result<Latencies, String>, BenchError> {
    let mut options = options.clone();
    // One connection: one backend to pin, the same for every append.
    options.max_connections = 1;
    let (done, result) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("bench-producer".into())
        .spawn(move || {
            let run = async {
                let producer = crate::store::Store::connect(&options).await?;
                // A warm-up no perspective reads: the connection and its statements ready.
                let fresh: Vec<uuid::Uuid> = (0..50).map(|_| uuid::Uuid::new_v4()).collect();
                append_latencies(&producer, &fresh, "Unsubscribed", fresh.len()).await?;
                let isolation = if isolated {
                    let backend = crate::store::bench::BenchStore::new(producer.clone())
                        .backend_pid()
                        .await?;
                    match crate::bench::cores::isolate(
                        crate::bench::cores::current_thread_id(),
                        backend,
                    ) {
                        Ok(isolation) => Some(isolation),
                        Err(why) => {
                            producer.close().await;
                            return Ok(Err(why));
                        }
                    }
                } else {
                    None
                };
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
                drop(isolation);
                producer.close().await;
                Ok::<_, BenchError>(Ok(Latencies {
                    read: latencies.0,
                    unread: latencies.1,
                }))
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

/// One moment measured twice, back to back: the producer sharing the machine's cores, then
/// (when the server is ours) on a core of its own.
struct Moment {
    shared: Latencies,
    isolated: Option<Latencies>,
}

impl Moment {
    /// Measures `appends()` shared, then isolated when `bench` may re-pin the server's
    /// processes; `why_not` receives the first reason isolation failed.
    async fn measure(
        bench: &Bench,
        appends: impl Fn() -> Appends,
        why_not: &mut Option<String>,
    ) -> Result<Moment, BenchError> {
        let shared = measured(&bench.daemon_options, appends(), false)
            .await?
            .map_err(BenchError::Incorrect)?;
        let isolated = if bench.config.own_server && why_not.is_none() {
            match measured(&bench.daemon_options, appends(), true).await? {
                Ok(l) => Some(l),
                Err(why) => {
                    *why_not = Some(why);
                    None
                }
            }
        } else {
            None
        };
        Ok(Moment { shared, isolated })
    }
}

/// The producer rule, measured: a producer appends to streams whose lanes vantage is busy with,
/// and its append latency p99 is compared with the same appends while vantage does nothing.
/// Target: at most 1.5 times idle, in each of these:
/// * the daemon retries those streams' failing heads with its default retry policy;
/// * a rebuild re-queues their history in chunks, over and over;
/// * an operator bulk-requeues their dead letters, one compare-and-set each, as `dlq requeue
///   --group` does.
///
/// Every moment is measured twice, back to back: with the producer sharing the machine's cores
/// and, when the server is ours, with the producer and its backend on a core of their own
/// ([`crate::bench::cores`]). The targets apply to the second when there is one: they are about
/// vantage's locks and waits, and on a small machine the first also measures whose turn it is
/// on a core. Both are reported.
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
        failing: true,
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
    let mut why_not = None;
    // Vantage idle. (Idle is measured before and after the busy phases, and taken over both:
    // the machine's own load drifts during a run.)
    let idle_before = Moment::measure(bench, || appends(Vec::new()), &mut why_not).await?;

    // The daemon retries every stream's failing head (its statement always fails), forever:
    // first with the default retry policy, then as a storm.
    let defaults = crate::config::Settings::default().worker;
    let failing_heads = |base: Duration, max: Duration| {
        let mut settings = bench.base_settings.clone();
        settings.perspectives = vec![failing.settings()];
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
        let moment = Moment::measure(bench, || appends(others.clone()), &mut why_not).await?;
        let failures = bench.db.failures_recorded(&failing.name).await? - from;
        let per_second = failures as f64 / started.elapsed().as_secs_f64().max(1e-9);
        daemon.shutdown().await?;
        daemon_store.close().await;
        busy.push((base, max, moment, per_second));
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
    let rebuilding = Moment::measure(bench, || appends(Vec::new()), &mut why_not).await?;
    stop.cancel();
    let chunks = requeue
        .await
        .map_err(|e| BenchError::Incorrect(format!("the re-queue task crashed: {e}")))??;

    // An operator's bulk requeue: every queued row of those streams dead-lettered first, then
    // handed back one dead letter at a time while the producer appends; once for each way the
    // producer is measured, so that both see the operator at work.
    let operator_store = crate::store::Store::connect(&bench.daemon_options).await?;
    let mut requeued = 0u64;
    let mut requeueing = Vec::new();
    for isolated in [false, true] {
        if isolated && (!bench.config.own_server || why_not.is_some()) {
            break;
        }
        let letters = bench.db.dead_letter_queued(&failing.name).await?;
        let stop = tokio_util::sync::CancellationToken::new();
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
        let latencies = measured(&bench.daemon_options, appends(Vec::new()), isolated).await?;
        stop.cancel();
        requeued += operator
            .await
            .map_err(|e| BenchError::Incorrect(format!("the operator task crashed: {e}")))??;
        match latencies {
            Ok(l) => requeueing.push(l),
            Err(why) => why_not = Some(why),
        }
    }
    operator_store.close().await;
    let idle_after = Moment::measure(bench, || appends(Vec::new()), &mut why_not).await?;

    let [(d_base, _, heads_moment, default_rate), (s_base, s_max, storm_moment, storm_rate)] =
        [&busy[0], &busy[1]].map(|(b, m, moment, rate)| (*b, *m, moment, *rate));
    let mut requeueing = requeueing.into_iter();
    let operator_shared = requeueing.next();
    let operator_isolated = requeueing.next();
    let mut any_isolated = false;
    for isolated in [false, true] {
        fn pick(m: &Moment, isolated: bool) -> Option<&Latencies> {
            if isolated {
                m.isolated.as_ref()
            } else {
                Some(&m.shared)
            }
        }
        let operator = if isolated {
            operator_isolated.as_ref()
        } else {
            operator_shared.as_ref()
        };
        let (Some(before), Some(after), Some(heads), Some(stormy), Some(rebuild), Some(operator)) = (
            pick(&idle_before, isolated),
            pick(&idle_after, isolated),
            pick(heads_moment, isolated),
            pick(storm_moment, isolated),
            pick(&rebuilding, isolated),
            operator,
        ) else {
            continue;
        };
        any_isolated |= isolated;
        let label = if isolated {
            "producer on a core of its own"
        } else {
            "shared cores"
        };
        let p = |samples: &[Duration]| percentiles(&mut samples.to_vec());
        let (idle_before, idle_after) = (p(&before.read), p(&after.read));
        let idle = p(&[before.read.as_slice(), after.read.as_slice()].concat());
        let (default_busy, default_control) = (p(&heads.read), p(&heads.unread));
        let (storm, storm_control) = (p(&stormy.read), p(&stormy.unread));
        let (rebuilding, requeueing) = (p(&rebuild.read), p(&operator.read));
        out.details.push(format!(
            "{label}: append latency p50/p99, {APPENDS} appends over {STREAMS} streams: idle \
             {:.2}/{:.2} ms (before the busy phases {:.2}/{:.2} ms, after them {:.2}/{:.2} ms)",
            idle.p50_ms,
            idle.p99_ms,
            idle_before.p50_ms,
            idle_before.p99_ms,
            idle_after.p50_ms,
            idle_after.p99_ms
        ));
        // Appends to the busy lanes, then to unread streams at the same moment.
        let paired = |what: String, busy: Percentiles, control: Percentiles| {
            format!(
                "{label}: {what}: {:.2}/{:.2} ms (the same moment, streams no perspective reads: \
                 {:.2}/{:.2} ms)",
                busy.p50_ms, busy.p99_ms, control.p50_ms, control.p99_ms
            )
        };
        out.details.push(paired(
            format!(
                "heads failing, default retry policy ({} base, {default_rate:.0} failures/s)",
                humantime::format_duration(d_base)
            ),
            default_busy,
            default_control,
        ));
        out.details.push(paired(
            format!(
                "failure storm ({}–{} backoff, {storm_rate:.0} failures/s)",
                humantime::format_duration(s_base),
                humantime::format_duration(s_max)
            ),
            storm,
            storm_control,
        ));
        out.details.push(format!(
            "{label}: rebuild re-queueing {:.2}/{:.2} ms; operator bulk requeue {:.2}/{:.2} ms",
            rebuilding.p50_ms, rebuilding.p99_ms, requeueing.p50_ms, requeueing.p99_ms
        ));
        // The targets are about vantage's locks and waits: measured where the producer has a
        // core of its own when it can, on the shared cores otherwise.
        let targeted = isolated || !bench.config.own_server || why_not.is_some();
        let target = |t: f64| targeted.then_some(Target::AtMost(t));
        let over_idle = |p: Percentiles| p.p99_ms / idle.p99_ms.max(1e-9);
        let suffix = if isolated {
            ", own core"
        } else {
            ", shared cores"
        };
        out.ratio(
            format!("append p99 while heads fail (default policy) / idle{suffix}"),
            over_idle(default_busy),
            target(1.5),
        );
        out.ratio(
            format!("append p99 during a rebuild's re-queue / idle{suffix}"),
            over_idle(rebuilding),
            target(1.5),
        );
        out.ratio(
            format!("append p99 during an operator's bulk requeue / idle{suffix}"),
            over_idle(requeueing),
            target(1.5),
        );
        out.ratio(
            format!("append p99 in a failure storm / idle (CPU; no target){suffix}"),
            over_idle(storm),
            None,
        );
        out.ratio(
            format!(
                "append p99 to failing lanes / to unread streams, same moment, in the storm{suffix}"
            ),
            storm.p99_ms / storm_control.p99_ms.max(1e-9),
            None,
        );
    }
    out.details.push(format!(
        "re-queue passes {chunks}; dead letters handed back by the operator {requeued}"
    ));
    if !any_isolated {
        out.details.push(match why_not {
            Some(why) => format!("the producer could not get a core of its own: {why}"),
            None => "the producer shares the cores (a configured server's processes are not \
                     re-pinned)"
                .into(),
        });
    }
    Ok(out)
}
