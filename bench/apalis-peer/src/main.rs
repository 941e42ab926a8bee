//! The peer of `vantage bench`: apalis-postgres (crates.io) processes the same N events as
//! jobs, at the same concurrency, on the same PostgreSQL; each job's handler runs the same
//! upsert as vantage's trivial perspective, into a read model table of the same shape (schema
//! `apalis_peer`). Prints `apalis: <events/s>`.
//!
//! ```sh
//! cargo run --release --manifest-path bench/apalis-peer/Cargo.toml -- \
//!     --database-url postgres://... --events 200000 --streams 2000 --concurrency 4 --batch-size 500
//! ```
//! Jobs are pushed before the clock starts; the clock runs from the worker's start to the
//! last job done.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use apalis::prelude::*;
use apalis_postgres::{Config, PgPool, PostgresStorage};
use futures::stream::{self, StreamExt};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// One event, as a job: the keys the upsert needs, and the payload.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Tick {
    stream_id: Uuid,
    stream_version: i32,
    event_id: Uuid,
    global_position: i64,
    data: serde_json::Value,
}

/// The read model, the same shape as vantage bench's `bench_applied`.
const SETUP: &str = "
DROP SCHEMA IF EXISTS apalis_peer CASCADE;
CREATE SCHEMA apalis_peer;
CREATE SEQUENCE apalis_peer.bench_applied_seq;
CREATE TABLE apalis_peer.bench_applied (
    perspective     text        NOT NULL,
    stream_id       uuid        NOT NULL,
    stream_version  int         NOT NULL,
    event_id        uuid        NOT NULL,
    global_position bigint      NOT NULL,
    applied         int         NOT NULL DEFAULT 1,
    seq             bigint      NOT NULL DEFAULT nextval('apalis_peer.bench_applied_seq'),
    applied_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (perspective, stream_id, stream_version)
)";

/// vantage bench's perspective statement, with the event's fields bound the same way.
const UPSERT: &str = "
INSERT INTO apalis_peer.bench_applied (perspective, stream_id, stream_version, event_id, global_position)
VALUES ('bench_0', $1, $2, $3, $4)
ON CONFLICT (perspective, stream_id, stream_version)
DO UPDATE SET applied = apalis_peer.bench_applied.applied + 1";

/// Empties apalis' job table of earlier runs.
const CLEAR_JOBS: &str = "DELETE FROM apalis.jobs";

#[derive(Clone)]
struct Shared {
    pool: PgPool,
    done: Arc<AtomicU64>,
    expected: u64,
}

async fn apply(tick: Tick, shared: Data<Shared>, worker: WorkerContext) -> Result<(), BoxDynError> {
    let _ = &tick.data;
    sqlx::query(UPSERT)
        .bind(tick.stream_id)
        .bind(tick.stream_version)
        .bind(tick.event_id)
        .bind(tick.global_position)
        .execute(&shared.pool)
        .await?;
    if shared.done.fetch_add(1, Ordering::SeqCst) + 1 >= shared.expected {
        let _ = worker.stop();
    }
    Ok(())
}

struct Args {
    url: String,
    events: u64,
    streams: u64,
    concurrency: usize,
    batch_size: usize,
    payload_bytes: usize,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        url: std::env::var("DATABASE_URL").unwrap_or_default(),
        events: 200_000,
        streams: 2_000,
        concurrency: 4,
        batch_size: 500,
        payload_bytes: 64,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = || {
            value
                .parse::<u64>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        match flag.as_str() {
            "--database-url" => a.url = value.clone(),
            "--events" => a.events = num()?,
            "--streams" => a.streams = num()?,
            "--concurrency" => a.concurrency = num()? as usize,
            "--batch-size" => a.batch_size = num()? as usize,
            "--payload-bytes" => a.payload_bytes = num()? as usize,
            other => return Err(format!("unknown option {other}")),
        }
    }
    if a.url.is_empty() {
        return Err("set DATABASE_URL or pass --database-url".into());
    }
    Ok(a)
}

#[tokio::main]
async fn main() {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("apalis-peer: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(a).await {
        eprintln!("apalis-peer: {e}");
        std::process::exit(1);
    }
}

async fn run(a: Args) -> Result<(), BoxDynError> {
    // The handlers' pool plus apalis' own connections (fetcher, heartbeat, listener).
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(a.concurrency as u32 + 4)
        .connect(&a.url)
        .await?;
    PostgresStorage::setup(&pool).await?;
    sqlx::raw_sql(SETUP).execute(&pool).await?;
    sqlx::query(CLEAR_JOBS).execute(&pool).await?;

    let config = Config::default()
        .queue("vantage-bench-peer")
        .batch_size(a.batch_size);
    let mut backend = PostgresStorage::<Tick>::new(&pool).with_config(config);

    // The same events as vantage bench seeds: round robin over the streams.
    let streams = a.streams.clamp(1, a.events.max(1));
    let per_stream = (a.events / streams).max(1);
    let expected = streams * per_stream;
    let pad = "x".repeat(a.payload_bytes);
    let pushed = Instant::now();
    let mut position = 0i64;
    let mut tasks = stream::iter((1..=per_stream).flat_map(|v| (0..streams).map(move |s| (s, v))))
        .map(move |(s, v)| {
            position += 1;
            TaskBuilder::new(Tick {
                stream_id: Uuid::from_u64_pair(0x7065_6572, s),
                stream_version: v as i32,
                event_id: Uuid::new_v4(),
                global_position: position,
                data: serde_json::json!({ "s": s, "v": v, "pad": pad }),
            })
            .build()
        });
    backend.push_all(&mut tasks).await?;
    eprintln!(
        "apalis-peer: pushed {expected} jobs in {:.1} s",
        pushed.elapsed().as_secs_f64()
    );

    let shared = Shared {
        pool: pool.clone(),
        done: Arc::new(AtomicU64::new(0)),
        expected,
    };
    let done = Arc::clone(&shared.done);
    let worker = WorkerBuilder::new("vantage-bench-peer")
        .backend(backend)
        .data(shared)
        .concurrency(a.concurrency)
        .parallelize(tokio::spawn)
        .build(apply);
    let started = Instant::now();
    let progress = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            eprintln!(
                "apalis-peer: {} of {expected} done",
                done.load(Ordering::SeqCst)
            );
        }
    });
    worker.run().await?;
    let elapsed = started.elapsed();
    progress.abort();

    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM apalis_peer.bench_applied")
        .fetch_one(&pool)
        .await?;
    eprintln!(
        "apalis-peer: {applied} of {expected} events applied in {:.2} s ({} at concurrency {}, batch {})",
        elapsed.as_secs_f64(),
        "apalis-postgres 1.0",
        a.concurrency,
        a.batch_size
    );
    println!(
        "apalis: {:.0}",
        applied as f64 / elapsed.as_secs_f64().max(1e-9)
    );
    Ok(())
}
