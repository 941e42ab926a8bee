//! Measures how fast the daemon drains a backlog, with the default settings and one SQL
//! perspective per P that upserts a counter (the benchmark issue builds the full harness on this).
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/bench cargo run --release --example drain_backlog -- 100000 1000 1
//! ```
//! Arguments: events, streams, perspectives. The database's `vantage` schema and the `bench`
//! schema are dropped and recreated.

use std::time::{Duration, Instant};

use vantage::config::{DatabaseUrl, PerspectiveSettings, Settings};
use vantage::daemon::DaemonBuilder;
use vantage::store::{NewEvent, Store, StoreOptions};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let events = *args.first().unwrap_or(&100_000);
    let streams = *args.get(1).unwrap_or(&1_000);
    let perspectives = *args.get(2).unwrap_or(&1);
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| anyhow::anyhow!("set DATABASE_URL to a database this may wipe"))?;

    let store = Store::connect(&StoreOptions::for_url(&url)).await?;
    sqlx::raw_sql(
        "DROP SCHEMA IF EXISTS vantage CASCADE; DROP SCHEMA IF EXISTS bench CASCADE; \
         CREATE SCHEMA bench; \
         CREATE TABLE bench.counts (perspective text, stream_id uuid, n bigint, last_version int, \
         PRIMARY KEY (perspective, stream_id))",
    )
    .execute(store.pool())
    .await?;
    store.migrate().await?;

    let mut settings = Settings::default();
    settings.database.url = Some(DatabaseUrl::new(url.clone()));
    for p in 0..perspectives {
        let name = format!("bench_{p}");
        store.register_perspective(&name, &["Tick".into()]).await?;
        settings.perspectives.push(PerspectiveSettings {
            name: name.clone(),
            events: vec!["Tick".into()],
            sql: [(
                "Tick".to_string(),
                format!(
                    "INSERT INTO bench.counts (perspective, stream_id, n, last_version) \
                     VALUES ('{name}', $2, 1, $6) ON CONFLICT (perspective, stream_id) \
                     DO UPDATE SET n = bench.counts.n + 1, last_version = EXCLUDED.last_version"
                ),
            )]
            .into(),
            reset: None,
            quarantine_after: None,
            ..Default::default()
        });
    }

    // Seed: events spread round-robin over the streams, appended in batches per stream.
    let seed_started = Instant::now();
    let ids: Vec<uuid::Uuid> = (0..streams).map(|_| uuid::Uuid::new_v4()).collect();
    let per_stream = events / streams;
    for chunk in 0..per_stream.div_ceil(50) {
        for id in &ids {
            let n = 50.min(per_stream - chunk * 50);
            let batch: Vec<NewEvent> = (0..n)
                .map(|i| NewEvent::new("Tick", serde_json::json!({ "i": chunk * 50 + i })))
                .collect();
            store.append_events(*id, None, &batch).await?;
        }
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM wh_perspective_events")
        .fetch_one(store.pool())
        .await?;
    eprintln!(
        "seeded {} events over {streams} streams ({rows} work rows) in {:.1?}",
        per_stream * streams,
        seed_started.elapsed()
    );

    let started = Instant::now();
    let daemon = DaemonBuilder::new(settings)
        .store(store.clone())
        .without_http()
        .start()
        .await?;
    loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM wh_perspective_events")
            .fetch_one(store.pool())
            .await?;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = started.elapsed();
    daemon.shutdown().await?;
    let applied: i64 = sqlx::query_scalar("SELECT coalesce(sum(n), 0)::bigint FROM bench.counts")
        .fetch_one(store.pool())
        .await?;
    println!(
        "drained {rows} work rows ({applied} applied) in {:.2}s: {:.0} rows/s",
        elapsed.as_secs_f64(),
        rows as f64 / elapsed.as_secs_f64()
    );
    Ok(())
}
