//! The drain with traces on, against the same drain with traces off, twice: events without a
//! `traceparent` (the main seed: spans of claims and batches only), and every event traced.
//!
//! Each pair of drains reads the same seed. When every event's metadata carries a
//! `traceparent` of its own (a sampled producer span), with traces on each row's apply is a
//! span, plus each claim and batch, all sampled at 100 % and exported over OTLP/HTTP (protobuf) to a collector
//! stand-in in this process that reads each request and answers 200. With traces off, the same
//! metadata is never parsed. The traced drain's daemon runs on a runtime of its own whose
//! threads have the traced subscriber as their default, so the untraced drain runs exactly as
//! in production (no layer, no filter: spans never built). Rounds alternate off, on; the
//! median ratio is reported, with the spans exported against those expected, so a span
//! dropped by a full queue cannot pass for low overhead.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tracing_subscriber::layer::SubscriberExt;

use super::{CheckOutcome, Target};
use crate::bench::drain::{self, DrainRun};
use crate::bench::seed::{self, Seed};
use crate::bench::{Bench, BenchError, Check};
use crate::config::OtlpProtocol;
use crate::store::bench::BenchStore;
use crate::store::Store;
use crate::telemetry::traces::{self, SamplerChoice, TraceSettings};

/// Requests and bytes the stand-in collector received.
#[derive(Default)]
struct Received {
    requests: AtomicU64,
    bytes: AtomicU64,
}

/// A collector stand-in on a free loopback port: reads every request's body and answers 200
/// with an empty (valid) export response.
async fn collector() -> Result<(SocketAddr, Arc<Received>), BenchError> {
    let received = Arc::new(Received::default());
    let app = axum::Router::new()
        .route(
            "/v1/traces",
            axum::routing::post(
                |axum::extract::State(r): axum::extract::State<Arc<Received>>,
                 body: axum::body::Bytes| async move {
                    r.requests.fetch_add(1, Ordering::Relaxed);
                    r.bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
                    Vec::<u8>::new()
                },
            ),
        )
        .with_state(Arc::clone(&received));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| BenchError::Incorrect(format!("cannot listen for the collector: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| BenchError::Incorrect(e.to_string()))?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((addr, received))
}

pub(super) async fn run(bench: &Bench) -> Result<CheckOutcome, BenchError> {
    let mut out = CheckOutcome::new(Check::Traces);
    let (addr, received) = collector().await?;
    let settings = TraceSettings {
        endpoint: format!("http://{addr}/v1/traces"),
        protocol: OtlpProtocol::HttpProtobuf,
        sampler: SamplerChoice::ParentBased(Box::new(SamplerChoice::AlwaysOn)),
        service_name: "vantage-bench".into(),
    };
    for (traced, label) in [
        (
            false,
            "drain, traces on (100 %), events without traceparent / off (rows/s)",
        ),
        (
            true,
            "drain, traces on (100 %), every event traced / off (rows/s)",
        ),
    ] {
        let seed = Seed {
            traced,
            ..Seed::main(&bench.config)
        };
        let what = if traced {
            "every event traced"
        } else {
            "events untraced"
        };
        let mut pairs = Vec::new();
        for round in 0..bench.config.rounds.max(1) {
            bench.progress.note(&format!(
                "traces ({what}): round {} of {}",
                round + 1,
                bench.config.rounds.max(1)
            ));
            seed::apply(bench, &seed).await?;
            let off = drain::drain(bench, &seed, &format!("traces off, {what}")).await?;
            seed::apply(bench, &seed).await?;
            let before = traces::exported();
            let requests = received.requests.load(Ordering::Relaxed);
            let bytes = received.bytes.load(Ordering::Relaxed);
            let on = traced_drain(bench, &seed, &settings, &format!("traces on, {what}"))?;
            let after = traces::exported();
            pairs.push(Pair {
                ratio: on.rate() / off.rate().max(1e-9),
                off,
                on,
                exported: after.0 - before.0,
                failed: after.1 - before.1,
                requests: received.requests.load(Ordering::Relaxed) - requests,
                bytes: received.bytes.load(Ordering::Relaxed) - bytes,
            });
        }
        out.details.push(format!(
            "{what}, rounds (on / off): {}",
            pairs
                .iter()
                .map(|p| format!("{:.3}", p.ratio))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        pairs.sort_by(|a, b| a.ratio.total_cmp(&b.ratio));
        let median = pairs.swap_remove(pairs.len() / 2);
        out.drain_line(&median.off);
        out.drain_line(&median.on);
        // CPU is the cost tracing adds (the machine's cores are what the drain runs on): the
        // vantage process's, and the server's, per row, off → on.
        let server = |r: &DrainRun| {
            r.per_event
                .server_cpu_us
                .map_or_else(|| "n/a".to_owned(), |us| format!("{us:.1}"))
        };
        out.details.push(format!(
            "  CPU per row, off → on: this process {:.1} → {:.1} µs, server {} → {} µs",
            median.off.per_event.client_cpu_us,
            median.on.per_event.client_cpu_us,
            server(&median.off),
            server(&median.on),
        ));
        out.details.push(format!(
            "  spans exported: {} ({} failed) for {} rows; the collector got {} requests, {} bytes ({} B/span)",
            median.exported,
            median.failed,
            median.on.rows,
            median.requests,
            median.bytes,
            median.bytes / median.exported.max(1),
        ));
        if traced && median.exported < median.on.rows {
            out.details.push(format!(
                "  WARNING: {} spans fewer than rows: spans were dropped (a full export queue), so the ratio flatters",
                median.on.rows - median.exported
            ));
        }
        out.ratio(label, median.ratio, Some(Target::AtLeast(0.95)));
    }
    Ok(out)
}

/// One round: the drain with traces off, then on, and what the export did.
struct Pair {
    ratio: f64,
    off: DrainRun,
    on: DrainRun,
    exported: u64,
    failed: u64,
    requests: u64,
    bytes: u64,
}

/// The drain of `seed` by a daemon whose every thread exports spans to `settings`: a runtime
/// of its own on a thread of its own, so the caller's runtime and the global subscriber stay
/// as they are. The spans still queued are exported before it returns.
fn traced_drain(
    bench: &Bench,
    seed: &Seed,
    settings: &TraceSettings,
    what: &str,
) -> Result<DrainRun, BenchError> {
    let provider = traces::provider(settings).map_err(BenchError::Metrics)?;
    let dispatch =
        tracing::Dispatch::new(tracing_subscriber::registry().with(traces::layer(&provider)));
    let run = tokio::task::block_in_place(|| {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let on_thread = dispatch.clone();
                    let runtime = tokio::runtime::Builder::new_multi_thread()
                        .enable_all()
                        .on_thread_start(move || {
                            // For the thread's life: the runtime's threads end with it.
                            std::mem::forget(tracing::dispatcher::set_default(&on_thread));
                        })
                        .build()
                        .map_err(|e| BenchError::Incorrect(format!("traced runtime: {e}")))?;
                    let _default = tracing::dispatcher::set_default(&dispatch);
                    // The harness's own statements go through a pool of this runtime, closed
                    // before it ends: a connection the caller's pool opened here would die
                    // with the runtime ("a Tokio 1.x context … is being shutdown").
                    let run = runtime.block_on(async {
                        let mut options = bench.daemon_options.clone();
                        options.application_name = "vantage bench".into();
                        let local = Bench {
                            db: BenchStore::new(Store::connect(&options).await?),
                            daemon_options: bench.daemon_options.clone(),
                            base_settings: bench.base_settings.clone(),
                            metrics: bench.metrics.clone(),
                            progress: bench.progress.clone(),
                            config: bench.config.clone(),
                            statement_stats: bench.statement_stats,
                        };
                        let run = drain::drain(&local, seed, what).await;
                        // (bounded: a connection still held by a task of this runtime is
                        // dropped with it anyway)
                        let _ =
                            tokio::time::timeout(std::time::Duration::from_secs(5), local.close())
                                .await;
                        run
                    });
                    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
                    run
                })
                .join()
                .unwrap_or_else(|_| Err(BenchError::Incorrect("the traced drain panicked".into())))
        })
    });
    let _ = provider.shutdown_with_timeout(std::time::Duration::from_secs(30));
    run
}
