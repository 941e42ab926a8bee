//! The demo's last act: changing a read model without downtime (docs/versions.md).
//!
//! `order_status` (readers query `demo.order_status`) is a versioned perspective the demo runs
//! with daemons of its own, as a deploy would: a daemon configured for version 1 builds it from
//! the orders so far; then, while a support desk keeps adding notes to orders, a daemon
//! configured for version 2 (a new column: how many notes an order has) builds version 2
//! beside it; the demo cuts over, the version-1 daemon goes away, and the new column is there
//! under the same name. The rollback command is printed. Notes are events of their own type on
//! streams of their own, so the other perspectives and the orders' streams are untouched.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::cli_hint::CliHint;
use super::config::DemoConfig;
use crate::cli::{exit, output};
use crate::config::{PerspectiveSettings, Settings};
use crate::daemon::{DaemonBuilder, RunningDaemon};
use crate::store::{NewEvent, Store, Switch};

const NAME: &str = "order_status";
const ORDER_TYPES: &[&str] = &[
    "OrderPlaced",
    "OrderPaid",
    "OrderShipped",
    "OrderDelivered",
    "OrderCancelled",
];
/// Notes added while version 2 is built.
const NOTE: &str = "OrderNoteAdded";

/// One version of `order_status`: v1 keeps each order's status; v2 also counts its notes.
fn perspective(version: u32) -> PerspectiveSettings {
    let status = "INSERT INTO order_status (order_id, status) \
                  VALUES (($1->>'order_id')::uuid, lower(substr($4, 6))) \
                  ON CONFLICT (order_id) DO UPDATE SET status = EXCLUDED.status";
    let mut sql: std::collections::BTreeMap<String, String> = ORDER_TYPES
        .iter()
        .map(|t| (t.to_string(), status.to_owned()))
        .collect();
    let mut events: Vec<String> = ORDER_TYPES.iter().map(|t| t.to_string()).collect();
    let setup = if version == 1 {
        "CREATE TABLE order_status (order_id uuid PRIMARY KEY, status text NOT NULL)"
    } else {
        events.push(NOTE.into());
        sql.insert(
            NOTE.into(),
            "UPDATE order_status SET notes = notes + 1 WHERE order_id = ($1->>'order_id')::uuid"
                .into(),
        );
        "CREATE TABLE order_status (order_id uuid PRIMARY KEY, status text NOT NULL, \
         notes int NOT NULL DEFAULT 0)"
    };
    PerspectiveSettings {
        name: NAME.into(),
        events,
        sql,
        version,
        read_schema: Some("demo".into()),
        tables: vec![NAME.into()],
        setup: Some(setup.into()),
        ..Default::default()
    }
}

fn settings(demo: &DemoConfig, version: u32) -> Settings {
    let mut s = demo.settings.clone();
    s.perspectives = vec![perspective(version)];
    s.worker.consumers = 1;
    s
}

async fn start(
    demo: &DemoConfig,
    store: &Store,
    version: u32,
    interrupt: &CancellationToken,
) -> Result<RunningDaemon, i32> {
    DaemonBuilder::new(settings(demo, version))
        .store(store.clone())
        .without_http()
        // (a child: shutting this daemon down must not cancel the demo's own token)
        .shutdown_on(interrupt.child_token())
        .start()
        .await
        .map_err(|e| {
            eprintln!("vantage demo: the {NAME} v{version} daemon could not start: {e}");
            e.exit_code()
        })
}

/// Polls until `done` says so (every 100 ms, at most `limit`); false when interrupted or late.
async fn wait(
    store: &Store,
    interrupt: &CancellationToken,
    limit: Duration,
    done: impl Fn(&[crate::store::VersionStatus]) -> bool,
) -> bool {
    let started = Instant::now();
    while started.elapsed() < limit && !interrupt.is_cancelled() {
        match store.version_status(NAME).await {
            Ok(v) if done(&v) => return true,
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "demo: reading {NAME}'s versions failed"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

fn is(v: &[crate::store::VersionStatus], version: i32, states: &[&str]) -> bool {
    v.iter()
        .any(|s| s.version == version && states.contains(&s.state.as_str()))
}

/// Runs the act; returns the daemon that keeps `order_status` current (version 2's, which
/// applies both versions), or the exit code.
pub(super) async fn change_a_read_model(
    demo: &DemoConfig,
    store: &Store,
    interrupt: &CancellationToken,
    timeout: Duration,
) -> Result<RunningDaemon, i32> {
    eprintln!();
    eprintln!(
        "Changing a read model without downtime: {NAME} (readers query demo.{NAME}) is built as \
         version 1 from the orders so far; then version 2 adds a column while notes keep coming."
    );
    let started = Instant::now();
    let v1 = start(demo, store, 1, interrupt).await?;
    if !wait(store, interrupt, timeout, |v| is(v, 1, &["live", "ready"])).await {
        eprintln!("vantage demo: {NAME} version 1 was not built within {timeout:?}");
        let _ = v1.shutdown().await;
        return Err(exit::FAILURE);
    }
    eprintln!(
        "Version 1 is live ({:.1}s): built from history in short batches.",
        started.elapsed().as_secs_f64()
    );

    // The support desk adds notes to orders while version 2 is built.
    let orders: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT stream_id FROM wh_event_store WHERE event_type = 'OrderPlaced' \
         ORDER BY global_position LIMIT 50",
    )
    .fetch_all(store.pool())
    .await
    .unwrap_or_default();
    let notes = {
        let store = store.clone();
        let stop = interrupt.child_token();
        let guard = stop.clone().drop_guard();
        let task = tokio::spawn(async move {
            let mut n = 0u64;
            for order in orders.iter().cycle().take(200) {
                if stop.is_cancelled() {
                    break;
                }
                let event = NewEvent::new(
                    NOTE,
                    serde_json::json!({"order_id": order, "note": "customer called"}),
                );
                if store
                    .append_events(uuid::Uuid::new_v4(), Some(0), &[event])
                    .await
                    .is_ok()
                {
                    n += 1;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            n
        });
        (task, guard)
    };

    let started = Instant::now();
    let v2 = match start(demo, store, 2, interrupt).await {
        Ok(d) => d,
        Err(code) => {
            let _ = v1.shutdown().await;
            return Err(code);
        }
    };
    let built = wait(store, interrupt, timeout, |v| is(v, 2, &["ready", "live"])).await;
    let (task, guard) = notes;
    drop(guard);
    let noted = task.await.unwrap_or(0);
    if !built {
        eprintln!("vantage demo: {NAME} version 2 was not built within {timeout:?}");
        let _ = v1.shutdown().await;
        let _ = v2.shutdown().await;
        return Err(exit::FAILURE);
    }
    eprintln!(
        "Version 2 is ready beside it ({:.1}s), with {noted} notes added meanwhile.",
        started.elapsed().as_secs_f64()
    );

    let cut = Instant::now();
    let outcome = loop {
        match store
            .switch_version(NAME, Switch::Cutover, Some(2), "vantage demo")
            .await
        {
            Ok(o) if o.outcome == "behind_live" && cut.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok(o) => break o.outcome,
            Err(e) => {
                eprintln!("vantage demo: the cutover failed: {e}");
                let _ = v1.shutdown().await;
                let _ = v2.shutdown().await;
                return Err(exit::FAILURE);
            }
        }
    };
    match outcome.as_str() {
        "done" => eprintln!(
            "Cut over in one transaction: demo.{NAME} is version 2 now (readers never saw an \
             error or a mix)."
        ),
        "live" => eprintln!("Version 2 was already live (an earlier run of the demo)."),
        other => {
            eprintln!("vantage demo: the cutover was refused ({other})");
            let _ = v1.shutdown().await;
            let _ = v2.shutdown().await;
            return Err(exit::FAILURE);
        }
    }
    // The version-1 daemon goes away, as in a rolling deploy; version 2's keeps both current.
    if let Err(e) = v1.shutdown().await {
        eprintln!("vantage demo: the v1 daemon's shutdown: {e}");
    }
    let caught_up = wait(store, interrupt, timeout, |v| {
        v.iter()
            .filter(|s| s.state != "retired")
            .all(|s| s.behind == 0)
    })
    .await;
    if !caught_up {
        eprintln!("vantage demo: {NAME} did not catch up within {timeout:?}");
        let _ = v2.shutdown().await;
        return Err(exit::FAILURE);
    }
    report(demo, store).await;
    Ok(v2)
}

async fn report(demo: &DemoConfig, store: &Store) {
    let rows: Vec<(uuid::Uuid, String, i32)> = sqlx::query_as(
        "SELECT order_id, status, notes FROM demo.order_status ORDER BY notes DESC, order_id LIMIT 3",
    )
    .fetch_all(store.pool())
    .await
    .unwrap_or_default();
    let mut t = output::table(&["Order", "Status", "Notes (new in v2)"]);
    for (order, status, notes) in rows {
        t.add_row(vec![
            order.to_string()[..8].to_owned(),
            status,
            notes.to_string(),
        ]);
    }
    let hint = CliHint::new(demo);
    println!();
    println!("Changed a read model without downtime: demo.{NAME}, version 2");
    println!("{t}");
    println!("Its versions, and the way back (version 1 stays current until it is retired):");
    println!(
        "  {}",
        hint.command(&format!("perspectives versions {NAME}"))
    );
    println!(
        "  {}",
        hint.command(&format!("perspectives rollback {NAME} --yes"))
    );
}
