//! A typed Rust perspective: stock levels per SKU and warehouse, kept current from
//! `ItemReceived` and `ItemShipped` events. The README's "Build your own daemon binary" walks
//! through this file.
//!
//! ```sh
//! cargo run --example inventory -- --demo   # sample events, the read model, a dead letter; exits
//! cargo run --example inventory             # the daemon: serves until SIGTERM/Ctrl-C
//! cargo test --example inventory            # the tests below: on the memory store (no PostgreSQL),
//!                                           # and once on a throwaway PostgreSQL, as --demo runs it
//! ```
//!
//! Without `DATABASE_URL` it starts a throwaway local PostgreSQL (removed on exit); with it,
//! it uses that database. The rest of the configuration is vantage's own: `VANTAGE__…`
//! variables and `config/vantage.toml` if present.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde::Deserialize;
use sqlx::{Connection, PgConnection};
use vantage::cli::{exit, signals};
use vantage::config::{LoadOptions, Settings};
use vantage::daemon::{DaemonBuilder, DaemonError};
use vantage::perspective::{ApplyError, ApplyTx, Typed, TypedEnvelope, TypedPerspective};
use vantage::store::{NewEvent, Store, StoreOptions};
use vantage::throwaway::ThrowawayPostgres;

// ---- the events: what producers append, as serde types ------------------------------------

/// The events this perspective reads. Each variant is an event type (its name is the stored
/// `event_type`); its fields are the payload. A quantity of 0 does not deserialize, so such an
/// event is dead-lettered at once (`PermanentFailure`) with serde's error as its text.
#[derive(Debug, Clone, PartialEq, Deserialize)]
enum InventoryEvent {
    ItemReceived {
        sku: String,
        warehouse: String,
        quantity: NonZeroU32,
    },
    ItemShipped {
        sku: String,
        warehouse: String,
        quantity: NonZeroU32,
    },
}

// ---- the pure logic: what one event does to the read model ---------------------------------

/// What one event adds to a row of `inventory.levels`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StockChange<'a> {
    sku: &'a str,
    warehouse: &'a str,
    on_hand: i64,
    received: i64,
    shipped: i64,
}

impl<'a> StockChange<'a> {
    fn of(event: &'a InventoryEvent) -> StockChange<'a> {
        match event {
            InventoryEvent::ItemReceived {
                sku,
                warehouse,
                quantity,
            } => StockChange {
                sku,
                warehouse,
                on_hand: i64::from(quantity.get()),
                received: i64::from(quantity.get()),
                shipped: 0,
            },
            InventoryEvent::ItemShipped {
                sku,
                warehouse,
                quantity,
            } => StockChange {
                sku,
                warehouse,
                on_hand: -i64::from(quantity.get()),
                received: 0,
                shipped: i64::from(quantity.get()),
            },
        }
    }
}

impl StockChange<'_> {
    /// The change, applied to levels kept in memory.
    fn add_to(&self, levels: &mut BTreeMap<(String, String), Level>) {
        let level = levels
            .entry((self.sku.to_string(), self.warehouse.to_string()))
            .or_default();
        level.on_hand += self.on_hand;
        level.received += self.received;
        level.shipped += self.shipped;
    }
}

/// One row of the read model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Level {
    on_hand: i64,
    received: i64,
    shipped: i64,
}

/// Levels kept in memory, by (sku, warehouse).
type MemoryLevels = Arc<Mutex<BTreeMap<(String, String), Level>>>;

/// Where the levels are written: `inventory.levels` in the daemon's transaction (production),
/// or a map (unit tests on vantage's memory store, which has no database).
enum Levels {
    Postgres,
    Memory(MemoryLevels),
}

// ---- the perspective: the change, written in the daemon's transaction ----------------------

/// The read model: `inventory.levels`, one row per (sku, warehouse). `on_hand` may go below
/// zero: events are facts, and a shipment recorded before its delivery is still a shipment.
struct InventoryLevels {
    levels: Levels,
}

impl InventoryLevels {
    /// Writes to `inventory.levels`, in the transaction that completes each event.
    fn postgres() -> Self {
        InventoryLevels {
            levels: Levels::Postgres,
        }
    }

    /// Writes to a map (returned, to look at): for tests on the memory store.
    #[cfg_attr(not(test), allow(dead_code))]
    fn in_memory() -> (Self, MemoryLevels) {
        let levels = MemoryLevels::default();
        let perspective = InventoryLevels {
            levels: Levels::Memory(Arc::clone(&levels)),
        };
        (perspective, levels)
    }
}

#[async_trait]
impl TypedPerspective for InventoryLevels {
    type Event = InventoryEvent;

    fn name(&self) -> &str {
        "inventory_levels"
    }

    fn event_types(&self) -> Vec<String> {
        vec!["ItemReceived".into(), "ItemShipped".into()]
    }

    async fn apply(
        &self,
        event: &TypedEnvelope<InventoryEvent>,
        tx: &mut ApplyTx<'_>,
    ) -> Result<(), ApplyError> {
        let change = StockChange::of(&event.data);
        match &self.levels {
            Levels::Memory(levels) => change.add_to(&mut levels.lock().expect("levels lock")),
            // Runs in the transaction that also completes the event's work row: exactly once.
            Levels::Postgres => {
                sqlx::query(
                    "INSERT INTO inventory.levels (sku, warehouse, on_hand, received, shipped) \
                     VALUES ($1, $2, $3, $4, $5) \
                     ON CONFLICT (sku, warehouse) DO UPDATE SET \
                       on_hand = levels.on_hand + EXCLUDED.on_hand, \
                       received = levels.received + EXCLUDED.received, \
                       shipped = levels.shipped + EXCLUDED.shipped",
                )
                .bind(change.sku)
                .bind(change.warehouse)
                .bind(change.on_hand)
                .bind(change.received)
                .bind(change.shipped)
                .execute(tx.connection()?)
                .await
                .map_err(ApplyError::from_sqlx)?;
            }
        }
        Ok(())
    }

    async fn reset(&self, tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        if let Levels::Memory(levels) = &self.levels {
            levels.lock().expect("levels lock").clear();
            return Ok(());
        }
        sqlx::query("TRUNCATE inventory.levels")
            .execute(tx.connection()?)
            .await
            .map_err(ApplyError::from_sqlx)?;
        Ok(())
    }
}

// ---- the binary -------------------------------------------------------------------------

/// A daemon binary: vantage's configuration, logging, signals and exit codes (those of
/// `vantage run`), with this perspective. Its `main` is
/// `ExitCode::from(serve(LoadOptions::default()).await as u8)`.
async fn serve(options: LoadOptions) -> i32 {
    // Defaults < config/vantage.toml (or options.config_path) < VANTAGE__SECTION__KEY;
    // DATABASE_URL and PG* are honoured.
    let settings = match Settings::load(&options) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("inventory: {e}");
            return exit::CONFIG;
        }
    };
    // Traces per [telemetry] and OTEL_* (off unless an endpoint is set); log lines per [log];
    // the first SIGTERM/SIGINT stops gracefully, a second one at once.
    let traces = match vantage::telemetry::traces::from_process_env(&settings.telemetry) {
        Ok(traces) => traces,
        Err(e) => {
            eprintln!("inventory: {e}");
            return exit::CONFIG;
        }
    };
    let stop = match signals::start_service(&settings.log, traces.as_ref()) {
        Ok(token) => token,
        Err(code) => return code,
    };
    let started = DaemonBuilder::new(settings)
        .shutdown_on(stop)
        .perspective(Typed(InventoryLevels::postgres()))
        .start()
        .await;
    let result = match started {
        Ok(daemon) => daemon.wait().await,
        Err(DaemonError::Stopped) => Ok(()), // stopped during start-up, nothing claimed
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("inventory: {e}");
            e.exit_code()
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    // The example runs anywhere: DATABASE_URL, or a throwaway local PostgreSQL kept alive
    // until the end of main.
    let (database_url, _server) = match std::env::var("DATABASE_URL") {
        Ok(url) => (url, None),
        Err(_) => match tokio::task::spawn_blocking(ThrowawayPostgres::start).await {
            Ok(Ok(server)) => (server.url(), Some(server)),
            Ok(Err(e)) => return fail(e.into()),
            Err(e) => return fail(e.into()),
        },
    };
    // The read model's table belongs to the application (its own migrations); here, made
    // up front.
    if let Err(e) = create_read_model(&database_url).await {
        return fail(e);
    }
    let options = LoadOptions {
        database_url: Some(database_url),
        ..LoadOptions::default()
    };
    if std::env::args().any(|a| a == "--demo") {
        return match demo(options).await {
            Ok(outcome) => {
                print_demo(&outcome);
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        };
    }
    let code = serve(options).await;
    // The spans still queued go out before the process ends (off the runtime's threads: the
    // flush blocks until the exporter is done).
    let _ = tokio::task::spawn_blocking(|| {
        vantage::telemetry::traces::flush(std::time::Duration::from_secs(5))
    })
    .await;
    ExitCode::from(code as u8)
}

fn fail(e: anyhow::Error) -> ExitCode {
    eprintln!("inventory: {e:#}");
    ExitCode::FAILURE
}

/// The read model's table (the application owns it, not vantage).
const SCHEMA_SQL: &str = "CREATE SCHEMA IF NOT EXISTS inventory; \
     CREATE TABLE IF NOT EXISTS inventory.levels ( \
       sku text NOT NULL, warehouse text NOT NULL, \
       on_hand bigint NOT NULL, received bigint NOT NULL, shipped bigint NOT NULL, \
       PRIMARY KEY (sku, warehouse))";

async fn create_read_model(database_url: &str) -> anyhow::Result<()> {
    let mut conn = PgConnection::connect(database_url).await?;
    sqlx::raw_sql(SCHEMA_SQL).execute(&mut conn).await?;
    conn.close().await?;
    Ok(())
}

/// What `--demo` found once the daemon had applied its events.
#[derive(Debug)]
struct DemoOutcome {
    /// (sku, warehouse, on_hand, received, shipped), by sku.
    levels: Vec<(String, String, i64, i64, i64)>,
    /// (global position, reason, error text) of the dead letters.
    dead_letters: Vec<(i64, String, String)>,
}

/// `--demo`: the daemon in-process, a few events (one with a zero quantity), then the read
/// model and the dead letter, and a graceful shutdown.
async fn demo(options: LoadOptions) -> anyhow::Result<DemoOutcome> {
    let settings = Settings::load(&options)?;
    let store = Store::connect(&StoreOptions::from_settings(&settings.database)).await?;
    let daemon = DaemonBuilder::new(settings)
        .store(store.clone())
        .without_http()
        .perspective(Typed(InventoryLevels::postgres()))
        .start()
        .await?;

    let events = [
        (
            "ItemReceived",
            r#"{"sku": "A-1", "warehouse": "north", "quantity": 10}"#,
        ),
        (
            "ItemShipped",
            r#"{"sku": "A-1", "warehouse": "north", "quantity": 3}"#,
        ),
        (
            "ItemReceived",
            r#"{"sku": "B-2", "warehouse": "south", "quantity": 5}"#,
        ),
        (
            "ItemShipped",
            r#"{"sku": "B-2", "warehouse": "south", "quantity": 0}"#,
        ),
    ];
    let events = events
        .iter()
        .map(|(event_type, data)| Ok(NewEvent::new(*event_type, serde_json::from_str(data)?)))
        .collect::<serde_json::Result<Vec<_>>>()?;
    store
        .append_events(uuid::Uuid::new_v4(), Some(0), &events)
        .await?;

    // Wait until nothing is left to apply (a service never needs to).
    for _ in 0..100 {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM wh_perspective_events")
            .fetch_one(store.pool())
            .await?;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let levels = sqlx::query_as(
        "SELECT sku, warehouse, on_hand, received, shipped FROM inventory.levels ORDER BY sku",
    )
    .fetch_all(store.pool())
    .await?;
    let dead_letters = store
        .open_dead_letters(Some("inventory_levels"))
        .await?
        .into_iter()
        .map(|d| {
            (
                d.global_position,
                d.failure_reason,
                d.error_text.unwrap_or_default(),
            )
        })
        .collect();
    daemon.shutdown().await?;
    Ok(DemoOutcome {
        levels,
        dead_letters,
    })
}

fn print_demo(outcome: &DemoOutcome) {
    println!("sku  warehouse  on_hand  received  shipped");
    for (sku, warehouse, on_hand, received, shipped) in &outcome.levels {
        println!("{sku:<4} {warehouse:<10} {on_hand:>7} {received:>9} {shipped:>8}");
    }
    for (position, reason, error) in &outcome.dead_letters {
        println!("dead-lettered at position {position} ({reason}): {error}");
    }
}

// ---- unit tests: the payloads, the logic, and the perspective on the memory store ---------------

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use vantage::perspective::{decode_event, NO_TRANSACTION};
    use vantage::testkit::TestKit;

    fn kit() -> (TestKit, MemoryLevels) {
        let (perspective, levels) = InventoryLevels::in_memory();
        (TestKit::new(Typed(perspective)), levels)
    }

    fn level(levels: &MemoryLevels, sku: &str, warehouse: &str) -> Level {
        levels.lock().unwrap()[&(sku.to_string(), warehouse.to_string())]
    }

    #[tokio::test]
    async fn levels_follow_receipts_and_shipments() {
        let (kit, levels) = kit();
        let stream = uuid::Uuid::new_v4();
        let data = |q: u32| json!({"sku": "A-1", "warehouse": "north", "quantity": q});
        kit.append(stream, "ItemReceived", data(10));
        kit.append(stream, "ItemShipped", data(3));
        kit.append(
            uuid::Uuid::new_v4(),
            "ItemShipped",
            json!({"sku": "B-2", "warehouse": "south", "quantity": 2}),
        );
        let report = kit.drain().await.unwrap();
        assert_eq!(report.applied, 3);
        assert_eq!(
            level(&levels, "A-1", "north"),
            Level {
                on_hand: 7,
                received: 10,
                shipped: 3
            }
        );
        assert_eq!(level(&levels, "B-2", "south").on_hand, -2);
        assert!(kit.work().is_empty());
    }

    #[tokio::test]
    async fn a_failed_apply_is_retried_after_its_backoff_and_its_stream_waits() {
        let (kit, levels) = kit();
        let stream = uuid::Uuid::new_v4();
        let data = |q: u32| json!({"sku": "A-1", "warehouse": "north", "quantity": q});
        let first = kit.append(stream, "ItemReceived", data(10));
        kit.append(stream, "ItemShipped", data(3));
        kit.fail(
            first.global_position,
            ApplyError::Retryable("warehouse system down".into()),
            1,
        );

        kit.drain().await.unwrap();
        assert!(
            levels.lock().unwrap().is_empty(),
            "the shipment waits behind the receipt"
        );
        let work = kit.work();
        assert_eq!(
            (work[0].failures, work[0].last_error.as_deref()),
            (1, Some("warehouse system down"))
        );

        kit.run_for(std::time::Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(level(&levels, "A-1", "north").on_hand, 7);
        let applied: Vec<i32> = kit.applied().iter().map(|a| a.attempts).collect();
        assert_eq!(
            applied,
            vec![2, 1],
            "the receipt on its second claim, then the shipment"
        );
    }

    #[tokio::test]
    async fn a_payload_that_does_not_deserialize_fails_permanently_with_serdes_error() {
        let (kit, levels) = kit();
        let stream = uuid::Uuid::new_v4();
        kit.append(
            stream,
            "ItemReceived",
            json!({"sku": "A-1", "warehouse": "north", "quantity": 0}),
        );
        kit.drain().await.unwrap();
        assert!(levels.lock().unwrap().is_empty());
        // On PostgreSQL it is dead-lettered at once (PermanentFailure); the memory store has no
        // dead letters, so the row stays, charged, with the error.
        let work = kit.work();
        assert_eq!(work[0].failures, 1);
        assert_eq!(
            work[0].last_error.as_deref(),
            Some(
                "payload of ItemReceived does not deserialize: quantity: \
                  invalid value: integer `0`, expected a nonzero u32"
            )
        );
    }

    #[tokio::test]
    async fn the_postgres_perspective_in_memory_fails_clearly_instead_of_writing_elsewhere() {
        let kit = TestKit::new(Typed(InventoryLevels::postgres()));
        kit.append(
            uuid::Uuid::new_v4(),
            "ItemReceived",
            json!({"sku": "A-1", "warehouse": "north", "quantity": 1}),
        );
        kit.drain().await.unwrap();
        assert_eq!(kit.work()[0].last_error.as_deref(), Some(NO_TRANSACTION));
    }

    fn received(sku: &str, quantity: u32) -> InventoryEvent {
        InventoryEvent::ItemReceived {
            sku: sku.into(),
            warehouse: "north".into(),
            quantity: NonZeroU32::new(quantity).unwrap(),
        }
    }

    #[test]
    fn stored_payloads_decode_by_event_type() {
        let data = json!({"sku": "A-1", "warehouse": "north", "quantity": 10});
        let event: InventoryEvent = decode_event("ItemReceived", &data).unwrap();
        assert_eq!(event, received("A-1", 10));
        let event: InventoryEvent = decode_event("ItemShipped", &data).unwrap();
        assert!(matches!(event, InventoryEvent::ItemShipped { .. }));
    }

    #[test]
    fn a_zero_quantity_is_refused_with_the_field_named() {
        let data = json!({"sku": "A-1", "warehouse": "north", "quantity": 0});
        let err = decode_event::<InventoryEvent>("ItemShipped", &data).unwrap_err();
        assert_eq!(
            err.to_string(),
            "payload of ItemShipped does not deserialize: quantity: \
             invalid value: integer `0`, expected a nonzero u32"
        );
    }

    #[test]
    fn a_missing_field_is_refused() {
        let data = json!({"sku": "A-1", "quantity": 1});
        let err = decode_event::<InventoryEvent>("ItemReceived", &data).unwrap_err();
        assert!(
            err.to_string().contains("missing field `warehouse`"),
            "{err}"
        );
    }

    #[test]
    fn a_receipt_adds_to_on_hand_and_received() {
        let event = received("A-1", 10);
        assert_eq!(
            StockChange::of(&event),
            StockChange {
                sku: "A-1",
                warehouse: "north",
                on_hand: 10,
                received: 10,
                shipped: 0
            }
        );
    }

    #[test]
    fn a_shipment_takes_from_on_hand_and_adds_to_shipped() {
        let event = InventoryEvent::ItemShipped {
            sku: "A-1".into(),
            warehouse: "south".into(),
            quantity: NonZeroU32::new(4).unwrap(),
        };
        let change = StockChange::of(&event);
        assert_eq!(
            (change.on_hand, change.received, change.shipped),
            (-4, 0, 4)
        );
        assert_eq!(change.warehouse, "south");
    }

    #[tokio::test]
    async fn without_a_database_apply_fails_clearly_instead_of_writing_elsewhere() {
        let envelope = TypedEnvelope {
            event_work_id: uuid::Uuid::new_v4(),
            perspective_name: "inventory_levels".into(),
            event_id: uuid::Uuid::new_v4(),
            stream_id: uuid::Uuid::new_v4(),
            stream_version: 1,
            global_position: 1,
            event_type: "ItemReceived".into(),
            data: received("A-1", 1),
            metadata: json!({}),
            attempts: 1,
            failures: 0,
            replay: false,
        };
        let err = InventoryLevels::postgres()
            .apply(&envelope, &mut ApplyTx::none())
            .await
            .unwrap_err();
        assert_eq!(err, ApplyError::Permanent(NO_TRANSACTION.into()));
    }

    /// The same perspective on PostgreSQL, as `--demo` runs it: a throwaway server (or
    /// DATABASE_URL), the daemon in-process, the levels in `inventory.levels`, and the zero
    /// quantity dead-lettered at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_same_perspective_runs_on_postgresql() {
        let (url, _server) = match std::env::var("DATABASE_URL") {
            Ok(url) => (url, None),
            Err(_) => {
                let server = tokio::task::spawn_blocking(ThrowawayPostgres::start)
                    .await
                    .unwrap()
                    .expect("a throwaway PostgreSQL (see the README: the server package)");
                (server.url(), Some(server))
            }
        };
        // A database of its own, so a shared DATABASE_URL keeps nothing of this run.
        let name = format!(
            "inventory_example_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let mut admin = PgConnection::connect(&url).await.unwrap();
        sqlx::raw_sql(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await
            .unwrap();
        let db_url = match url.rsplit_once('/') {
            Some((server, _)) if !server.ends_with('/') => format!("{server}/{name}"),
            _ => format!("{url}/{name}"),
        };
        create_read_model(&db_url).await.unwrap();
        let outcome = demo(LoadOptions {
            database_url: Some(db_url),
            ..LoadOptions::default()
        })
        .await
        .unwrap();
        sqlx::raw_sql(&format!("DROP DATABASE {name} WITH (FORCE)"))
            .execute(&mut admin)
            .await
            .unwrap();
        assert_eq!(
            outcome.levels,
            vec![
                ("A-1".into(), "north".into(), 7, 10, 3),
                ("B-2".into(), "south".into(), 5, 5, 0),
            ]
        );
        assert_eq!(
            outcome.dead_letters,
            vec![(
                4,
                "PermanentFailure".into(),
                "payload of ItemShipped does not deserialize: quantity: \
                 invalid value: integer `0`, expected a nonzero u32"
                    .into()
            )]
        );
    }
}
