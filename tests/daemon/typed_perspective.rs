//! Typed Rust perspectives run by the daemon against a real PostgreSQL (docs/sql-contract.md, "Rust
//! perspectives"; issue 12): payloads arrive deserialized, and one that does not deserialize is
//! dead-lettered at once with `PermanentFailure` and serde's error as its text, while the lane goes
//! on.

use std::time::Duration;

use async_trait::async_trait;
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;
use vantage::daemon::{DaemonBuilder, RunningDaemon};
use vantage::perspective::{ApplyError, ApplyTx, Typed, TypedEnvelope, TypedPerspective};
use vantage::store::NewEvent;

use crate::support::{self, Env};

#[derive(Debug, Deserialize)]
enum AccountEvent {
    Opened {
        owner: String,
    },
    Deposited {
        amount: u64,
    },
    #[serde(rename = "account.closed")]
    Closed,
}

/// Keeps `typed.accounts` current: one row per stream, the owner and the balance, and the
/// version of the last event applied (to check order).
struct Accounts;

#[async_trait]
impl TypedPerspective for Accounts {
    type Event = AccountEvent;

    fn name(&self) -> &str {
        "accounts"
    }

    fn event_types(&self) -> Vec<String> {
        // "Renamed" has no variant: such an event can never be applied.
        ["Opened", "Deposited", "account.closed", "Renamed"]
            .map(String::from)
            .to_vec()
    }

    async fn apply(
        &self,
        event: &TypedEnvelope<AccountEvent>,
        tx: &mut ApplyTx<'_>,
    ) -> Result<(), ApplyError> {
        assert!(tx.has_database(), "the daemon gives the transaction");
        let query = match &event.data {
            AccountEvent::Opened { owner } => sqlx::query(
                "INSERT INTO typed.accounts (stream_id, owner, balance, closed, last_version) \
                 VALUES ($1, $2, 0, false, $3)",
            )
            .bind(event.stream_id)
            .bind(owner.clone())
            .bind(event.stream_version),
            AccountEvent::Deposited { amount } => sqlx::query(
                "UPDATE typed.accounts SET balance = balance + $2, last_version = $3 \
                 WHERE stream_id = $1",
            )
            .bind(event.stream_id)
            .bind(i64::try_from(*amount).map_err(|e| ApplyError::Permanent(e.to_string()))?)
            .bind(event.stream_version),
            AccountEvent::Closed => sqlx::query(
                "UPDATE typed.accounts SET closed = true, last_version = $2 WHERE stream_id = $1",
            )
            .bind(event.stream_id)
            .bind(event.stream_version),
        };
        query
            .execute(tx.connection()?)
            .await
            .map_err(ApplyError::from_sqlx)?;
        Ok(())
    }
}

async fn env() -> Env {
    let env = Env::migrated().await;
    env.exec(
        "CREATE SCHEMA typed; CREATE TABLE typed.accounts (stream_id uuid PRIMARY KEY, \
         owner text NOT NULL, balance bigint NOT NULL, closed boolean NOT NULL, \
         last_version int NOT NULL)",
    )
    .await;
    env
}

async fn start(env: &Env) -> RunningDaemon {
    DaemonBuilder::new(support::fast_settings(&env.url, ""))
        .store(env.store.clone())
        .without_http()
        .perspective(Typed(Accounts))
        .start()
        .await
        .expect("daemon starts")
}

async fn append(env: &Env, stream: Uuid, events: &[(&str, serde_json::Value)]) {
    let events: Vec<NewEvent> = events
        .iter()
        .map(|(t, d)| NewEvent::new(*t, d.clone()))
        .collect();
    env.store
        .append_events(stream, None, &events)
        .await
        .unwrap();
}

async fn drain(env: &Env) {
    env.wait_until(
        "SELECT count(*) FROM wh_perspective_events",
        0,
        Duration::from_secs(30),
    )
    .await;
}

/// (event_type, failure_reason, attempts_when_dlq, error_text) of every dead letter, by position.
async fn dead_letters(env: &Env) -> Vec<(Option<String>, String, i32, Option<String>)> {
    sqlx::query_as(
        "SELECT event_type, failure_reason, attempts_when_dlq, error_text FROM wh_dead_letters \
         ORDER BY global_position",
    )
    .fetch_all(env.store.pool())
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_payloads_are_applied_in_stream_order() {
    let env = env().await;
    let daemon = start(&env).await;
    let streams: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
    for (i, stream) in streams.iter().enumerate() {
        append(
            &env,
            *stream,
            &[
                ("Opened", json!({"owner": format!("owner-{i}")})),
                ("Deposited", json!({"amount": 10})),
                (
                    "Deposited",
                    json!({"amount": 5, "note": "unknown fields are ignored"}),
                ),
                (
                    "account.closed",
                    json!({"by": "a unit variant ignores its payload"}),
                ),
            ],
        )
        .await;
    }
    drain(&env).await;
    daemon.shutdown().await.unwrap();

    let rows: Vec<(Uuid, String, i64, bool, i32)> = sqlx::query_as(
        "SELECT stream_id, owner, balance, closed, last_version FROM typed.accounts",
    )
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    assert_eq!(rows.len(), 3);
    for (stream, owner, balance, closed, last_version) in rows {
        let i = streams.iter().position(|s| *s == stream).unwrap();
        assert_eq!(owner, format!("owner-{i}"));
        assert_eq!((balance, closed, last_version), (15, true, 4));
    }
    assert!(dead_letters(&env).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_does_not_deserialize_is_dead_lettered_at_once_with_serdes_error() {
    let env = env().await;
    let daemon = start(&env).await;
    let stream = Uuid::new_v4();
    append(
        &env,
        stream,
        &[
            ("Opened", json!({"owner": "ada"})),
            ("Deposited", json!({"amount": "lots"})),
            ("Deposited", json!({"amount": -3})),
            ("Renamed", json!({"owner": "grace"})),
            ("Deposited", json!({"amount": 7})),
        ],
    )
    .await;
    drain(&env).await;
    daemon.shutdown().await.unwrap();

    let dead = dead_letters(&env).await;
    let expected = [
        (
            "Deposited",
            "payload of Deposited does not deserialize: amount: \
             invalid type: string \"lots\", expected u64",
        ),
        (
            "Deposited",
            "payload of Deposited does not deserialize: amount: \
             invalid value: integer `-3`, expected u64",
        ),
        (
            "Renamed",
            "payload of Renamed does not deserialize: unknown variant `Renamed`, \
             expected one of `Opened`, `Deposited`, `account.closed`",
        ),
    ];
    assert_eq!(dead.len(), expected.len(), "{dead:?}");
    for ((event_type, reason, attempts, error), (want_type, want_error)) in
        dead.iter().zip(expected)
    {
        assert_eq!(event_type.as_deref(), Some(want_type));
        assert_eq!(reason, "PermanentFailure");
        assert_eq!(
            *attempts, 1,
            "dead-lettered on its first claim, not retried"
        );
        assert_eq!(error.as_deref(), Some(want_error));
    }

    // The lane went on past the poison events.
    let (balance, last_version): (i64, i32) =
        sqlx::query_as("SELECT balance, last_version FROM typed.accounts WHERE stream_id = $1")
            .bind(stream)
            .fetch_one(env.store.pool())
            .await
            .unwrap();
    assert_eq!((balance, last_version), (7, 5));
}

/// Sends a receipt (here: records it in `sent`) for every `CheckedOut`, and logs every delivery
/// with its `replay` flag in `typed.receipt_log`. The receipt is an effect outside the database:
/// it is sent only when the event is not a replay.
struct Receipts {
    sent: std::sync::Arc<std::sync::Mutex<Vec<Uuid>>>,
}

#[derive(Debug, Deserialize)]
enum CartEvent {
    CheckedOut,
}

#[async_trait]
impl TypedPerspective for Receipts {
    type Event = CartEvent;

    fn name(&self) -> &str {
        "receipts"
    }

    fn event_types(&self) -> Vec<String> {
        vec!["CheckedOut".into()]
    }

    async fn apply(
        &self,
        event: &TypedEnvelope<CartEvent>,
        tx: &mut ApplyTx<'_>,
    ) -> Result<(), ApplyError> {
        sqlx::query("INSERT INTO typed.receipt_log (event_id, replay) VALUES ($1, $2)")
            .bind(event.event_id)
            .bind(event.replay)
            .execute(tx.connection()?)
            .await
            .map_err(ApplyError::from_sqlx)?;
        if !event.replay {
            self.sent.lock().unwrap().push(event.event_id);
        }
        Ok(())
    }

    fn effects_in_transaction(&self) -> bool {
        false
    }
}

/// Issue 21 item 5: a Rust perspective sees whether an event is a replay. After a rebuild
/// (`vantage::perspective::rebuild`, what `perspectives rebuild` runs), every event is delivered again with `replay` true and no receipt is sent twice;
/// an event appended afterwards is delivered with `replay` false and gets its receipt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_perspective_is_told_which_deliveries_replay_history() {
    let env = Env::migrated().await;
    env.exec(
        "CREATE SCHEMA typed; CREATE TABLE typed.receipt_log (seq bigserial PRIMARY KEY, \
         event_id uuid NOT NULL, replay boolean NOT NULL)",
    )
    .await;
    let sent = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let daemon = DaemonBuilder::new(support::fast_settings(&env.url, ""))
        .store(env.store.clone())
        .without_http()
        .perspective(Typed(Receipts { sent: sent.clone() }))
        .start()
        .await
        .expect("daemon starts");
    let log = |replay: bool| {
        let pool = env.store.pool().clone();
        async move {
            sqlx::query_scalar::<_, Uuid>(
                "SELECT event_id FROM typed.receipt_log WHERE replay = $1 ORDER BY seq",
            )
            .bind(replay)
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };

    // (streams are applied in parallel: compare as sets)
    let sorted = |mut ids: Vec<Uuid>| {
        ids.sort();
        ids
    };
    let mut history = Vec::new();
    for _ in 0..3 {
        history.extend(
            env.append(Uuid::new_v4(), &[("CheckedOut", json!({}))])
                .await,
        );
    }
    drain(&env).await;
    let history = sorted(history.iter().map(|e| e.event_id).collect());
    assert_eq!(
        sorted(sent.lock().unwrap().clone()),
        history,
        "one receipt per checkout"
    );

    // The rebuild, with the library's call, on the running daemon (it wakes the daemon).
    let mut progress = Vec::new();
    let rebuilt = vantage::perspective::rebuild::rebuild(
        &env.store,
        &Typed(Receipts { sent: sent.clone() }),
        Duration::from_secs(30),
        |p| progress.push(p),
    )
    .await
    .expect("the rebuild runs");
    assert_eq!(rebuilt.queued, 3);
    assert!(
        progress.contains(&vantage::perspective::rebuild::RebuildProgress::Reset),
        "{progress:?}"
    );
    drain(&env).await;
    assert_eq!(
        sorted(log(true).await),
        history,
        "every event delivered again, as a replay"
    );
    assert_eq!(
        sorted(sent.lock().unwrap().clone()),
        history,
        "no receipt sent twice"
    );

    // A new checkout after the rebuild is live.
    let later = env
        .append(Uuid::new_v4(), &[("CheckedOut", json!({}))])
        .await[0]
        .event_id;
    drain(&env).await;
    let live = sorted(history.iter().copied().chain([later]).collect());
    assert_eq!(sorted(log(false).await), live);
    assert_eq!(
        sorted(sent.lock().unwrap().clone()),
        live,
        "the new checkout gets its receipt"
    );
    daemon.shutdown().await.unwrap();
}
