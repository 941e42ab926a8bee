//! Versioned perspectives (docs/versions.md) through the binary's `perspectives versions |
//! cutover | rollback | retire` and in-process daemons sharing one database: a new version is
//! built beside the live one while a producer appends, cutover and rollback swap what readers
//! see in one transaction (a reader polling every 20 ms never gets an error or a smaller
//! answer than before), and a changed definition under a registered version stops the start.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sqlx::{Connection, PgConnection};
use uuid::Uuid;
use vantage::config::Settings;
use vantage::daemon::{DaemonBuilder, DaemonError, RunningDaemon};

use crate::support::{self, Env};

/// Version 1: orders and their status.
fn v1() -> String {
    r#"
[[perspectives]]
name = "orders"
read_schema = "rm"
tables = ["orders"]
setup = "CREATE TABLE orders (order_id uuid PRIMARY KEY, total int NOT NULL, status text NOT NULL)"
events = ["Placed", "Shipped"]
[perspectives.sql]
Placed = "INSERT INTO orders (order_id, total, status) VALUES ($2, ($1->>'total')::int, 'placed')"
Shipped = "UPDATE orders SET status = 'shipped' WHERE order_id = $2"
"#
    .to_owned()
}

/// Version 2: the same, plus the position it shipped at (a new column).
fn v2() -> String {
    v1().replace("name = \"orders\"", "name = \"orders\"\nversion = 2")
        .replace(
            "status text NOT NULL)",
            "status text NOT NULL, shipped_at bigint)",
        )
        .replace(
            "SET status = 'shipped'",
            "SET status = 'shipped', shipped_at = $5",
        )
}

/// This file's own helpers on the shared [`Env`].
impl Env {
    async fn versioned_daemon(&self, perspectives: &str) -> Result<RunningDaemon, DaemonError> {
        let toml = support::fast_daemon_toml(&self.url, perspectives);
        DaemonBuilder::new(Settings::from_toml_str(&toml).unwrap())
            .store(self.store.clone())
            .without_http()
            .start()
            .await
    }

    async fn place_and_ship(&self, order: Uuid, total: i64) {
        self.append(
            order,
            &[
                ("Placed", serde_json::json!({"total": total})),
                ("Shipped", serde_json::json!({})),
            ],
        )
        .await;
    }

    async fn state_of(&self, version: i32) -> String {
        sqlx::query_scalar(
            "SELECT state FROM wh_perspective_versions WHERE perspective_name = 'orders' AND version = $1",
        )
        .bind(version)
        .fetch_optional(self.store.pool())
        .await
        .unwrap()
        .unwrap_or_default()
    }

    async fn wait_for_state(&self, version: i32, state: &str) {
        let started = std::time::Instant::now();
        while self.state_of(version).await != state {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "version {version} never became {state} (it is {})",
                self.state_of(version).await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A reader of `rm.orders` on its own connection, every 20 ms, until told to stop: counts the
/// errors it got and the times it saw fewer orders than the time before.
struct Reader {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<(u64, u64, u64)>,
}

impl Reader {
    async fn start(url: &str) -> Reader {
        let mut conn = PgConnection::connect(url).await.unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let (mut reads, mut errors, mut backwards, mut last) = (0u64, 0u64, 0u64, 0i64);
            while !done.load(Ordering::Relaxed) {
                match sqlx::query_scalar::<_, i64>("SELECT count(*) FROM rm.orders")
                    .fetch_one(&mut conn)
                    .await
                {
                    Ok(n) => {
                        reads += 1;
                        if n < last {
                            backwards += 1;
                        }
                        last = n;
                    }
                    Err(e) => {
                        eprintln!("reader: {e}");
                        errors += 1;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (reads, errors, backwards)
        });
        Reader { stop, task }
    }

    async fn finish(self) -> (u64, u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_version_is_built_beside_the_live_one_and_readers_never_see_an_error_or_a_step_back()
{
    let mut env = Env::migrated().await;
    env.set_config(&support::fast_daemon_toml(&env.url, &v2()));
    for i in 0..300 {
        env.place_and_ship(Uuid::new_v4(), i).await;
    }
    let old = env.versioned_daemon(&v1()).await.expect("v1 daemon starts");
    env.wait_for_state(1, "live").await;
    env.wait_until(
        "SELECT count(*) FROM rm.orders",
        300,
        Duration::from_secs(60),
    )
    .await;
    let reader = Reader::start(&env.url).await;

    // A producer keeps appending throughout.
    let placed = Arc::new(AtomicI64::new(300));
    let stop_producer = Arc::new(AtomicBool::new(false));
    let producer = {
        let store = env.store.clone();
        let (placed, stop) = (Arc::clone(&placed), Arc::clone(&stop_producer));
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let events = [
                    vantage::store::NewEvent::new("Placed", serde_json::json!({"total": 1})),
                    vantage::store::NewEvent::new("Shipped", serde_json::json!({})),
                ];
                store
                    .append_events(Uuid::new_v4(), None, &events)
                    .await
                    .unwrap();
                placed.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };

    // A daemon configured for version 2 builds it and keeps version 1 current too.
    let new = env.versioned_daemon(&v2()).await.expect("v2 daemon starts");
    env.wait_for_state(2, "ready").await;
    let run = env
        .run(&["perspectives", "versions", "orders", "--json"])
        .await;
    assert_eq!(run.code, 0, "{run:?}");
    let versions = run.json()["data"]["versions"].clone();
    assert_eq!(versions[0]["version"], 1, "{versions}");
    assert_eq!(versions[0]["state"], "live", "{versions}");
    assert_eq!(versions[0]["live"], true, "{versions}");
    assert_eq!(versions[1]["state"], "ready", "{versions}");
    assert!(versions[1]["behind"].is_i64(), "{versions}");

    // Version 1's daemon goes away (a rolling deploy): the v2 daemon keeps both current.
    old.shutdown().await.unwrap();

    let run = env
        .run(&["perspectives", "cutover", "orders", "--yes", "--json"])
        .await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(run.json()["data"]["to_version"], 2, "{run:?}");
    assert_eq!(env.state_of(2).await, "live");
    assert_eq!(env.state_of(1).await, "ready");
    // Readers see version 2's new column through the stable name.
    env.scalar("SELECT count(shipped_at) FROM rm.orders").await;

    let run = env
        .run(&["perspectives", "rollback", "orders", "--yes", "--json"])
        .await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(run.json()["data"]["to_version"], 1, "{run:?}");
    let run = env
        .run(&["perspectives", "cutover", "orders", "--to", "2", "--yes"])
        .await;
    assert_eq!(run.code, 0, "{run:?}");

    stop_producer.store(true, Ordering::Relaxed);
    producer.await.unwrap();
    let total = placed.load(Ordering::Relaxed);
    // Both versions applied every event exactly once (primary keys refuse a second insert).
    for schema in ["orders_v1", "orders_v2"] {
        env.wait_until(
            &format!("SELECT count(*) FROM {schema}.orders WHERE status = 'shipped'"),
            total,
            Duration::from_secs(60),
        )
        .await;
    }
    assert_eq!(
        env.scalar("SELECT count(*) FROM rm.orders WHERE shipped_at IS NULL")
            .await,
        0
    );
    let (reads, errors, backwards) = reader.finish().await;
    assert!(reads > 10, "the reader read {reads} times");
    assert_eq!((errors, backwards), (0, 0), "reads: {reads}");

    // The live version cannot be retired; the other can, and its schema goes.
    let run = env
        .run(&[
            "perspectives",
            "retire",
            "orders",
            "--version",
            "2",
            "--yes",
        ])
        .await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("is live"), "{run:?}");
    let run = env
        .run(&[
            "perspectives",
            "retire",
            "orders",
            "--version",
            "1",
            "--yes",
        ])
        .await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(
        env.scalar("SELECT count(*) FROM pg_namespace WHERE nspname = 'orders_v1'")
            .await,
        0
    );
    let run = env
        .run(&["perspectives", "rollback", "orders", "--yes"])
        .await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("retired"), "{run:?}");
    // Who did what, in order.
    let kinds: Vec<String> = sqlx::query_scalar(
        "SELECT kind FROM wh_perspective_version_history WHERE perspective_name = 'orders' ORDER BY history_id",
    )
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    assert_eq!(
        kinds,
        [
            "Registered",
            "Live",
            "Registered",
            "Cutover",
            "Rollback",
            "Cutover",
            "Retired"
        ]
    );
    let rewrite = sqlx::query("UPDATE wh_perspective_version_history SET actor = 'someone else'")
        .execute(env.store.pool())
        .await
        .unwrap_err();
    assert!(rewrite.to_string().contains("append-only"), "{rewrite}");
    new.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_changed_definition_under_a_registered_version_stops_the_start_naming_the_perspective() {
    let mut env = Env::migrated().await;
    env.set_config(&support::fast_daemon_toml(&env.url, ""));
    let daemon = env.versioned_daemon(&v1()).await.expect("v1 daemon starts");
    daemon.shutdown().await.unwrap();
    let changed = v1().replace("'placed'", "'new'");
    match env.versioned_daemon(&changed).await {
        Err(DaemonError::Config(message)) => {
            assert!(
                message.contains("perspectives[0]")
                    && message.contains("\"orders\" version 1")
                    && message.contains("statement set")
                    && message.contains("needs a new version"),
                "{message}"
            );
        }
        Err(other) => panic!("another error: {other}"),
        Ok(d) => {
            d.shutdown().await.unwrap();
            panic!("a changed definition started");
        }
    }
    // With a new version number it starts, and builds the new version.
    let bumped = changed.replace("name = \"orders\"", "name = \"orders\"\nversion = 2");
    let daemon = env.versioned_daemon(&bumped).await.expect("v2 starts");
    env.wait_for_state(2, "ready").await;
    daemon.shutdown().await.unwrap();

    // A daemon configured for version 1 keeps version 2 current too (its definition is in the
    // database) unless it is paused: then version 1 applies a new order that readers would
    // see vanish if version 2 went live, so the cutover is refused, saying why.
    let run = env.run(&["perspectives", "pause", "orders@v2"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    let v1_only = env.versioned_daemon(&v1()).await.expect("v1 starts again");
    let order = Uuid::new_v4();
    env.place_and_ship(order, 7).await;
    env.wait_until(
        &format!("SELECT count(*) FROM orders_v1.orders WHERE order_id = '{order}' AND status = 'shipped'"),
        1,
        Duration::from_secs(60),
    )
    .await;
    let run = env
        .run(&[
            "perspectives",
            "cutover",
            "orders",
            "--wait",
            "200ms",
            "--yes",
        ])
        .await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(
        run.stderr
            .contains("version 2 of 'orders' is 2 event(s) behind the live version 1"),
        "{run:?}"
    );
    assert_eq!(env.state_of(1).await, "live");
    v1_only.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_version_whose_statement_does_not_prepare_in_its_schema_is_not_registered() {
    let env = Env::migrated().await;
    let broken = v1().replace("UPDATE orders SET", "UPDATE no_such_table SET");
    match env.versioned_daemon(&broken).await {
        Err(DaemonError::Config(message)) => {
            assert!(
                message.contains("perspectives[0]") && message.contains("no_such_table"),
                "{message}"
            );
        }
        Err(other) => panic!("another error: {other}"),
        Ok(d) => {
            d.shutdown().await.unwrap();
            panic!("a broken statement started");
        }
    }
    // Nothing of it is left: no schema, no registry row, no version.
    assert_eq!(
        env.scalar(
            "SELECT (SELECT count(*) FROM pg_namespace WHERE nspname = 'orders_v1') \
                  + (SELECT count(*) FROM wh_perspectives) \
                  + (SELECT count(*) FROM wh_perspective_versions)"
        )
        .await,
        0
    );
}

/// The views of `rm` and the live version agree: every view reads the live version's schema.
async fn views_point_at_the_live_version(env: &Env) -> i32 {
    let live: i32 = sqlx::query_scalar(
        "SELECT version FROM wh_perspective_versions WHERE perspective_name = 'orders' AND state = 'live'",
    )
    .fetch_one(env.store.pool())
    .await
    .expect("exactly one live version");
    let reads: String = sqlx::query_scalar(
        "SELECT string_agg(DISTINCT table_schema, ',') FROM information_schema.view_table_usage \
         WHERE view_schema = 'rm' AND view_name = 'orders'",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    assert_eq!(reads, format!("orders_v{live}"));
    live
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cutover_killed_mid_transaction_leaves_one_version_wholly_live() {
    let mut env = Env::migrated().await;
    env.set_config(&support::fast_daemon_toml(&env.url, &v2()));
    env.place_and_ship(Uuid::new_v4(), 1).await;
    let d1 = env.versioned_daemon(&v1()).await.expect("v1 starts");
    env.wait_for_state(1, "live").await;
    let d2 = env.versioned_daemon(&v2()).await.expect("v2 starts");
    env.wait_for_state(2, "ready").await;
    d1.shutdown().await.unwrap();
    d2.shutdown().await.unwrap();

    // A batch of version 1 is in flight (its apply holds the version's fence): the cutover
    // waits inside its transaction.
    let mut writer = PgConnection::connect(&env.url).await.unwrap();
    sqlx::raw_sql(
        "BEGIN; SELECT orders_v1.vantage_apply('{}', gen_random_uuid(), gen_random_uuid(), \
         'Shipped', 0, 2, '{}')",
    )
    .execute(&mut writer)
    .await
    .unwrap();
    let mut cutover = env.command(&["perspectives", "cutover", "orders", "--yes"]);
    cutover
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut child = cutover.spawn().unwrap();
    env.wait_until(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
         AND query LIKE '%switch_perspective_version%'",
        1,
        Duration::from_secs(30),
    )
    .await;
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    assert_eq!(views_point_at_the_live_version(&env).await, 1);
    // The writer ends: the orphaned cutover either ran to its end or was rolled back; either
    // way one version is wholly live.
    sqlx::raw_sql("COMMIT").execute(&mut writer).await.unwrap();
    env.wait_until(
        "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%switch_perspective_version%' \
         AND state = 'active' AND pid <> pg_backend_pid()",
        0,
        Duration::from_secs(30),
    )
    .await;
    let live = views_point_at_the_live_version(&env).await;
    assert!(live == 1 || live == 2, "{live}");
    let readers = env.scalar("SELECT count(*) FROM rm.orders").await;
    assert_eq!(readers, 1);
    // And the next cutover gets it to version 2 (or finds it there).
    let run = env
        .run(&["perspectives", "cutover", "orders", "--yes"])
        .await;
    assert!(
        run.code == 0 || (run.code == 2 && run.stderr.contains("already live")),
        "{run:?}"
    );
    assert_eq!(views_point_at_the_live_version(&env).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_in_the_history_is_dead_lettered_and_never_wedges_the_backfill() {
    let mut env = Env::migrated().await;
    // Version 2 refuses an order of total 13 (a historical event version 1 took).
    let v2_strict = v2().replace(
        "status text NOT NULL, shipped_at bigint)",
        "status text NOT NULL, shipped_at bigint, CHECK (total <> 13))",
    );
    env.set_config(&support::fast_daemon_toml(&env.url, &v2_strict));
    let poison = Uuid::new_v4();
    for i in 0..200 {
        let order = if i == 100 { poison } else { Uuid::new_v4() };
        env.place_and_ship(order, if i == 100 { 13 } else { 100 + i })
            .await;
    }
    let old = env.versioned_daemon(&v1()).await.expect("v1 starts");
    env.wait_for_state(1, "live").await;
    old.shutdown().await.unwrap();

    let new = env.versioned_daemon(&v2_strict).await.expect("v2 starts");
    // The backfill finishes; the poison event goes through the drain as for any perspective:
    // retried, then dead-lettered in version 2 only, and its stream's later event follows it.
    env.wait_for_state(2, "ready").await;
    env.wait_until(
        &format!(
            "SELECT count(*) FROM wh_dead_letters WHERE perspective_name = 'orders@v2' \
             AND stream_id = '{poison}' AND stream_version = 1 AND attempts_when_dlq = 11"
        ),
        1,
        Duration::from_secs(60),
    )
    .await;
    env.wait_until(
        "SELECT count(*) FROM orders_v2.orders WHERE status = 'shipped' AND shipped_at IS NOT NULL",
        199,
        Duration::from_secs(60),
    )
    .await;
    env.wait_until(
        "SELECT count(*) FROM wh_perspective_events WHERE perspective_name = 'orders@v2'",
        0,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(
        env.scalar("SELECT count(*) FROM wh_dead_letters WHERE perspective_name <> 'orders@v2'")
            .await,
        0
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM orders_v1.orders").await,
        200
    );
    // Caught up: the cutover goes through (the dead letter is the operator's to triage).
    let run = env
        .run(&["perspectives", "cutover", "orders", "--yes"])
        .await;
    assert_eq!(run.code, 0, "{run:?}");
    new.shutdown().await.unwrap();
}

#[tokio::test]
async fn events_behind_a_diverted_one_in_their_stream_are_diverted_too_so_stream_order_holds() {
    let env = Env::migrated().await;
    let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    env.append(a, &[("Placed", serde_json::json!({"total": 1}))])
        .await;
    env.append(b, &[("Placed", serde_json::json!({"total": 2}))])
        .await;
    env.append(c, &[("Placed", serde_json::json!({"total": 3}))])
        .await;
    env.append(a, &[("Shipped", serde_json::json!({}))]).await;
    sqlx::query(
        "SELECT register_perspective_version('orders', 1, 'rm', ARRAY['orders'], \
         ARRAY['Placed', 'Shipped'], $1, $2)",
    )
    .bind(serde_json::json!({
        "Placed": "INSERT INTO orders (order_id, total, status) VALUES ($2, ($1->>'total')::int, 'placed')",
        "Shipped": "UPDATE orders SET status = 'shipped' WHERE order_id = $2",
    }))
    .bind("CREATE TABLE orders (order_id uuid PRIMARY KEY, total int NOT NULL, status text NOT NULL)")
    .execute(env.store.pool())
    .await
    .unwrap();
    let step = |max: i32, divert: bool| {
        let pool = env.store.pool().clone();
        async move {
            loop {
                let (outcome, applied, diverted): (String, i32, i32) = sqlx::query_as(
                    "SELECT outcome, applied, diverted FROM backfill_perspective_version('orders', 1, $1, $2)",
                )
                .bind(max)
                .bind(divert)
                .fetch_one(&pool)
                .await
                .unwrap();
                if outcome != "waiting" {
                    return (outcome, applied, diverted);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    // The first two events (a and b placed) are diverted, as after a failed batch.
    assert_eq!(step(2, true).await, ("applied".to_owned(), 0, 2));
    // The next batch: c's order is applied directly; a's shipment waits behind a's diverted
    // order, as a work row too, so the drain applies a's events in their order.
    assert_eq!(step(2, false).await, ("applied".to_owned(), 1, 1));
    let rows: Vec<i32> = sqlx::query_scalar(
        "SELECT w.global_position::int FROM wh_perspective_events w \
         WHERE w.perspective_name = 'orders@v1' ORDER BY 1",
    )
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    assert_eq!(rows, [1, 2, 4]);
    assert_eq!(
        env.scalar(&format!(
            "SELECT count(*) FROM orders_v1.orders WHERE order_id = '{c}'"
        ))
        .await,
        1
    );
    assert_eq!(env.scalar("SELECT count(*) FROM orders_v1.orders").await, 1);
    assert_eq!(step(2, false).await, ("live".to_owned(), 0, 0));
}

/// What a building version is behind is read at every metrics sample and console refresh: it
/// must not scan the history (a long read of a big event store pins the vacuum horizon, and the
/// console's statement timeout would cut it).
#[tokio::test]
async fn what_a_building_version_is_behind_is_known_without_reading_the_history() {
    let env = Env::migrated().await;
    sqlx::query(
        "INSERT INTO wh_event_store (stream_id, stream_version, event_type, event_data) \
         SELECT gen_random_uuid(), 1, 'Placed', '{\"total\": 1}' FROM generate_series(1, 2000)",
    )
    .execute(env.store.pool())
    .await
    .unwrap();
    sqlx::query(
        "SELECT register_perspective_version('orders', 1, 'rm', ARRAY['orders'], \
         ARRAY['Placed'], $1, 'CREATE TABLE orders (order_id uuid PRIMARY KEY)')",
    )
    .bind(serde_json::json!({"Placed": "INSERT INTO orders (order_id) VALUES ($2)"}))
    .execute(env.store.pool())
    .await
    .unwrap();
    let mut tx = env.store.pool().begin().await.unwrap();
    let behind: i64 = sqlx::query_scalar("SELECT wh_version_behind('orders', 1)")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let read: i64 = sqlx::query_scalar(
        "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) \
         FROM pg_stat_xact_user_tables WHERE relname = 'wh_event_store'",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(behind, 2000);
    assert!(read <= 10, "it read {read} rows of the event store");
}
