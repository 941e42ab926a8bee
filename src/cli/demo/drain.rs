//! Appends the sample and drains it: the producer in the background, progress every tick,
//! until nothing is pending and every poison event is dead-lettered; then the report.

use super::args::Addresses;
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use tokio_util::sync::CancellationToken;

use super::args::{store_failure, DemoArgs};
use super::config::{DemoConfig, DEMO_CONFIG_PATH};
use super::producer::{append_sample, AbortOnDrop, Counters, Produced};
use super::progress::{Progress, Snapshot};
use super::report::{print_report, thousands};
use super::sample::{Sample, POISON_EVENTS};
use crate::cli::exit;
use crate::store::{DeadLetter, Store};

/// How often the drain is checked (and the progress line refreshed on a terminal).
const TICK: Duration = Duration::from_millis(250);

/// Appends the sample, drains it with progress, and prints the report. `None` when all went
/// well; otherwise the exit code.
pub(super) async fn produce_and_drain(
    demo: &DemoConfig,
    args: &DemoArgs,
    interrupt: &CancellationToken,
    tty: bool,
    producer: &Store,
    addrs: Addresses,
) -> Option<i32> {
    let names = demo.perspective_names();
    let baseline = match Snapshot::take(producer, &names).await {
        Ok(s) => s,
        Err(e) => return Some(store_failure("cannot read the work queue", &e)),
    };
    let sample = Sample::generate(args.orders as usize, args.customers as usize, Utc::now());
    let fan_out = demo.fan_out();
    let total_work: u64 = sample
        .orders
        .iter()
        .flat_map(|o| &o.events)
        .map(|e| fan_out.get(&e.event_type).copied().unwrap_or(0))
        .sum();
    let max_attempts = demo
        .settings
        .worker
        .max_perspective_event_attempts
        .unwrap_or(10);
    eprintln!(
        "Appending {} orders from {} customers: {} events, one stream per order, applied {} times \
         in all across the perspectives. {} OrderPaid events carry amounts revenue_by_day cannot \
         apply: one written with a decimal comma (\"{}\"), one too large for its column, one \
         missing (and that order's refund waits behind it).",
        thousands(sample.orders.len() as u64),
        thousands(sample.customers as u64),
        thousands(sample.events as u64),
        thousands(total_work),
        POISON_EVENTS,
        sample.poison_example,
    );

    let counters = Arc::new(Counters::default());
    let total_events = sample.events as u64;
    let mut producer_task = AbortOnDrop(Some(tokio::spawn(append_sample(
        producer.clone(),
        sample.orders,
        Arc::new(fan_out),
        Arc::clone(&counters),
    ))));
    let mut produced: Option<Produced> = None;

    let started = Instant::now();
    let mut progress = Progress::new(tty);
    let mut ticker = tokio::time::interval(TICK);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_snapshot = baseline;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = interrupt.cancelled() => {
                progress.finish();
                eprintln!("vantage demo: interrupted before the drain finished.");
                // Without --once, stopping is what Ctrl-C is for; with it, the job is undone.
                return Some(if args.once { exit::FAILURE } else { exit::OK });
            }
        }
        if producer_task.is_finished() {
            let task = producer_task.0.take().expect("checked above");
            match task.await {
                Ok(Ok(p)) => produced = Some(p),
                Ok(Err(e)) => {
                    progress.finish();
                    return Some(store_failure("appending the sample failed", &e));
                }
                Err(e) => {
                    progress.finish();
                    eprintln!("vantage demo: the producer crashed: {e}");
                    return Some(exit::FAILURE);
                }
            }
        }
        match Snapshot::take(producer, &names).await {
            Ok(s) => last_snapshot = s,
            Err(e) => progress.note(&format!("cannot read the work queue: {e}")),
        }
        let snap = &last_snapshot;
        let work = counters.work.load(Ordering::Relaxed);
        let applied =
            (work as i64 - (snap.remaining() - baseline.remaining()) - (snap.dead - baseline.dead))
                .clamp(0, work as i64) as u64;
        let appending = produced
            .is_none()
            .then(|| (counters.events.load(Ordering::Relaxed), total_events));
        progress.update(
            started.elapsed(),
            appending,
            applied,
            total_work,
            snap,
            snap.dead - baseline.dead,
        );
        if produced.is_some() && snap.remaining() == 0 {
            progress.finish();
            let elapsed = started.elapsed();
            eprintln!(
                "Drained in {:.1}s: {} applied, {} dead-lettered (about {}/s).",
                elapsed.as_secs_f64(),
                thousands(applied),
                snap.dead - baseline.dead,
                thousands((applied as f64 / elapsed.as_secs_f64().max(0.001)) as u64)
            );
            break;
        }
        if started.elapsed() > args.timeout {
            progress.finish();
            eprintln!(
                "vantage demo: the sample was not drained within {}: {} work rows remain \
                 ({} pending, {} leased, {} waiting to retry) and {} events were dead-lettered. \
                 Run again with RUST_LOG=info for details.",
                humantime::format_duration(args.timeout),
                snap.remaining(),
                snap.pending,
                snap.leased,
                snap.parked,
                snap.dead - baseline.dead,
            );
            return Some(exit::FAILURE);
        }
    }
    let produced = produced.expect("the loop ends only once the producer is done");

    // Every poison event must have been dead-lettered (by some perspective), not applied.
    let dead = match producer.open_dead_letters(None).await {
        Ok(all) => all,
        Err(e) => return Some(store_failure("cannot read the dead letters", &e)),
    };
    let ours: Vec<DeadLetter> = dead
        .iter()
        .filter(|d| names.contains(&d.perspective_name))
        .filter(|d| (produced.first_position..=produced.last_position).contains(&d.global_position))
        .cloned()
        .collect();
    let earlier = dead.len() - ours.len();
    let dead_positions: BTreeSet<i64> = ours.iter().map(|d| d.global_position).collect();
    let missing: Vec<String> = produced
        .poison_positions
        .iter()
        .filter(|p| !dead_positions.contains(p))
        .map(|p| p.to_string())
        .collect();
    if !missing.is_empty() {
        eprintln!(
            "vantage demo: the poison events at positions {} were applied instead of being \
             dead-lettered: was {} changed so that its statements accept them?",
            missing.join(", "),
            demo.file
                .as_deref()
                .map_or(DEMO_CONFIG_PATH.into(), |p| p.display().to_string()),
        );
        return Some(exit::FAILURE);
    }

    print_report(demo, args, &ours, earlier, max_attempts, producer, addrs).await;
    None
}
