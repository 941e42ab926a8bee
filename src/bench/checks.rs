//! The scale and shape checks: each seeds its own state, measures, and reports one ratio (with
//! the target of SPEC §7 when it has one).

use std::time::Duration;

use super::drain::{self, DrainRun};
use super::limit;
use super::measure::{percentiles, Percentiles};
use super::seed::{self, Part, PerspectiveSpec, Seed};
use super::{Bench, BenchError, Check};

/// A target a ratio should meet.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Target {
    /// The ratio should be at least this.
    AtLeast(f64),
    /// The ratio should be at most this.
    AtMost(f64),
}

impl Target {
    /// Whether `ratio` meets it.
    pub fn holds(self, ratio: f64) -> bool {
        match self {
            Target::AtLeast(t) => ratio >= t,
            Target::AtMost(t) => ratio <= t,
        }
    }

    /// `≥ 0.80` / `≤ 1.50`.
    pub fn describe(self) -> String {
        match self {
            Target::AtLeast(t) => format!(">= {t:.2}"),
            Target::AtMost(t) => format!("<= {t:.2}"),
        }
    }
}

/// One ratio of a check.
#[derive(Clone, Debug, PartialEq)]
pub struct Ratio {
    /// What is divided by what.
    pub label: String,
    /// The value.
    pub value: f64,
    /// The target, if SPEC §7 sets one.
    pub target: Option<Target>,
}

/// What one check measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CheckOutcome {
    /// The check's name.
    pub name: String,
    /// Lines of figures behind the ratios.
    pub details: Vec<String>,
    /// The ratios.
    pub ratios: Vec<Ratio>,
    /// Query plans worth keeping (title, EXPLAIN text).
    pub plans: Vec<(String, String)>,
}

impl CheckOutcome {
    fn new(check: Check) -> Self {
        CheckOutcome {
            name: check.name().into(),
            ..Default::default()
        }
    }

    fn ratio(&mut self, label: impl Into<String>, value: f64, target: Option<Target>) {
        self.ratios.push(Ratio {
            label: label.into(),
            value,
            target,
        });
    }

    fn drain_line(&mut self, run: &DrainRun) {
        self.details.push(format!(
            "{}: {} rows in {:.2} s = {:.0} rows/s (apply p99 {:.2} ms, claim p99 {:.1} ms)",
            run.what,
            run.rows,
            run.elapsed.as_secs_f64(),
            run.rate(),
            run.apply.p99_ms,
            run.claim.p99_ms
        ));
    }
}

/// Runs one check; `main` is the main vantage drain of the run (the reference of some ratios).
pub async fn run(bench: &Bench, check: Check, main: &DrainRun) -> Result<CheckOutcome, BenchError> {
    match check {
        Check::DeadLetter => dead_letter(bench).await,
        Check::Parked => parked(bench).await,
        Check::Perspectives => perspectives(bench, main).await,
        Check::Shapes => shapes(bench, main).await,
        Check::Latency => latency(bench).await,
        Check::Rss => rss(bench, main).await,
        Check::ClaimScale => claim_scale(bench).await,
        Check::DeadTuples => dead_tuples(bench).await,
        Check::Producers => producers(bench).await,
        Check::HeldAppend => held_append(bench).await,
    }
}

/// A tenth of the main run, at least 100 and at most 20 000 events.
fn small_n(bench: &Bench) -> u64 {
    (bench.config.events / 10).clamp(100, 20_000)
}

fn payload(bench: &Bench) -> u32 {
    bench.config.payload_bytes
}

async fn dead_letter(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::DeadLetter);
    let n = small_n(bench);
    let streams = bench.config.streams.min(n).max(1);
    let healthy = Seed::healthy(n, streams, 1, payload(bench));
    seed::apply(bench, &healthy).await?;
    let apply = drain::drain(bench, &healthy, "apply N healthy").await?;
    out.drain_line(&apply);

    let mut poison = healthy.clone();
    poison.perspectives[0].exhausted = true;
    seed::apply(bench, &poison).await?;
    let dlq = drain::drain(bench, &poison, "dead-letter N poison").await?;
    out.drain_line(&dlq);
    out.details.push(format!(
        "dead-lettered {} of {} rows",
        dlq.dead_lettered, dlq.rows
    ));
    out.ratio(
        "dead-letter time / apply time",
        dlq.elapsed.as_secs_f64() / apply.elapsed.as_secs_f64().max(1e-9),
        Some(Target::AtMost(2.0)),
    );
    Ok(out)
}

async fn parked(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::Parked);
    let n = small_n(bench);
    let streams = (bench.config.streams / 10).clamp(1, n);
    let solo = Seed::healthy(n, streams, 1, payload(bench));
    seed::apply(bench, &solo).await?;
    let alone = drain::drain(bench, &solo, "healthy alone").await?;
    out.drain_line(&alone);

    let mut beside = solo.clone();
    beside.perspectives.push(PerspectiveSpec {
        name: "bench_parked".into(),
        event_type: "Parked".into(),
        parked: true,
        exhausted: false,
    });
    beside.parts.push(Part {
        salt: "parked".into(),
        streams: 2_000,
        per_stream: 1,
        event_type: "Parked".into(),
    });
    seed::apply(bench, &beside).await?;
    let with = drain::drain(bench, &beside, "healthy beside 2000 parked").await?;
    out.drain_line(&with);
    out.ratio(
        "healthy beside 2 000 parked lanes / alone (rows/s)",
        with.rate() / alone.rate().max(1e-9),
        Some(Target::AtLeast(0.8)),
    );
    Ok(out)
}

async fn perspectives(bench: &Bench, main: &DrainRun) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::Perspectives);
    let events = (bench.config.events / 50).max(100);
    let streams = (bench.config.streams / 10).clamp(1, events);
    let fifty = Seed::healthy(events, streams, 50, payload(bench));
    seed::apply(bench, &fifty).await?;
    let run = drain::drain(bench, &fifty, "50 perspectives").await?;
    out.drain_line(&run);
    out.ratio(
        "50 perspectives / main drain (rows/s)",
        run.rate() / main.rate().max(1e-9),
        None,
    );
    Ok(out)
}

async fn shapes(bench: &Bench, main: &DrainRun) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::Shapes);
    let n = bench.config.events;
    let few = Seed::healthy(n, 200.min(n), 1, payload(bench));
    seed::apply(bench, &few).await?;
    let long = drain::drain(bench, &few, "200 long streams").await?;
    out.drain_line(&long);
    seed::apply(bench, &few).await?;
    let limit = limit::crash_safe(bench, &few.perspective_names(), few.rows()).await?;
    out.details.push(format!(
        "{} at 200 streams: {} rows in {:.2} s = {:.0} rows/s",
        limit.what,
        limit.rows,
        limit.elapsed.as_secs_f64(),
        limit.rate()
    ));
    out.ratio(
        "drain/limit at 200 streams",
        long.rate() / limit.rate().max(1e-9),
        Some(Target::AtLeast(0.8)),
    );
    out.ratio(
        "200 streams / main drain (rows/s)",
        long.rate() / main.rate().max(1e-9),
        None,
    );

    let many = Seed::healthy(n, n, 1, payload(bench));
    seed::apply(bench, &many).await?;
    let short = drain::drain(bench, &many, "one-event streams").await?;
    out.drain_line(&short);
    out.ratio(
        format!("{n} streams of 1 event / main drain (rows/s)"),
        short.rate() / main.rate().max(1e-9),
        None,
    );
    Ok(out)
}

async fn latency(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    const RATE: u64 = 1_000;
    const TICK: Duration = Duration::from_millis(10);
    const SECONDS: u64 = 10;
    const STREAMS: i64 = 100;
    let mut out = CheckOutcome::new(Check::Latency);
    let empty = Seed {
        parts: Vec::new(),
        ..Seed::healthy(1, 1, 1, payload(bench))
    };
    seed::apply(bench, &empty).await?;
    let per_tick = (RATE * TICK.as_millis() as u64 / 1_000) as i32;
    let ticks = SECONDS * 1_000 / TICK.as_millis() as u64;
    let expected = ticks * per_tick as u64;
    let daemons = drain::start(bench, &empty).await?;
    let db = bench.db.clone();
    let producer = tokio::spawn(async move {
        let mut interval = tokio::time::interval(TICK);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut versions = vec![0i32; STREAMS as usize];
        for t in 0..ticks {
            interval.tick().await;
            let s = (t % STREAMS as u64) as usize;
            db.append_ticks("steady", s as i64, versions[s], per_tick)
                .await?;
            versions[s] += per_tick;
        }
        Ok::<_, BenchError>(expected)
    });
    let run = drain::watch(
        bench,
        &empty,
        "steady 1000 events/s",
        expected,
        daemons,
        Some(producer),
    )
    .await?;
    let lat = bench.db.apply_latency("bench_0", 0).await?;
    out.details.push(format!(
        "{} events appended at {RATE}/s for {SECONDS} s over {STREAMS} streams; append -> applied p50 {:.1} ms, p99 {:.1} ms",
        lat.count, lat.p50, lat.p99
    ));
    out.details.push(format!(
        "apply p50/p99 {:.2}/{:.2} ms, claim p50/p99 {:.2}/{:.2} ms",
        run.apply.p50_ms, run.apply.p99_ms, run.claim.p50_ms, run.claim.p99_ms
    ));
    out.ratio(
        "append -> applied p99 / 100 ms",
        lat.p99 / 100.0,
        Some(Target::AtMost(1.0)),
    );
    Ok(out)
}

async fn rss(bench: &Bench, main: &DrainRun) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::Rss);
    let max_entries = bench.base_settings.cooldown.max_entries;
    let run = if main.cooldown_entries as u64 * 10 >= max_entries as u64 * 9 {
        main.clone()
    } else {
        let n = (max_entries as u64 * 11 / 10).max(1);
        let seed = Seed::healthy(n, bench.config.streams.min(n), 1, payload(bench));
        seed::apply(bench, &seed).await?;
        let run = drain::drain(bench, &seed, "fill the cooldown cache").await?;
        out.drain_line(&run);
        run
    };
    out.details.push(format!(
        "cooldown cache {} of {} entries; RSS {:.1} MiB at the end, peak {:.1} MiB (the whole bench process: daemon and harness)",
        run.cooldown_entries,
        max_entries,
        run.rss_kib as f64 / 1024.0,
        run.peak_rss_kib as f64 / 1024.0
    ));
    out.ratio(
        "peak RSS / 64 MiB",
        run.peak_rss_kib as f64 / 1024.0 / 64.0,
        Some(Target::AtMost(1.0)),
    );
    Ok(out)
}

const LANE: u64 = 100;
const SAMPLES: usize = 40;

async fn claim_samples(bench: &Bench, names: &[String]) -> Result<Percentiles, BenchError> {
    let max_streams = bench.base_settings.worker.max_streams_per_claim as i32;
    let batch = bench.config.batch_size as i32;
    // One warm-up claim, then the samples.
    bench.db.timed_claim(names, max_streams, batch).await?;
    let mut samples = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let (_, took) = bench.db.timed_claim(names, max_streams, batch).await?;
        samples.push(took);
    }
    Ok(percentiles(&mut samples))
}

async fn plans(
    bench: &Bench,
    out: &mut CheckOutcome,
    names: &[String],
    at: &str,
) -> Result<(), BenchError> {
    let max_streams = bench.base_settings.worker.max_streams_per_claim as i32;
    let batch = bench.config.batch_size as i32;
    let claim = bench.db.explain_claim(names, max_streams, batch).await?;
    out.plans.push((format!("get_stream_events, {at}"), claim));
    let lease = bench.db.explain_limit_lease(names, batch).await?;
    out.plans
        .push((format!("the limit's lease statement, {at}"), lease));
    Ok(())
}

async fn claim_scale(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::ClaimScale);
    let small_rows = 10_000;
    let small = Seed::healthy(small_rows, small_rows / LANE, 1, payload(bench));
    let names = small.perspective_names();
    seed::apply(bench, &small).await?;
    let at_small = claim_samples(bench, &names).await?;
    plans(bench, &mut out, &names, "10 000-row backlog").await?;

    let large_rows = bench.config.large_backlog.max(small_rows);
    let large = Seed::healthy(large_rows, large_rows / LANE, 1, payload(bench));
    let started = std::time::Instant::now();
    seed::apply(bench, &large).await?;
    out.details.push(format!(
        "seeded {large_rows} rows in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    let at_large = claim_samples(bench, &names).await?;
    plans(
        bench,
        &mut out,
        &names,
        &format!("{large_rows}-row backlog"),
    )
    .await?;
    out.details.push(format!(
        "claim (get_stream_events, {SAMPLES} samples) p50/p99: {:.2}/{:.2} ms at {small_rows} rows, {:.2}/{:.2} ms at {large_rows} rows",
        at_small.p50_ms, at_small.p99_ms, at_large.p50_ms, at_large.p99_ms
    ));
    out.ratio(
        format!("claim p50 at {large_rows} / at {small_rows} rows"),
        at_large.p50_ms / at_small.p50_ms.max(1e-9),
        Some(Target::AtMost(1.5)),
    );
    Ok(out)
}

async fn dead_tuples(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::DeadTuples);
    let small_rows = 10_000;
    let small = Seed::healthy(small_rows, small_rows / LANE, 1, payload(bench));
    let names = small.perspective_names();
    seed::apply(bench, &small).await?;
    let clean = claim_samples(bench, &names).await?;

    let dead = bench.config.dead_tuples;
    let last_live = bench.db.max_position().await?;
    let snapshot = bench.db.hold_snapshot().await?;
    let result = async {
        bench
            .db
            .seed(
                "dead",
                (dead / LANE).max(1) as i64,
                LANE as i64,
                crate::store::bench::BENCH_EVENT_TYPE,
                payload(bench) as i32,
            )
            .await?;
        let deleted = bench.db.delete_work_after(last_live).await?;
        let held = claim_samples(bench, &names).await?;
        plans(
            bench,
            &mut out,
            &names,
            &format!("10 000 live rows, {deleted} unprunable dead tuples"),
        )
        .await?;
        Ok::<_, BenchError>((deleted, held))
    }
    .await;
    let _ = snapshot.rollback().await;
    let (deleted, held) = result?;
    out.details.push(format!(
        "claim round p50/p99: {:.2}/{:.2} ms clean, {:.2}/{:.2} ms with {deleted} dead tuples behind an open snapshot",
        clean.p50_ms, clean.p99_ms, held.p50_ms, held.p99_ms
    ));
    out.ratio(
        "claim p50 with unprunable dead tuples / clean",
        held.p50_ms / clean.p50_ms.max(1e-9),
        Some(Target::AtMost(3.0)),
    );
    Ok(out)
}

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
async fn producers(bench: &Bench) -> Result<CheckOutcome, BenchError> {
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
    };
    seed::apply(bench, &seed).await?;
    let streams = bench.db.stream_ids("producers", STREAMS as i64).await?;
    let producer = crate::store::Store::connect(&bench.daemon_options).await?;
    // A warm-up, then vantage idle.
    append_latencies(&producer, &streams, "Fail", 50).await?;
    // (idle is measured before and after the busy phases, and taken over both: the machine's
    // own load drifts during a run)
    let mut idle_samples = append_latencies(&producer, &streams, "Fail", APPENDS).await?;

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
        let (mut read, mut unread) =
            paired_append_latencies(&producer, &streams, "Fail", &others, APPENDS).await?;
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
    let rebuilding =
        percentiles(&mut append_latencies(&producer, &streams, "Fail", APPENDS).await?);
    stop.cancel();
    let chunks = requeue
        .await
        .map_err(|e| BenchError::Incorrect(format!("the re-queue task crashed: {e}")))??;

    // An operator's bulk requeue: every queued row of those streams dead-lettered first, then
    // handed back one dead letter at a time while the producer appends.
    let letters = bench.db.dead_letter_queued(&failing.name).await?;
    let stop = tokio_util::sync::CancellationToken::new();
    let operator = {
        let store = producer.clone();
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
    let requeueing =
        percentiles(&mut append_latencies(&producer, &streams, "Fail", APPENDS).await?);
    stop.cancel();
    let requeued = operator
        .await
        .map_err(|e| BenchError::Incorrect(format!("the operator task crashed: {e}")))??;
    let idle_before = percentiles(&mut idle_samples);
    let mut idle_after_samples = append_latencies(&producer, &streams, "Fail", APPENDS).await?;
    let idle_after = percentiles(&mut idle_after_samples);
    idle_samples.extend(idle_after_samples);
    let idle = percentiles(&mut idle_samples);
    producer.close().await;

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

/// A producer's transaction held open over streams with work (a stalled bulk import that
/// appended once to each of 300 backlog streams): the daemon drains every other row at the rate
/// it drains them without it (target: at least 0.8 of it), and the held events are applied as
/// soon as the producer commits.
async fn held_append(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    const HELD: i64 = 300;
    let mut out = CheckOutcome::new(Check::HeldAppend);
    let n = (bench.config.events / 4).clamp(1_000, 50_000);
    let streams = bench.config.streams.clamp(HELD as u64, n);
    let seed = Seed::healthy(n, streams, 1, payload(bench));
    seed::apply(bench, &seed).await?;
    let free = drain::drain(bench, &seed, "drain, nothing held").await?;
    out.drain_line(&free);

    seed::apply(bench, &seed).await?;
    let held_streams = bench.db.stream_ids("main", HELD).await?;
    let mut producer = bench
        .db
        .store()
        .pool()
        .begin()
        .await
        .map_err(crate::store::StoreError::from)?;
    for s in &held_streams {
        crate::store::append_events_in(
            &mut producer,
            *s,
            None,
            &[crate::store::NewEvent::new(
                crate::store::bench::BENCH_EVENT_TYPE,
                serde_json::json!({ "held": true }),
            )],
        )
        .await?;
    }
    let held_since = std::time::Instant::now();
    let beside = drain::drain(bench, &seed, "drain, 300 streams' appends held open").await?;
    out.drain_line(&beside);
    let held_for = held_since.elapsed();

    // The commit, with a daemon running: how soon are the held events applied?
    let daemons = drain::start(bench, &seed).await?;
    let daemons_started = daemons.started();
    producer
        .commit()
        .await
        .map_err(crate::store::StoreError::from)?;
    let committed = std::time::Instant::now();
    let after = drain::watch(
        bench,
        &seed,
        "the held events, after the commit",
        HELD as u64,
        daemons,
        None,
    )
    .await?;
    // (from the commit to the moment the last held event was applied: `after.elapsed` counts
    // from the daemons' start and ends there, before they are stopped and the run measured)
    let applied_in = (daemons_started + after.elapsed).saturating_duration_since(committed);
    out.details.push(format!(
        "held open {:.1} s over {HELD} streams with work; after the commit its {} events were applied in {:.0} ms",
        held_for.as_secs_f64(),
        after.rows,
        applied_in.as_secs_f64() * 1e3
    ));
    out.ratio(
        "drain beside a held append / without (rows/s)",
        beside.rate() / free.rate().max(1e-9),
        Some(Target::AtLeast(0.8)),
    );
    Ok(out)
}
