//! A Rust perspective run by the vantage daemon as a library.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run --example rust_perspective
//! cargo run --example rust_perspective     # without DATABASE_URL: a throwaway local PostgreSQL
//! ```
//!
//! It counts events per type into `example.event_counts`, appends a few events, waits until the
//! daemon has applied them, prints the read model and shuts the daemon down gracefully.
//!
//! A second perspective, `receipts`, has a side effect outside the database (it would email a
//! receipt for every checkout; here it prints one). It shows the pattern for such effects: the
//! envelope's `replay` is true when the event is delivered again to rebuild state (the history
//! `vantage::perspective::rebuild` re-queues after its reset), and the effect already happened
//! then, so it is skipped; a live event has `replay` false.

use std::time::Duration;

use async_trait::async_trait;
use vantage::config::{DatabaseUrl, Settings};
use vantage::daemon::DaemonBuilder;
use vantage::perspective::{ApplyError, ApplyTx, EventEnvelope, Perspective};
use vantage::store::{NewEvent, Store, StoreOptions};

/// Counts events per type. Its writes go through `tx`, the transaction that also completes the
/// event's work row, so each event is counted exactly once even across crashes.
struct EventCounts;

#[async_trait]
impl Perspective for EventCounts {
    fn name(&self) -> &str {
        "event_counts"
    }

    fn event_types(&self) -> Vec<String> {
        vec!["*".into()]
    }

    async fn apply(&self, event: &EventEnvelope, tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        if event.data.get("broken").is_some() {
            // Will never succeed: dead-lettered at once instead of retried.
            return Err(ApplyError::Permanent("payload marked broken".into()));
        }
        sqlx::query(
            "INSERT INTO example.event_counts (event_type, n) VALUES ($1, 1) \
             ON CONFLICT (event_type) DO UPDATE SET n = example.event_counts.n + 1",
        )
        .bind(&event.event_type)
        .execute(tx.connection()?)
        .await
        .map_err(ApplyError::from_sqlx)?;
        Ok(())
    }

    async fn reset(&self, tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        sqlx::query("TRUNCATE example.event_counts")
            .execute(tx.connection()?)
            .await
            .map_err(ApplyError::from_sqlx)?;
        Ok(())
    }
}

/// Emails a receipt for every checkout (prints it, in this example). The email leaves the
/// database, so it cannot roll back with the apply: it is sent only for a live event, never for
/// a replay (see `EventEnvelope::replay`).
struct Receipts;

#[async_trait]
impl Perspective for Receipts {
    fn name(&self) -> &str {
        "receipts"
    }

    fn event_types(&self) -> Vec<String> {
        vec!["CheckedOut".into()]
    }

    async fn apply(&self, event: &EventEnvelope, _tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        // A read model of its own, written through `tx`, would be updated for replays too:
        // the rebuild's reset cleared it. Only the outside effect depends on `replay`.
        if event.replay {
            println!(
                "receipt for cart {}: sent when it checked out; not again (replay)",
                event.stream_id
            );
        } else {
            println!("receipt for cart {}: sent", event.stream_id);
        }
        Ok(())
    }

    fn effects_in_transaction(&self) -> bool {
        // The email is not in the transaction: the cooldown keeps its mark even if the
        // completion fails, so a re-claimed row is not emailed twice.
        false
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Keep the throwaway server (if any) alive for the whole run.
    let (url, _server) = match std::env::var("DATABASE_URL") {
        Ok(url) => (url, None),
        Err(_) => {
            let server =
                tokio::task::spawn_blocking(vantage::throwaway::ThrowawayPostgres::start).await??;
            (server.url(), Some(server))
        }
    };

    let store = Store::connect(&StoreOptions::for_url(&url)).await?;
    store.migrate().await?;
    sqlx::raw_sql(
        "CREATE SCHEMA IF NOT EXISTS example; \
         CREATE TABLE IF NOT EXISTS example.event_counts (event_type text PRIMARY KEY, n bigint NOT NULL)",
    )
    .execute(store.pool())
    .await?;

    let mut settings = Settings::default();
    settings.database.url = Some(DatabaseUrl::new(url));
    settings.worker.poll_interval = Duration::from_millis(100);
    let daemon = DaemonBuilder::new(settings)
        .store(store.clone())
        .without_http()
        .perspective(EventCounts)
        .perspective(Receipts)
        .start()
        .await?;

    let stream = uuid::Uuid::new_v4();
    store
        .append_events(
            stream,
            Some(0),
            &[
                NewEvent::new("CartCreated", serde_json::json!({})),
                NewEvent::new("ItemAdded", serde_json::json!({"sku": "A-1"})),
                NewEvent::new("ItemAdded", serde_json::json!({"sku": "B-2"})),
                NewEvent::new("ItemAdded", serde_json::json!({"broken": true})),
                NewEvent::new("CheckedOut", serde_json::json!({})),
            ],
        )
        .await?;

    // Wait until nothing is left to apply.
    for _ in 0..100 {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM wh_perspective_events")
            .fetch_one(store.pool())
            .await?;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let counts: Vec<(String, i64)> =
        sqlx::query_as("SELECT event_type, n FROM example.event_counts ORDER BY event_type")
            .fetch_all(store.pool())
            .await?;
    for (event_type, n) in counts {
        println!("{event_type:<12} {n}");
    }
    let dead = store.open_dead_letters(None).await?;
    println!("dead-lettered: {}", dead.len());
    daemon.shutdown().await?;
    Ok(())
}
