//! The one world every integration test starts from: [`Env`], a fresh database with vantage's
//! schema, a store on it, a directory for the configuration file, and an instance id that plays
//! the daemon; with the fixtures the CLI and console tests share ([`seeded`]).

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};
use uuid::Uuid;
use vantage::internals::store::{InstanceInfo, MoveOutcome, StoreInternals as _};
use vantage::store::{AppendedEvent, InstanceId, NewEvent, Store, StoreOptions};

use super::database::{fresh_database, TestDatabase};

/// The configuration every test uses: two SQL perspectives. `audit` inserts a row per apply
/// (no idempotence), so double applies are visible. It is registered for `*` (see
/// [`Env::with_extra_config`]) but configured for `OrderPlaced` only, so its `OrderShipped` work
/// has no statement here (a subscription to `*` would need a `"*"` statement).
const PERSPECTIVES_TOML: &str = r#"
[[perspectives]]
name = "order_summary"
events = ["OrderPlaced", "OrderShipped"]
reset = "TRUNCATE public.order_summary"
[perspectives.sql]
OrderPlaced = "INSERT INTO public.order_summary (order_id, total, status) VALUES (($1->>'order_id')::uuid, ($1->>'total')::numeric, 'placed') ON CONFLICT (order_id) DO NOTHING"
OrderShipped = "UPDATE public.order_summary SET status = 'shipped' WHERE order_id = ($1->>'order_id')::uuid"

[[perspectives]]
name = "audit"
events = ["OrderPlaced"]
[perspectives.sql]
OrderPlaced = "INSERT INTO public.audit_log (event_id, global_position) VALUES ($3, $5)"
"#;

const READ_MODELS_SQL: &str = "
CREATE TABLE public.order_summary (order_id uuid PRIMARY KEY, total numeric NOT NULL, status text NOT NULL);
CREATE TABLE public.audit_log (event_id uuid NOT NULL, global_position bigint NOT NULL);
";

/// A test's world. `store` is declared first so its pool is dropped before the database.
pub struct Env {
    /// A store on the database, migrated.
    pub store: Store,
    /// The database (dropped with this value).
    pub db: TestDatabase,
    /// Its URL.
    pub url: String,
    /// A directory of the test's own, the working directory of the commands it runs.
    pub dir: tempfile::TempDir,
    /// Where the configuration file is: `<dir>/vantage.toml`, written by [`Env::new`],
    /// [`Env::with_extra_config`] and [`Env::set_config`].
    pub config: PathBuf,
    /// The text of that file (empty until one of those writes it).
    pub toml: String,
    /// The instance that plays the daemon: registered (live) by [`Env::new`] and
    /// [`Env::with_extra_config`], only an id otherwise.
    pub instance: InstanceId,
}

impl Env {
    /// A fresh database with vantage's schema migrated (into `vantage`), and a store on it.
    pub async fn migrated() -> Env {
        Self::in_schema("vantage").await
    }

    /// [`migrated`](Self::migrated), with vantage's objects in `schema`.
    pub async fn in_schema(schema: &str) -> Env {
        let db = fresh_database().await;
        let mut options = StoreOptions::for_url(&db.url);
        options.schema = schema.to_owned();
        let store = Store::connect(&options)
            .await
            .expect("connect to the test database");
        store.migrate().await.expect("migrate the test database");
        let dir = tempfile::tempdir().expect("a temporary directory");
        Env {
            store,
            url: db.url.clone(),
            db,
            config: dir.path().join("vantage.toml"),
            dir,
            toml: String::new(),
            instance: InstanceId::new(),
        }
    }

    /// A migrated database with the read-model tables, the perspectives registered
    /// (`order_summary`, `audit`, and `legacy`, which this configuration has no handler for),
    /// one live instance, and the configuration file.
    pub async fn new() -> Env {
        Self::with_extra_config("").await
    }

    /// Like [`new`](Self::new), with `extra` appended to the configuration file.
    pub async fn with_extra_config(extra: &str) -> Env {
        let mut env = Env::migrated().await;
        env.exec(READ_MODELS_SQL).await;
        for (name, types) in [
            ("order_summary", vec!["OrderPlaced", "OrderShipped"]),
            ("audit", vec!["*"]),
            ("legacy", vec!["OrderPlaced"]),
        ] {
            let types: Vec<String> = types.into_iter().map(String::from).collect();
            env.store.register_perspective(name, &types).await.unwrap();
        }
        env.store
            .heartbeat(env.instance, &InstanceInfo::current("vantage"))
            .await
            .unwrap();
        let toml = format!(
            "[database]\nurl = \"{}\"\n{PERSPECTIVES_TOML}{extra}",
            env.url
        );
        env.set_config(&toml);
        env
    }

    /// Writes `toml` as the configuration file.
    pub fn set_config(&mut self, toml: &str) {
        std::fs::write(&self.config, toml).expect("write the configuration file");
        self.toml = toml.to_owned();
    }

    /// Runs SQL (several statements allowed), panicking on error.
    pub async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sql)
            .execute(self.store.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// One bigint from a query.
    pub async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(self.store.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    /// Polls `sql` until it returns `want`; panics after `limit` (a liveness bound, not a
    /// performance assertion).
    pub async fn wait_until(&self, sql: &str, want: i64, limit: Duration) {
        let started = std::time::Instant::now();
        loop {
            let got = self.scalar(sql).await;
            if got == want {
                return;
            }
            assert!(
                started.elapsed() < limit,
                "timed out waiting for `{sql}` = {want} (still {got})"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Appends events to a stream (in one call).
    pub async fn append(&self, stream: Uuid, events: &[(&str, Value)]) -> Vec<AppendedEvent> {
        let events: Vec<NewEvent> = events
            .iter()
            .map(|(t, d)| NewEvent::new(*t, d.clone()))
            .collect();
        self.store
            .append_events(stream, None, &events)
            .await
            .unwrap()
    }

    /// Dead-letters the work row of (`perspective`, `position`) the way the daemon's pre-filter
    /// does after the 11th claim: leased to our instance, attempts 11, 10 failures, the last
    /// error on the row.
    pub async fn dead_letter(&self, perspective: &str, position: i64, reason: &str) -> Uuid {
        self.dead_letter_with_error(perspective, position, reason, "handler failed: boom")
            .await
    }

    /// Like [`dead_letter`](Self::dead_letter), with `last_error` as the row's last apply error
    /// (as the daemon writes it, e.g. `… (SQLSTATE 22P02)`).
    pub async fn dead_letter_with_error(
        &self,
        perspective: &str,
        position: i64,
        reason: &str,
        last_error: &str,
    ) -> Uuid {
        let work_id: Uuid = sqlx::query_scalar(
            "SELECT event_work_id FROM wh_perspective_events \
             WHERE perspective_name = $1 AND global_position = $2",
        )
        .bind(perspective)
        .bind(position)
        .fetch_one(self.store.pool())
        .await
        .unwrap_or_else(|e| panic!("no work row for {perspective} at {position}: {e}"));
        sqlx::query(
            "UPDATE wh_perspective_events \
             SET attempts = 11, failures = 10, last_error = $3, \
                 instance_id = $2, lease_expiry = now() + interval '1 minute' \
             WHERE event_work_id = $1",
        )
        .bind(work_id)
        .bind(self.instance.0)
        .bind(last_error)
        .execute(self.store.pool())
        .await
        .unwrap();
        match vantage::internals::leases::move_to_dead_letters(
            self.store.pool(),
            self.instance,
            work_id,
            reason,
            "attempts 11 > max 10",
        )
        .await
        .unwrap()
        {
            MoveOutcome::Moved(id) => id,
            other => panic!("not moved: {other:?}"),
        }
    }

    /// The status of the dead letter of (`perspective`, `position`).
    pub async fn status_of(&self, perspective: &str, position: i64) -> String {
        sqlx::query_scalar(
            "SELECT status FROM wh_dead_letters WHERE perspective_name = $1 AND global_position = $2",
        )
        .bind(perspective)
        .bind(position)
        .fetch_one(self.store.pool())
        .await
        .unwrap()
    }

    /// History kinds of the dead letter of (`perspective`, `position`), oldest first.
    pub async fn history_of(
        &self,
        perspective: &str,
        position: i64,
    ) -> Vec<(String, Option<String>)> {
        sqlx::query_as(
            "SELECT h.kind, h.detail FROM wh_dead_letter_history h \
             JOIN wh_dead_letters d USING (dead_letter_id) \
             WHERE d.perspective_name = $1 AND d.global_position = $2 ORDER BY h.history_id",
        )
        .bind(perspective)
        .bind(position)
        .fetch_all(self.store.pool())
        .await
        .unwrap()
    }
}

/// Fixture id.
pub const STREAM_A: Uuid = Uuid::from_u128(0xa000_0000_0000_4000_8000_0000_0000_000a);
/// Fixture id.
pub const STREAM_B: Uuid = Uuid::from_u128(0xb000_0000_0000_4000_8000_0000_0000_000b);
/// Fixture id.
pub const ORDER_1: &str = "00000000-0000-4000-8000-000000000001";
/// Fixture id.
pub const ORDER_2: &str = "00000000-0000-4000-8000-000000000002";
/// Fixture id.
pub const ORDER_3: &str = "00000000-0000-4000-8000-000000000003";

/// Positions 1-2 on stream A (2 has a total that is not a number: poison for order_summary),
/// 3-4 on stream B. Work rows: order_summary 1-4, audit 1-4, legacy 1-3.
pub async fn seeded() -> Env {
    let env = Env::new().await;
    env.append(
        STREAM_A,
        &[
            (
                "OrderPlaced",
                json!({"order_id": ORDER_1, "total": "10.50"}),
            ),
            ("OrderPlaced", json!({"order_id": ORDER_2, "total": "abc"})),
        ],
    )
    .await;
    env.append(
        STREAM_B,
        &[
            ("OrderPlaced", json!({"order_id": ORDER_3, "total": "7"})),
            ("OrderShipped", json!({"order_id": ORDER_3})),
        ],
    )
    .await;
    env
}
