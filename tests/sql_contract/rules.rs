//! The database contract (docs/pipeline.md: "Attempts", "Ordering and failure", "Instances and
//! orphans"; docs/sql-contract.md), tested against the SQL of `migrations/`: one test per rule,
//! each written so that it fails when its rule is broken. The doc comment of every test names the
//! mutations of the SQL it catches.
//!
//! Every instance that claims is registered with `heartbeat` first: an instance id without a row
//! in `wh_service_instances` is a dead holder, whose leases anyone may take over.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;
use sqlx::postgres::{PgListener, PgPoolOptions};
use sqlx::PgPool;
use uuid::Uuid;
use vantage::internals::store::{
    ClaimedHead, InstanceInfo, MoveOutcome, StoreInternals as _, WorkRow, FAILURE_MAX_ATTEMPTS,
    MIGRATOR, SOURCE_TABLE,
};
use vantage::store::{AppendedEvent, InstanceId, NewEvent, Store, StoreError, StoreOptions};

use crate::support::{self, Env};

type TestResult = anyhow::Result<()>;

/// Long enough never to lapse during a test; expiry is simulated by poking `lease_expiry`.
const LEASE: Duration = Duration::from_secs(60);
/// A row budget large enough not to matter.
const BIG: u32 = 1000;

// ------------------------------------------------------------------------------------------
// Harness
// ------------------------------------------------------------------------------------------

/// A migrated store on a fresh database (the shared [`Env`]), vantage's objects in its
/// `vantage` schema.
async fn setup() -> anyhow::Result<Env> {
    setup_schema("vantage").await
}

/// Like [`setup`], with vantage's objects in `schema`.
async fn setup_schema(schema: &str) -> anyhow::Result<Env> {
    Ok(Env::in_schema(schema).await)
}

async fn connect(db: &support::TestDatabase, schema: &str) -> anyhow::Result<Store> {
    let mut opts = StoreOptions::for_url(&db.url);
    opts.schema = schema.to_string();
    Ok(Store::connect(&opts).await?)
}

/// A pool on the test database with the server's default search_path (no vantage schema).
async fn plain_pool(db: &support::TestDatabase) -> anyhow::Result<PgPool> {
    Ok(PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&db.url)
        .await?)
}

/// A registered (live) instance.
async fn live_instance(store: &Store) -> anyhow::Result<InstanceId> {
    let id = InstanceId::new();
    store
        .heartbeat(id, &InstanceInfo::current("vantage-sql-contract"))
        .await?;
    Ok(id)
}

async fn perspective(store: &Store, name: &str, types: &[&str]) -> anyhow::Result<()> {
    let types: Vec<String> = types.iter().map(|t| t.to_string()).collect();
    store.register_perspective(name, &types).await?;
    Ok(())
}

fn names(list: &[&str]) -> Vec<String> {
    list.iter().map(|n| n.to_string()).collect()
}

fn events(types: &[&str]) -> Vec<NewEvent> {
    types
        .iter()
        .enumerate()
        .map(|(i, t)| NewEvent::new(*t, json!({ "type": t, "n": i })))
        .collect()
}

async fn append(store: &Store, stream: Uuid, types: &[&str]) -> anyhow::Result<Vec<AppendedEvent>> {
    Ok(store.append_events(stream, None, &events(types)).await?)
}

/// A work row as stored.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
struct Work {
    event_work_id: Uuid,
    stream_id: Uuid,
    event_id: Uuid,
    stream_version: i32,
    perspective_name: String,
    attempts: i32,
    failures: i32,
    last_error: Option<String>,
    instance_id: Option<Uuid>,
    lease_expiry: Option<DateTime<Utc>>,
    scheduled_for: DateTime<Utc>,
}

const WORK_COLUMNS: &str = "event_work_id, stream_id, event_id, stream_version, perspective_name, \
    attempts, failures, last_error, instance_id, lease_expiry, scheduled_for";

async fn work(store: &Store, id: Uuid) -> anyhow::Result<Option<Work>> {
    Ok(sqlx::query_as(&format!(
        "SELECT {WORK_COLUMNS} FROM wh_perspective_events WHERE event_work_id = $1"
    ))
    .bind(id)
    .fetch_optional(store.pool())
    .await?)
}

async fn must_work(store: &Store, id: Uuid) -> anyhow::Result<Work> {
    work(store, id)
        .await?
        .ok_or_else(|| anyhow::anyhow!("work row {id} is gone"))
}

/// The rows of one lane, in stream_version order.
async fn lane(store: &Store, stream: Uuid, perspective: &str) -> anyhow::Result<Vec<Work>> {
    Ok(sqlx::query_as(&format!(
        "SELECT {WORK_COLUMNS} FROM wh_perspective_events \
         WHERE stream_id = $1 AND perspective_name = $2 ORDER BY stream_version"
    ))
    .bind(stream)
    .bind(perspective)
    .fetch_all(store.pool())
    .await?)
}

/// Every work row, in a stable order.
async fn all_work(store: &Store) -> anyhow::Result<Vec<Work>> {
    Ok(sqlx::query_as(&format!(
        "SELECT {WORK_COLUMNS} FROM wh_perspective_events \
         ORDER BY stream_id, perspective_name, stream_version"
    ))
    .fetch_all(store.pool())
    .await?)
}

async fn work_id(store: &Store, event_id: Uuid, perspective: &str) -> anyhow::Result<Uuid> {
    Ok(sqlx::query_scalar(
        "SELECT event_work_id FROM wh_perspective_events \
         WHERE event_id = $1 AND perspective_name = $2",
    )
    .bind(event_id)
    .bind(perspective)
    .fetch_one(store.pool())
    .await?)
}

/// True when the row is leased and its lease has not lapsed (judged by the database clock).
async fn lease_valid(store: &Store, id: Uuid) -> anyhow::Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT coalesce(lease_expiry > now(), false) FROM wh_perspective_events \
         WHERE event_work_id = $1",
    )
    .bind(id)
    .fetch_one(store.pool())
    .await?)
}

/// Runs a statement with one uuid[] parameter (pokes rows to simulate time passing).
async fn poke(store: &Store, sql: &str, ids: &[Uuid]) -> anyhow::Result<u64> {
    Ok(sqlx::query(sql)
        .bind(ids)
        .execute(store.pool())
        .await?
        .rows_affected())
}

async fn expire(store: &Store, ids: &[Uuid]) -> anyhow::Result<()> {
    let n = poke(
        store,
        "UPDATE wh_perspective_events SET lease_expiry = now() - interval '1 second' \
         WHERE event_work_id = ANY ($1)",
        ids,
    )
    .await?;
    assert_eq!(n, ids.len() as u64, "every row to expire exists");
    Ok(())
}

async fn count(store: &Store, sql: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(sql).fetch_one(store.pool()).await?)
}

async fn orphaned(store: &Store, instance: InstanceId) -> anyhow::Result<Vec<ClaimedHead>> {
    Ok(store
        .claim_orphaned(instance, LEASE, BIG, BIG, None)
        .await?)
}

async fn fetch(
    store: &Store,
    instance: InstanceId,
    streams: &[Uuid],
) -> anyhow::Result<Vec<WorkRow>> {
    Ok(store
        .get_stream_events(instance, streams, LEASE, None, Some(BIG))
        .await?)
}

/// `claim_and_fetch_pending_perspective_events` with an explicit row budget (the Rust wrapper
/// passes none; that path is covered by `first_claim_sets_attempts_to_one` and
/// `unbounded_get_stream_events_works_for_one_and_two_lanes`).
async fn claim_lane(
    store: &Store,
    instance: InstanceId,
    stream: Uuid,
    perspective: &str,
) -> anyhow::Result<Vec<(Uuid, Uuid, i32, i32)>> {
    Ok(sqlx::query_as(
        "SELECT event_work_id, event_id, stream_version, attempts \
         FROM claim_and_fetch_pending_perspective_events($1, $2, $3, $4, $5)",
    )
    .bind(stream)
    .bind(perspective)
    .bind(instance.0)
    .bind(LEASE.as_secs() as i32)
    .bind(BIG as i32)
    .fetch_all(store.pool())
    .await?)
}

/// claim_orphaned, then get_stream_events on every stream given: what the daemon does.
async fn claim_streams(
    store: &Store,
    instance: InstanceId,
    streams: &[Uuid],
) -> anyhow::Result<Vec<WorkRow>> {
    orphaned(store, instance).await?;
    fetch(store, instance, streams).await
}

/// Returns once `task` has finished or a session running a statement that mentions `function`
/// waits for a lock: the moment to let the lock's holder go on.
async fn until_waiting_or_done<T>(
    store: &Store,
    function: &str,
    task: &tokio::task::JoinHandle<T>,
) -> anyhow::Result<()> {
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock' \
               AND query LIKE '%' || $1 || '%' AND pid <> pg_backend_pid()",
        )
        .bind(function)
        .fetch_one(store.pool())
        .await?;
        if waiting > 0 || task.is_finished() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn ids_of(rows: &[WorkRow]) -> Vec<Uuid> {
    rows.iter().map(|r| r.event_work_id).collect()
}

fn versions(rows: &[Work]) -> Vec<i32> {
    rows.iter().map(|r| r.stream_version).collect()
}

/// Versions of every up migration of this build.
fn all_migrations() -> Vec<i64> {
    MIGRATOR
        .iter()
        .filter(|m| m.migration_type.is_up_migration())
        .map(|m| m.version)
        .collect()
}

fn sqlstate(e: &sqlx::Error) -> Option<String> {
    e.as_database_error()
        .and_then(|d| d.code())
        .map(|c| c.into_owned())
}

// ------------------------------------------------------------------------------------------
// §1.1 Attempts
// ------------------------------------------------------------------------------------------

/// Rule 1. The first claim is a takeover (NULL → caller): attempts becomes exactly 1, through
/// `claim_orphaned` (the head only) + `get_stream_events` (the rest of the lane), and through
/// `claim_and_fetch_pending`. Catches: no bump on NULL → caller (0), a bump of more than one, the
/// head bumped twice (by claim_orphaned and again by get_stream_events re-leasing it), and
/// claim_orphaned leasing more than the head.
#[tokio::test]
async fn first_claim_sets_attempts_to_one() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["A"]).await?;
    perspective(store, "P2", &["B"]).await?;
    let a = live_instance(store).await?;
    let s1 = Uuid::new_v4();
    let s2 = Uuid::new_v4();
    append(store, s1, &["A", "A", "A"]).await?;
    append(store, s2, &["B", "B"]).await?;

    // claim_orphaned: the head of the lane, attempts 1; the rest untouched.
    let heads = store
        .claim_orphaned(a, LEASE, BIG, BIG, Some(names(&["P1"]).as_slice()))
        .await?;
    let l1 = lane(store, s1, "P1").await?;
    assert_eq!(heads.len(), 1, "one lane, one head: {heads:?}");
    assert_eq!(heads[0].event_work_id, l1[0].event_work_id);
    assert_eq!((l1[0].attempts, l1[0].instance_id), (1, Some(a.0)));
    assert!(lease_valid(store, l1[0].event_work_id).await?);
    for w in &l1[1..] {
        assert_eq!(
            (w.attempts, w.instance_id),
            (0, None),
            "only the head is claimed"
        );
    }

    // get_stream_events: claims the rest; the head (already ours) is not bumped again.
    let rows = fetch(store, a, &[s1]).await?;
    assert_eq!(
        rows.iter()
            .map(|r| (r.stream_version, r.attempts))
            .collect::<Vec<_>>(),
        vec![(1, 1), (2, 1), (3, 1)]
    );
    for w in lane(store, s1, "P1").await? {
        assert_eq!((w.attempts, w.instance_id), (1, Some(a.0)), "{w:?}");
    }

    // claim_and_fetch_pending (the Rust wrapper, as the daemon calls it).
    let pending = store.claim_and_fetch_pending(s2, "P2", a, LEASE).await?;
    assert_eq!(
        pending.iter().map(|p| (p.2, p.3)).collect::<Vec<_>>(),
        vec![(1, 1), (2, 1)]
    );
    for w in lane(store, s2, "P2").await? {
        assert_eq!((w.attempts, w.instance_id), (1, Some(a.0)), "{w:?}");
        assert!(lease_valid(store, w.event_work_id).await?);
    }
    Ok(())
}

/// Each claimed row says how long its work row has been queued: `get_stream_events` returns the
/// row's `created_at` as `queued_at` (migration 0015), in the daemon's claim and in the
/// named-stream form, and the daemon's `queued_for` is measured from it (where
/// `vantage_append_to_applied_seconds` starts). Catches: the claim returning another time as
/// `queued_at` (its lease, `now()`), a row's time given to another row, and `queued_at` lost on
/// the way to the result.
#[tokio::test]
async fn a_claim_returns_when_each_row_was_queued() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let a = live_instance(store).await?;
    let old = Uuid::new_v4();
    let new = Uuid::new_v4();
    append(store, old, &["A", "A"]).await?;
    append(store, new, &["A"]).await?;
    let backdated = poke(
        store,
        "UPDATE wh_perspective_events SET created_at = now() - interval '1 hour' \
         WHERE stream_id = ANY ($1)",
        &[old],
    )
    .await?;
    assert_eq!(backdated, 2);

    let rows = store.claim_work(a, LEASE, 10, 10, None).await?;
    assert_eq!(rows.len(), 3, "{rows:?}");
    for row in &rows {
        let queued = row
            .queued_for
            .expect("the store knows when a row was queued");
        if row.stream_id == old {
            assert!(
                (3600.0..3660.0).contains(&queued.as_secs_f64()),
                "queued an hour ago: {queued:?}"
            );
        } else {
            assert!(
                queued < Duration::from_secs(60),
                "queued just now: {queued:?}"
            );
        }
    }

    // The named-stream form returns the same column, for the rows it returns.
    let same: Vec<bool> = sqlx::query_scalar(
        "SELECT g.queued_at = pe.created_at \
         FROM get_stream_events($1, $2, 60) g \
         JOIN wh_perspective_events pe ON pe.event_work_id = g.event_work_id",
    )
    .bind(a.0)
    .bind(vec![old, new])
    .fetch_all(store.pool())
    .await?;
    assert_eq!(same, vec![true; 3]);
    Ok(())
}

/// (event_id, replay) of the rows a claim returns: the daemon's claim (`streams` None) or the
/// named-stream form, in the claim's order.
async fn claimed_replay(
    store: &Store,
    instance: InstanceId,
    streams: Option<&[Uuid]>,
) -> anyhow::Result<Vec<(Uuid, bool)>> {
    Ok(sqlx::query_as(
        "SELECT g.event_id, g.replay FROM get_stream_events($1, $2, 60, NULL, 100, 100) g",
    )
    .bind(instance.0)
    .bind(streams)
    .fetch_all(store.pool())
    .await?)
}

/// Each claimed row says whether it re-delivers history (migration 0016): the rows a rebuild
/// re-queues (`requeue_history_batch_in`) are claimed with `replay` true, a live event appended
/// afterwards and a requeued dead letter with `replay` false, by the daemon's claim, the
/// named-stream form and into the daemon's `WorkRow`. An event still queued when the rebuild
/// re-queues keeps its row, and so stays a first delivery. Catches: a rebuild's rows queued as
/// live, the fan-out or a dead-letter requeue marking rows as replays, and the flag lost (or
/// given to another row) on the way to the claim's result.
#[tokio::test]
async fn a_claim_says_which_rows_replay_history() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let a = live_instance(store).await?;
    let s = Uuid::new_v4();
    let applied = append(store, s, &["A", "B"]).await?;
    let first = claim_streams(store, a, &[s]).await?;
    assert_eq!(
        vantage::internals::leases::complete(store.pool(), a, &ids_of(&first)).await?,
        2
    );
    let pending = append(store, s, &["C"]).await?;

    // What a rebuild does after its reset: the history queued again.
    let position = pending[0].global_position;
    let mut conn = store.pool().acquire().await?;
    let (queued, _) =
        vantage::internals::store::requeue_history_batch_in(&mut conn, "P1", 0, position, 100)
            .await?;
    drop(conn);
    assert_eq!(queued, 2, "C is still queued: its row is left alone");
    let live = append(store, s, &["D"]).await?;

    let expected = vec![
        (applied[0].event_id, true),
        (applied[1].event_id, true),
        (pending[0].event_id, false),
        (live[0].event_id, false),
    ];
    assert_eq!(claimed_replay(store, a, None).await?, expected);
    // The named-stream form (our own valid leases, returned again) says the same.
    assert_eq!(claimed_replay(store, a, Some(&[s])).await?, expected);
    // And so does the daemon's row.
    let rows = fetch(store, a, &[s]).await?;
    let got: Vec<(Uuid, bool)> = rows.iter().map(|r| (r.event_id, r.replay)).collect();
    assert_eq!(got, expected);

    // A dead letter's requeue is an operator's retry of an event whose apply never committed:
    // a first delivery, not a replay (docs/pipeline.md, "Replays").
    let head = rows[0].event_work_id;
    let MoveOutcome::Moved(dl) = vantage::internals::leases::move_to_dead_letters(
        store.pool(),
        a,
        head,
        FAILURE_MAX_ATTEMPTS,
        "x",
    )
    .await?
    else {
        panic!("moved");
    };
    assert!(store.requeue_dead_letter(dl, "ops").await?);
    let replay: bool =
        sqlx::query_scalar("SELECT replay FROM wh_perspective_events WHERE event_id = $1")
            .bind(applied[0].event_id)
            .fetch_one(store.pool())
            .await?;
    assert!(!replay, "a requeued dead letter is not a replay");
    Ok(())
}

/// A version's backfill (SQL only: versioned perspectives are SQL perspectives) applies history
/// directly, but the events of a batch it diverts become work rows that re-deliver history:
/// they are claimed with `replay` true, while the fan-out's rows for events appended after the
/// registration are claimed with `replay` false. Catches: diverted rows queued as live, and the
/// fan-out's rows of a version marked as replays.
#[tokio::test]
async fn a_backfills_diverted_rows_are_replays() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    let a = live_instance(store).await?;
    let s = Uuid::new_v4();
    let history = append(store, s, &["Placed", "Placed"]).await?;
    sqlx::query(
        "SELECT register_perspective_version('orders', 1, 'rm', ARRAY['orders'], \
         ARRAY['Placed'], $1, 'CREATE TABLE orders (event_id uuid PRIMARY KEY)')",
    )
    .bind(json!({"Placed": "INSERT INTO orders (event_id) VALUES ($3)"}))
    .execute(store.pool())
    .await?;
    let live = append(store, s, &["Placed"]).await?;
    // Every batch diverted (as after a batch that could not be applied), until the version is
    // live; the backfill waits first for transactions older than the registration.
    let mut outcome = String::new();
    for _ in 0..500 {
        outcome = sqlx::query_scalar(
            "SELECT outcome FROM backfill_perspective_version('orders', 1, 10, true)",
        )
        .fetch_one(store.pool())
        .await?;
        if outcome == "live" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(outcome, "live");
    assert_eq!(
        claimed_replay(store, a, None).await?,
        vec![
            (history[0].event_id, true),
            (history[1].event_id, true),
            (live[0].event_id, false),
        ]
    );
    Ok(())
}

/// Registers version `version` of `orders` (one table, one statement for `Placed`) and runs its
/// backfill until the version is in `state`.
async fn built_version(store: &Store, version: i32, state: &str) -> anyhow::Result<()> {
    sqlx::query(
        "SELECT register_perspective_version('orders', $1, 'rm', ARRAY['orders'], \
         ARRAY['Placed'], $2, 'CREATE TABLE orders (event_id uuid PRIMARY KEY)')",
    )
    .bind(version)
    .bind(json!({"Placed": "INSERT INTO orders (event_id) VALUES ($3)"}))
    .execute(store.pool())
    .await?;
    // (the backfill waits first for transactions older than the registration)
    for _ in 0..500 {
        let outcome: String = sqlx::query_scalar(
            "SELECT outcome FROM backfill_perspective_version('orders', $1, 100)",
        )
        .bind(version)
        .fetch_one(store.pool())
        .await?;
        if outcome == state {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    anyhow::bail!("version {version} never became {state}")
}

/// A backfill batch ends after `p_max` events or, with a budget, after the step of 100 events
/// that used it up: with a budget of 0 ms each batch is one step, and the next batch goes on
/// from the position the last one recorded, until every event is applied once. Catches: a
/// budget that is not checked (one batch takes all 250), a position recorded past the events
/// looked at (events skipped), or short of them (applied twice: the primary key refuses).
#[tokio::test]
async fn a_backfill_batch_ends_when_its_time_budget_is_used() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    for _ in 0..50 {
        append(store, Uuid::new_v4(), &["Placed"; 5]).await?;
    }
    sqlx::query(
        "SELECT register_perspective_version('orders', 1, 'rm', ARRAY['orders'], \
         ARRAY['Placed'], $1, 'CREATE TABLE orders (event_id uuid PRIMARY KEY)')",
    )
    .bind(json!({"Placed": "INSERT INTO orders (event_id) VALUES ($3)"}))
    .execute(store.pool())
    .await?;
    let mut steps = Vec::new();
    for _ in 0..500 {
        let (outcome, applied): (String, i32) = sqlx::query_as(
            "SELECT outcome, applied FROM backfill_perspective_version('orders', 1, 1000, false, 0)",
        )
        .fetch_one(store.pool())
        .await?;
        match outcome.as_str() {
            "waiting" => tokio::time::sleep(Duration::from_millis(20)).await,
            "applied" => steps.push(applied),
            _ => break,
        }
    }
    assert_eq!(steps, [100, 100, 50]);
    assert_eq!(
        count(store, "SELECT count(*) FROM orders_v1.orders").await?,
        250
    );
    Ok(())
}

/// A cutover fences the live version's applies, not its tables: a VACUUM, ANALYZE or CREATE
/// INDEX CONCURRENTLY of a live table (SHARE UPDATE EXCLUSIVE, as autovacuum takes after a
/// backfill) does not hold it up. Catches: a cutover that locks the live version's tables
/// against writes, which conflicts with every vacuum of them: it waited for autovacuum to give
/// way (after `deadlock_timeout`) or failed on its lock timeout.
#[tokio::test]
async fn a_cutover_does_not_wait_for_a_vacuum_of_the_live_tables() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    built_version(store, 1, "live").await?;
    built_version(store, 2, "ready").await?;
    let mut vacuum = store.pool().begin().await?;
    sqlx::query("LOCK TABLE orders_v1.orders IN SHARE UPDATE EXCLUSIVE MODE")
        .execute(&mut *vacuum)
        .await?;
    let outcome: String = sqlx::query_scalar(
        "SELECT outcome FROM switch_perspective_version('orders', 'Cutover', 2, 'test')",
    )
    .fetch_one(store.pool())
    .await?;
    assert_eq!(outcome, "done");
    vacuum.rollback().await?;
    Ok(())
}

/// While an apply of the live version is in flight, a cutover waits for it, then sees what it
/// applied: here an event the new version has not applied yet, so the cutover is refused as
/// behind instead of switching readers to a version that lacks an event they may have seen.
/// Catches: a cutover that does not fence the live version's applies (it checks while the
/// apply is uncommitted, finds nothing behind and switches).
#[tokio::test]
async fn a_cutover_waits_for_the_live_versions_apply_in_flight() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    built_version(store, 1, "live").await?;
    built_version(store, 2, "ready").await?;
    let a = live_instance(store).await?;
    let s = Uuid::new_v4();
    let event = append(store, s, &["Placed"]).await?.remove(0);
    let rows = store
        .get_stream_events(a, &[s], LEASE, Some(&names(&["orders@v1"])), Some(BIG))
        .await?;
    assert_eq!(rows.len(), 1);

    // Version 1's batch: applied and completed, not yet committed.
    let mut batch = store.pool().begin().await?;
    sqlx::query(
        "SELECT orders_v1.vantage_apply('{}'::jsonb, $1, $2, 'Placed', $3, 1, '{}'::jsonb)",
    )
    .bind(s)
    .bind(event.event_id)
    .bind(event.global_position)
    .execute(&mut *batch)
    .await?;
    sqlx::query("SELECT complete_perspective_events($1, $2)")
        .bind(a.0)
        .bind(ids_of(&rows))
        .execute(&mut *batch)
        .await?;

    let cutover = {
        let pool = store.pool().clone();
        tokio::spawn(async move {
            sqlx::query_scalar::<_, String>(
                "SELECT outcome FROM switch_perspective_version('orders', 'Cutover', 2, 'test')",
            )
            .fetch_one(&pool)
            .await
        })
    };
    // The batch commits once the cutover has run while it was open: finished, or waiting.
    until_waiting_or_done(store, "switch_perspective_version", &cutover).await?;
    batch.commit().await?;
    assert_eq!(cutover.await??, "behind_live");
    Ok(())
}

/// Migration 0016 drops and recreates the claim functions (their result gains `replay`): an
/// installation's grants and comments on them survive it, and work rows queued before it are
/// first deliveries (`replay` false). Catches: a migration that leaves the functions with the
/// default ACL (PUBLIC can execute again, the daemon role's grant is gone), a lost comment, and
/// a default that marks existing rows as replays.
#[tokio::test]
async fn migration_0016_keeps_the_claims_grants_and_comments() -> TestResult {
    let db = support::fresh_database().await;
    let store = connect(&db, "vantage").await?;
    sqlx::query("CREATE SCHEMA vantage")
        .execute(store.pool())
        .await?;
    let before_0016 = sqlx::migrate::Migrator {
        migrations: std::borrow::Cow::Owned(
            MIGRATOR
                .iter()
                .filter(|m| m.version < 16)
                .cloned()
                .collect(),
        ),
        ..sqlx::migrate::Migrator::DEFAULT
    };
    before_0016.run(store.pool()).await?;
    perspective(&store, "P1", &["*"]).await?;
    let queued = append(&store, Uuid::new_v4(), &["A"]).await?;

    let role = format!(
        "vantage_claimer_{}",
        &Uuid::new_v4().simple().to_string()[..8]
    );
    const CLAIM: &str = "get_stream_events(uuid,uuid[],integer,text[],integer,integer,integer)";
    const NAMED: &str = "wh_get_named_stream_events(uuid,uuid[],integer,text[],integer)";
    sqlx::raw_sql(&format!(
        "CREATE ROLE {role}; \
         REVOKE ALL ON FUNCTION {CLAIM} FROM PUBLIC; GRANT EXECUTE ON FUNCTION {CLAIM} TO {role}; \
         REVOKE ALL ON FUNCTION {NAMED} FROM PUBLIC; GRANT EXECUTE ON FUNCTION {NAMED} TO {role}; \
         COMMENT ON FUNCTION {CLAIM} IS 'the claim, say the operators'"
    ))
    .execute(store.pool())
    .await?;

    let result = async {
        store.migrate().await?;
        for f in [CLAIM, NAMED] {
            let (role_can, public_can): (bool, bool) = sqlx::query_as(&format!(
                "SELECT has_function_privilege('{role}', '{f}', 'EXECUTE'), \
                        coalesce((SELECT bool_or(a.grantee = 0) FROM pg_proc p, \
                                  aclexplode(p.proacl) a WHERE p.oid = '{f}'::regprocedure), true)"
            ))
            .fetch_one(store.pool())
            .await?;
            assert!(role_can, "{f}: the role's grant is kept");
            assert!(!public_can, "{f}: PUBLIC's revoke is kept");
        }
        let comment: Option<String> = sqlx::query_scalar(&format!(
            "SELECT obj_description('{CLAIM}'::regprocedure, 'pg_proc')"
        ))
        .fetch_one(store.pool())
        .await?;
        assert_eq!(comment.as_deref(), Some("the claim, say the operators"));
        let replay: bool =
            sqlx::query_scalar("SELECT replay FROM wh_perspective_events WHERE event_id = $1")
                .bind(queued[0].event_id)
                .fetch_one(store.pool())
                .await?;
        assert!(!replay, "a row queued before 0016 is a first delivery");
        anyhow::Ok(())
    }
    .await;
    // (roles are the cluster's, not the test database's)
    sqlx::raw_sql(&format!(
        "REVOKE ALL ON FUNCTION {CLAIM} FROM {role}; REVOKE ALL ON FUNCTION {NAMED} FROM {role}; \
         DROP ROLE {role}"
    ))
    .execute(store.pool())
    .await?;
    result
}

/// Rule 2. Fetching rows still validly leased to the caller changes neither attempts nor
/// lease_expiry, whichever claim function fetches them. Catches: re-extending valid own leases
/// (lease_expiry moves), bumping attempts on own rows, claim_orphaned re-acquiring own lanes.
#[tokio::test]
async fn refetch_of_own_valid_lease_changes_nothing() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let a = live_instance(store).await?;
    let s = Uuid::new_v4();
    append(store, s, &["A", "B", "C"]).await?;

    let first = claim_streams(store, a, &[s]).await?;
    assert_eq!(first.len(), 3);
    let before = lane(store, s, "P1").await?;
    assert!(before
        .iter()
        .all(|w| w.attempts == 1 && w.instance_id == Some(a.0)));

    // Let the database clock move on, so a re-extended lease would show.
    tokio::time::sleep(Duration::from_millis(50)).await;

    assert!(
        orphaned(store, a).await?.is_empty(),
        "own valid lanes are not re-acquired"
    );
    let again = fetch(store, a, &[s]).await?;
    assert_eq!(ids_of(&again), ids_of(&first), "the same rows are returned");
    assert!(again.iter().all(|r| r.attempts == 1), "{again:?}");
    let lane_again = claim_lane(store, a, s, "P1").await?;
    assert_eq!(lane_again.len(), 3);
    assert!(lane_again.iter().all(|r| r.3 == 1), "{lane_again:?}");

    assert_eq!(
        lane(store, s, "P1").await?,
        before,
        "attempts and lease_expiry unchanged"
    );
    Ok(())
}

/// Rule 3. An instance re-leasing its own expired rows does not bump attempts, but the lease is
/// renewed (lease_expiry moves into the future) — through claim_orphaned + get_stream_events,
/// get_stream_events alone, and claim_and_fetch_pending. Catches: treating "own but expired" as
/// a takeover (attempts 2), and not renewing an expired own lease (rows not returned, or
/// returned with a lapsed lease).
#[tokio::test]
async fn own_expired_lease_is_released_to_self_without_bump() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["A"]).await?;
    perspective(store, "P2", &["B"]).await?;
    perspective(store, "P3", &["C"]).await?;
    let a = live_instance(store).await?;
    let (s1, s2, s3) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    append(store, s1, &["A", "A", "A"]).await?;
    append(store, s2, &["B", "B"]).await?;
    append(store, s3, &["C", "C"]).await?;

    let claimed = claim_streams(store, a, &[s1, s2, s3]).await?;
    assert_eq!(claimed.len(), 7);
    assert!(claimed.iter().all(|r| r.attempts == 1));
    expire(store, &ids_of(&claimed)).await?;
    let expired: HashMap<Uuid, Work> = all_work(store)
        .await?
        .into_iter()
        .map(|w| (w.event_work_id, w))
        .collect();

    let check = |w: &Work| {
        assert_eq!(
            w.attempts, 1,
            "own expired lease re-leased without a bump: {w:?}"
        );
        assert_eq!(w.instance_id, Some(a.0));
        assert!(
            w.lease_expiry > expired[&w.event_work_id].lease_expiry,
            "lease_expiry moved forward: {w:?}"
        );
    };

    // claim_orphaned re-acquires the expired head of lane (s1, P1), then get_stream_events the
    // rest.
    let heads = store
        .claim_orphaned(a, LEASE, BIG, BIG, Some(names(&["P1"]).as_slice()))
        .await?;
    assert_eq!(heads.len(), 1, "{heads:?}");
    let rows = fetch(store, a, &[s1]).await?;
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|r| r.attempts == 1), "{rows:?}");
    for w in lane(store, s1, "P1").await? {
        check(&w);
        assert!(lease_valid(store, w.event_work_id).await?);
    }

    // get_stream_events alone.
    let rows = fetch(store, a, &[s2]).await?;
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r.attempts == 1), "{rows:?}");
    for w in lane(store, s2, "P2").await? {
        check(&w);
        assert!(lease_valid(store, w.event_work_id).await?);
    }

    // claim_and_fetch_pending.
    let rows = claim_lane(store, a, s3, "P3").await?;
    assert_eq!(rows.iter().map(|r| r.3).collect::<Vec<_>>(), vec![1, 1]);
    for w in lane(store, s3, "P3").await? {
        check(&w);
        assert!(lease_valid(store, w.event_work_id).await?);
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// §1.5 Instances and orphans
// ------------------------------------------------------------------------------------------

/// Rule 4. Another registered, live instance cannot take a valid lease: its claim_orphaned,
/// get_stream_events and claim_and_fetch_pending return nothing of that lane, and the rows stay
/// as they were (while the same calls do claim an unrelated free stream). Catches: a claim that
/// ignores lease_expiry, or treats every holder as dead (e.g. a wrong instance lookup).
#[tokio::test]
async fn live_instance_cannot_take_a_valid_lease() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let a = live_instance(store).await?;
    let b = live_instance(store).await?;
    let s = Uuid::new_v4();
    append(store, s, &["A", "B", "C"]).await?;
    assert_eq!(claim_streams(store, a, &[s]).await?.len(), 3);
    let before = lane(store, s, "P1").await?;

    let free = Uuid::new_v4();
    append(store, free, &["A"]).await?;

    let heads = orphaned(store, b).await?;
    assert_eq!(
        heads.iter().map(|h| h.stream_id).collect::<Vec<_>>(),
        vec![free],
        "b acquires only the free stream"
    );
    let rows = fetch(store, b, &[s, free]).await?;
    assert!(!rows.is_empty());
    assert!(rows.iter().all(|r| r.stream_id == free), "{rows:?}");
    assert!(claim_lane(store, b, s, "P1").await?.is_empty());

    assert_eq!(lane(store, s, "P1").await?, before, "a's rows untouched");
    Ok(())
}

/// Rule 5. A lapsed lease is taken over by another instance with attempts + 1; so is a lease
/// whose holder is dead (its wh_service_instances row deleted, or removed by
/// cleanup_dead_instances once its heartbeat aged), without waiting for expiry. Catches: no bump
/// on a takeover from another instance, waiting for expiry despite a dead holder, a cleanup that
/// removes live instances or keeps stale ones.
#[tokio::test]
async fn lapsed_or_dead_holder_lease_is_taken_over_with_bump() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let b = live_instance(store).await?;

    let take_over = |stream: Uuid, expect_lease_valid_before: bool| async move {
        let before = lane(store, stream, "P1").await?;
        assert_eq!(
            lease_valid(store, before[0].event_work_id).await?,
            expect_lease_valid_before
        );
        let heads = orphaned(store, b).await?;
        assert_eq!(
            heads.iter().map(|h| h.event_work_id).collect::<Vec<_>>(),
            vec![before[0].event_work_id],
            "b takes over exactly the head of that lane"
        );
        let rows = fetch(store, b, &[stream]).await?;
        assert_eq!(rows.len(), 2);
        assert!(rows.iter().all(|r| r.attempts == 2), "{rows:?}");
        for w in lane(store, stream, "P1").await? {
            assert_eq!((w.attempts, w.instance_id), (2, Some(b.0)), "{w:?}");
            assert!(lease_valid(store, w.event_work_id).await?);
        }
        anyhow::Ok(())
    };

    // Expired lease of a live holder.
    let a1 = live_instance(store).await?;
    let s1 = Uuid::new_v4();
    append(store, s1, &["A", "B"]).await?;
    let rows = claim_streams(store, a1, &[s1]).await?;
    assert_eq!(rows.len(), 2);
    assert!(
        orphaned(store, b).await?.is_empty(),
        "valid lease of a live holder"
    );
    expire(store, &ids_of(&rows)).await?;
    take_over(s1, false).await?;

    // Valid lease of a holder whose instance row is gone (deregistered without release).
    let a2 = live_instance(store).await?;
    let s2 = Uuid::new_v4();
    append(store, s2, &["A", "B"]).await?;
    assert_eq!(claim_streams(store, a2, &[s2]).await?.len(), 2);
    assert!(orphaned(store, b).await?.is_empty());
    sqlx::query("DELETE FROM wh_service_instances WHERE instance_id = $1")
        .bind(a2.0)
        .execute(store.pool())
        .await?;
    take_over(s2, true).await?;

    // Valid lease of a holder silent too long, removed by cleanup_dead_instances.
    let a3 = live_instance(store).await?;
    let s3 = Uuid::new_v4();
    append(store, s3, &["A", "B"]).await?;
    assert_eq!(claim_streams(store, a3, &[s3]).await?.len(), 2);
    sqlx::query(
        "UPDATE wh_service_instances SET last_heartbeat_at = now() - interval '1 hour' \
         WHERE instance_id = $1",
    )
    .bind(a3.0)
    .execute(store.pool())
    .await?;
    let removed = store
        .cleanup_dead_instances(Duration::from_secs(60))
        .await?;
    assert_eq!(removed, vec![a3.0], "only the silent instance is removed");
    assert_eq!(
        count(store, "SELECT count(*) FROM wh_service_instances").await?,
        2,
        "a1 and b stay registered"
    );
    take_over(s3, true).await?;
    Ok(())
}

// ------------------------------------------------------------------------------------------
// §1.4 Ordering and failure
// ------------------------------------------------------------------------------------------

/// Rule 6. record_perspective_event_failure: failures + 1, last_error set, lease cleared,
/// attempts untouched, parked until scheduled_for (by the interval or by p_retry_after_seconds);
/// no claim function takes it before, any takes it after, and that claim bumps attempts (even
/// for the instance that failed it). Catches: not clearing the lease, not parking (claimable at
/// once), ignoring scheduled_for in a claim, bumping attempts in the failure itself, losing
/// failures/last_error on the next claim.
#[tokio::test]
async fn failure_parks_the_row_until_scheduled_for() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let a = live_instance(store).await?;
    let b = live_instance(store).await?;
    let s = Uuid::new_v4();
    append(store, s, &["A"]).await?;
    let id = claim_streams(store, a, &[s]).await?[0].event_work_id;

    assert!(
        vantage::internals::leases::record_failure(
            store.pool(),
            a,
            id,
            "boom",
            Duration::from_secs(3600)
        )
        .await?
    );
    let w = must_work(store, id).await?;
    assert_eq!(
        (
            w.attempts,
            w.failures,
            w.last_error.as_deref(),
            w.instance_id,
            w.lease_expiry
        ),
        (1, 1, Some("boom"), None, None)
    );
    let parked: bool = sqlx::query_scalar(
        "SELECT scheduled_for > now() + interval '59 minutes' FROM wh_perspective_events \
         WHERE event_work_id = $1",
    )
    .bind(id)
    .fetch_one(store.pool())
    .await?;
    assert!(parked, "parked for the backoff: {w:?}");

    // Not claimable before scheduled_for, by anyone, through any claim function.
    for inst in [a, b] {
        assert!(orphaned(store, inst).await?.is_empty());
        assert!(fetch(store, inst, &[s]).await?.is_empty());
        assert!(claim_lane(store, inst, s, "P1").await?.is_empty());
    }
    assert_eq!(
        must_work(store, id).await?,
        w,
        "nothing changed while parked"
    );

    // The contract's own signature: a backoff in whole seconds (no interval override).
    let s2 = Uuid::new_v4();
    append(store, s2, &["A"]).await?;
    let id2 = fetch(store, a, &[s2]).await?[0].event_work_id;
    let ok: bool = sqlx::query_scalar("SELECT record_perspective_event_failure($1, $2, 'bad', 30)")
        .bind(a.0)
        .bind(id2)
        .fetch_one(store.pool())
        .await?;
    assert!(ok);
    let in_window: bool = sqlx::query_scalar(
        "SELECT scheduled_for BETWEEN now() + interval '29 seconds' AND now() + interval '31 seconds' \
         FROM wh_perspective_events WHERE event_work_id = $1",
    )
    .bind(id2)
    .fetch_one(store.pool())
    .await?;
    assert!(in_window, "parked for p_retry_after_seconds");

    // Once due it is claimable again, and the claim is a takeover: attempts + 1.
    poke(
        store,
        "UPDATE wh_perspective_events SET scheduled_for = now() - interval '1 second' \
         WHERE event_work_id = ANY ($1)",
        &[id],
    )
    .await?;
    let heads = orphaned(store, a).await?;
    assert_eq!(
        heads.iter().map(|h| h.event_work_id).collect::<Vec<_>>(),
        vec![id],
        "the due row is claimed, the row still parked (s2) is not"
    );
    let rows = fetch(store, a, &[s]).await?;
    assert_eq!((rows[0].attempts, rows[0].failures), (2, 1));
    let w = must_work(store, id).await?;
    assert_eq!(
        (
            w.attempts,
            w.failures,
            w.last_error.as_deref(),
            w.instance_id
        ),
        (2, 1, Some("boom"), Some(a.0))
    );

    // A second failure with no backoff: failures 2, attempts still 2, due at once; b's claim
    // bumps attempts to 3.
    assert!(
        vantage::internals::leases::record_failure(
            store.pool(),
            a,
            id,
            "boom again",
            Duration::ZERO
        )
        .await?
    );
    let w = must_work(store, id).await?;
    assert_eq!(
        (
            w.attempts,
            w.failures,
            w.last_error.as_deref(),
            w.instance_id
        ),
        (2, 2, Some("boom again"), None)
    );
    let rows = fetch(store, b, &[s]).await?;
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].attempts, rows[0].failures), (3, 2));
    Ok(())
}

/// A lane whose head failed before gives the daemon's claim its head alone (migration 0025):
/// the head usually fails again, and every row leased behind it was given back at each retry
/// (a requeue of 7 700 dead letters on 400 lanes cost ~40 000 failures, each leasing and
/// releasing dozens of rows). Once the head applies, the next claim takes the rest, in order;
/// a lane whose head never failed still comes whole. Catches: a claim that leases a retrying
/// head's whole prefix, or that leaves the rest of the lane stranded once the head is done.
#[tokio::test]
async fn a_lane_whose_head_failed_before_is_claimed_head_only() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let a = live_instance(store).await?;
    let (retrying, fresh) = (Uuid::new_v4(), Uuid::new_v4());
    append(store, retrying, &["A", "B", "C"]).await?;
    append(store, fresh, &["A", "B", "C"]).await?;

    let first = store.claim_work(a, LEASE, 10, 10, None).await?;
    assert_eq!(first.len(), 6, "both lanes whole: {first:?}");
    let head = first
        .iter()
        .find(|r| r.stream_id == retrying && r.stream_version == 1)
        .expect("the retrying lane's head")
        .event_work_id;
    // The head fails (due again at once); the rest is given back, as the careful pass does.
    assert!(
        vantage::internals::leases::record_failure(store.pool(), a, head, "boom", Duration::ZERO)
            .await?
    );
    let rest: Vec<Uuid> = first
        .iter()
        .map(|r| r.event_work_id)
        .filter(|id| *id != head)
        .collect();
    vantage::internals::leases::release_unstarted(store.pool(), a, &rest).await?;

    let second = store.claim_work(a, LEASE, 10, 10, None).await?;
    let of = |rows: &[WorkRow], stream: Uuid| -> Vec<(i32, i32)> {
        rows.iter()
            .filter(|r| r.stream_id == stream)
            .map(|r| (r.stream_version, r.failures))
            .collect()
    };
    assert_eq!(
        of(&second, retrying),
        vec![(1, 1)],
        "the retrying lane: its head alone"
    );
    assert_eq!(
        of(&second, fresh),
        vec![(1, 0), (2, 0), (3, 0)],
        "a lane whose head never failed: whole"
    );
    let behind = lane(store, retrying, "P1").await?;
    assert!(
        behind
            .iter()
            .skip(1)
            .all(|w| w.instance_id.is_none() && w.attempts == 0),
        "nothing leased or charged behind the head: {behind:?}"
    );

    // The head applies this time: the next claim takes the rest of its lane, in order.
    vantage::internals::leases::complete(store.pool(), a, &ids_of(&second)).await?;
    let third = store.claim_work(a, LEASE, 10, 10, None).await?;
    assert_eq!(of(&third, retrying), vec![(2, 0), (3, 0)]);
    Ok(())
}

/// Rule 7. Head-of-line gate: rows behind a parked row, and behind a row leased by another live
/// instance, in the same (stream, perspective) are neither claimed nor returned by any claim
/// function; rows of other streams, and of the same stream in another perspective, are.
/// Catches: get_stream_events filtering rows one by one instead of by lane prefix, claim_orphaned
/// acquiring a non-head row, gating per stream instead of per lane (or not at all).
#[tokio::test]
async fn head_of_line_gate_blocks_only_the_lane() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    perspective(store, "P2", &["*"]).await?;
    let a = live_instance(store).await?;
    let b = live_instance(store).await?;
    let parked_stream = Uuid::new_v4();
    let leased_stream = Uuid::new_v4();
    let free_stream = Uuid::new_v4();
    let lane_stream = Uuid::new_v4();
    for s in [parked_stream, leased_stream, free_stream, lane_stream] {
        append(store, s, &["A", "B", "C"]).await?;
    }
    let p1 = names(&["P1"]);

    // (parked_stream, P1): b leases the head only and fails it: parked for an hour.
    let head = store
        .get_stream_events(b, &[parked_stream], LEASE, Some(p1.as_slice()), Some(1))
        .await?;
    assert_eq!(head.len(), 1);
    assert_eq!(head[0].stream_version, 1);
    assert!(
        vantage::internals::leases::record_failure(
            store.pool(),
            b,
            head[0].event_work_id,
            "boom",
            Duration::from_secs(3600)
        )
        .await?
    );
    // (leased_stream, P1): b leases the head only and keeps it.
    let head = store
        .get_stream_events(b, &[leased_stream], LEASE, Some(p1.as_slice()), Some(1))
        .await?;
    assert_eq!(head.len(), 1);
    assert_eq!(head[0].stream_version, 1);

    let blocked = [(parked_stream, "P1"), (leased_stream, "P1")];
    let mut blocked_before = Vec::new();
    for (s, p) in blocked {
        let l = lane(store, s, p).await?;
        assert!(
            l[1..]
                .iter()
                .all(|w| w.instance_id.is_none() && w.attempts == 0),
            "rows behind the head are unowned and due: {l:?}"
        );
        blocked_before.push(l);
    }

    let is_blocked = |stream: Uuid, p: &str| blocked.contains(&(stream, p));

    // claim_orphaned: never a row of a blocked lane; one head per other stream.
    let heads = orphaned(store, a).await?;
    assert!(
        heads
            .iter()
            .all(|h| !is_blocked(h.stream_id, &h.perspective_name)),
        "{heads:?}"
    );
    let head_streams: BTreeSet<Uuid> = heads.iter().map(|h| h.stream_id).collect();
    assert_eq!(
        head_streams,
        [parked_stream, leased_stream, free_stream, lane_stream].into(),
        "every stream has a claimable lane"
    );

    // claim_and_fetch_pending: nothing of the blocked lanes; a fresh lane is claimed.
    for (s, p) in blocked {
        assert!(claim_lane(store, a, s, p).await?.is_empty(), "{p} of {s}");
    }
    let lane_rows = claim_lane(store, a, lane_stream, "P1").await?;
    assert_eq!(
        lane_rows.iter().map(|r| r.2).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );

    // get_stream_events: everything but the blocked lanes.
    let rows = fetch(
        store,
        a,
        &[parked_stream, leased_stream, free_stream, lane_stream],
    )
    .await?;
    let got: BTreeSet<(Uuid, String, i32)> = rows
        .iter()
        .map(|r| (r.stream_id, r.perspective_name.clone(), r.stream_version))
        .collect();
    let mut want = BTreeSet::new();
    for s in [parked_stream, leased_stream, free_stream, lane_stream] {
        for p in ["P1", "P2"] {
            if !is_blocked(s, p) {
                for v in 1..=3 {
                    want.insert((s, p.to_string(), v));
                }
            }
        }
    }
    assert_eq!(got, want);

    // A second instance sees no more than a does.
    let c = live_instance(store).await?;
    assert!(orphaned(store, c).await?.is_empty());
    assert!(fetch(store, c, &[parked_stream, leased_stream])
        .await?
        .is_empty());

    for ((s, p), before) in blocked.iter().zip(blocked_before) {
        assert_eq!(lane(store, *s, p).await?, before, "blocked lane untouched");
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Dead letters
// ------------------------------------------------------------------------------------------

#[derive(Debug, PartialEq, sqlx::FromRow)]
struct DeadLetterRow {
    dead_letter_id: Uuid,
    source_table: String,
    source_id: Uuid,
    stream_id: Uuid,
    event_id: Uuid,
    global_position: i64,
    stream_version: i32,
    event_type: Option<String>,
    perspective_name: String,
    failure_reason: String,
    error_text: Option<String>,
    attempts_when_dlq: i32,
    failures_when_dlq: i32,
    dead_lettered_by: Option<Uuid>,
    status: String,
    status_changed_at: DateTime<Utc>,
}

async fn dead_letters(store: &Store) -> anyhow::Result<Vec<DeadLetterRow>> {
    Ok(sqlx::query_as(
        "SELECT dead_letter_id, source_table, source_id, stream_id, event_id, global_position, \
                stream_version, event_type, perspective_name, failure_reason, error_text, \
                attempts_when_dlq, failures_when_dlq, dead_lettered_by, status, status_changed_at \
         FROM wh_dead_letters ORDER BY dead_lettered_at, dead_letter_id",
    )
    .fetch_all(store.pool())
    .await?)
}

async fn history_kinds(store: &Store, id: Uuid) -> anyhow::Result<Vec<String>> {
    Ok(store
        .dead_letter_history(id)
        .await?
        .into_iter()
        .map(|h| h.kind)
        .collect())
}

/// Rule 8. move_to_dead_letters deletes the work row and inserts the dead letter atomically
/// (neither visible from outside before commit, both after), copies the row's fields,
/// carries last_error into error_text, writes one Exhausted record, returns NULL the second time
/// and raises for an unknown source table without changing anything. Catches: a non-atomic
/// two-step move, a wrong or missing copied field (stream_version ≠ global_position here, so a
/// swap shows), dropping last_error, a duplicate dead letter or history record on a repeated
/// move, silently accepting an unknown table.
#[tokio::test]
async fn move_to_dead_letters_is_atomic_and_idempotent() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let a = live_instance(store).await?;
    // Another stream first, so global positions and stream versions differ.
    append(store, Uuid::new_v4(), &["X", "X", "X"]).await?;
    let s = Uuid::new_v4();
    let appended = append(store, s, &["Fine", "Poison", "Later"]).await?;
    let rows = claim_streams(store, a, &[s]).await?;
    assert_eq!(rows.len(), 3);
    let poison = work_id(store, appended[1].event_id, "P1").await?;
    let later = work_id(store, appended[2].event_id, "P1").await?;
    poke(
        store,
        "UPDATE wh_perspective_events SET attempts = 11, failures = 3, last_error = 'kaboom' \
         WHERE event_work_id = ANY ($1)",
        &[poison],
    )
    .await?;

    let dl_id = Uuid::new_v4();
    let both = "SELECT (SELECT count(*) FROM wh_perspective_events WHERE event_work_id = $1), \
                       (SELECT count(*) FROM wh_dead_letters WHERE source_id = $1)";
    let mut tx = store.pool().begin().await?;
    let moved: Option<Uuid> =
        sqlx::query_scalar("SELECT move_to_dead_letters($1, $2, $3, $4, $5, $6)")
            .bind(dl_id)
            .bind(SOURCE_TABLE)
            .bind(poison)
            .bind(FAILURE_MAX_ATTEMPTS)
            .bind("too many attempts")
            .bind(a.0)
            .fetch_one(&mut *tx)
            .await?;
    assert_eq!(moved, Some(dl_id));
    let outside: (i64, i64) = sqlx::query_as(both)
        .bind(poison)
        .fetch_one(store.pool())
        .await?;
    assert_eq!(outside, (1, 0), "nothing visible before commit");
    tx.commit().await?;
    let after: (i64, i64) = sqlx::query_as(both)
        .bind(poison)
        .fetch_one(store.pool())
        .await?;
    assert_eq!(after, (0, 1), "both visible together after commit");

    let dls = dead_letters(store).await?;
    assert_eq!(dls.len(), 1);
    let dl = &dls[0];
    let error_text = dl.error_text.clone().unwrap_or_default();
    assert!(error_text.contains("too many attempts"), "{error_text}");
    assert!(
        error_text.contains("kaboom"),
        "carries last_error: {error_text}"
    );
    assert_eq!(
        (
            dl.dead_letter_id,
            dl.source_table.as_str(),
            dl.source_id,
            dl.stream_id,
            dl.event_id,
            dl.global_position,
            dl.stream_version,
        ),
        (
            dl_id,
            SOURCE_TABLE,
            poison,
            s,
            appended[1].event_id,
            appended[1].global_position,
            2,
        )
    );
    assert_eq!(
        (
            dl.event_type.as_deref(),
            dl.perspective_name.as_str(),
            dl.failure_reason.as_str(),
            dl.attempts_when_dlq,
            dl.failures_when_dlq,
            dl.dead_lettered_by,
            dl.status.as_str(),
        ),
        (
            Some("Poison"),
            "P1",
            FAILURE_MAX_ATTEMPTS,
            11,
            3,
            Some(a.0),
            "exhausted",
        )
    );
    assert_eq!(appended[1].global_position, 5);
    assert_eq!(history_kinds(store, dl_id).await?, vec!["Exhausted"]);

    // Second time: NULL, nothing new.
    let again = vantage::internals::leases::move_to_dead_letters(
        store.pool(),
        a,
        poison,
        FAILURE_MAX_ATTEMPTS,
        "again",
    )
    .await?;
    assert_eq!(again, MoveOutcome::AlreadyGone);
    assert_eq!(dead_letters(store).await?, dls);
    assert_eq!(history_kinds(store, dl_id).await?, vec!["Exhausted"]);

    // Unknown source table: raises, changes nothing.
    let before = all_work(store).await?;
    let err = sqlx::query_scalar::<_, Option<Uuid>>(
        "SELECT move_to_dead_letters($1, 'wh_nonexistent', $2, $3, 'x', $4)",
    )
    .bind(Uuid::new_v4())
    .bind(later)
    .bind(FAILURE_MAX_ATTEMPTS)
    .bind(a.0)
    .fetch_one(store.pool())
    .await;
    assert!(err.is_err(), "unknown source table must raise: {err:?}");
    assert_eq!(all_work(store).await?, before);
    assert_eq!(dead_letters(store).await?, dls);
    assert_eq!(
        count(store, "SELECT count(*) FROM wh_dead_letter_history").await?,
        1
    );
    Ok(())
}

/// Rule 11. requeue_dead_letter works once: the work row is back (attempts 0, unleased, due now
/// and claimable), status 'requeued', a Requeued record; a second call returns false and changes
/// nothing; exhausting the requeued message again reopens the same dead letter (same id, status
/// exhausted, history Exhausted, Requeued, Exhausted). Catches: a requeue that is not a
/// compare-and-set, a re-inserted row keeping the old attempts (instant re-dead-lettering) or a
/// lease, a missing history record, minting a second dead letter per message.
#[tokio::test]
async fn requeue_dead_letter_once_then_reopen() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let a = live_instance(store).await?;
    let s = Uuid::new_v4();
    let appended = append(store, s, &["Poison"]).await?;
    let id = claim_streams(store, a, &[s]).await?[0].event_work_id;
    poke(
        store,
        "UPDATE wh_perspective_events SET attempts = 11, failures = 2, last_error = 'kaboom' \
         WHERE event_work_id = ANY ($1)",
        &[id],
    )
    .await?;
    let MoveOutcome::Moved(dl_id) = vantage::internals::leases::move_to_dead_letters(
        store.pool(),
        a,
        id,
        FAILURE_MAX_ATTEMPTS,
        "first",
    )
    .await?
    else {
        panic!("the row is there to move");
    };
    assert_eq!(
        count(store, "SELECT count(*) FROM wh_perspective_events").await?,
        0
    );

    assert!(store.requeue_dead_letter(dl_id, "ops").await?);
    let rows = all_work(store).await?;
    assert_eq!(rows.len(), 1);
    let w = &rows[0];
    assert_eq!(
        (
            w.event_id,
            w.stream_id,
            w.stream_version,
            w.perspective_name.as_str()
        ),
        (appended[0].event_id, s, 1, "P1")
    );
    assert_eq!((w.attempts, w.instance_id, w.lease_expiry), (0, None, None));
    let due: bool = sqlx::query_scalar(
        "SELECT scheduled_for <= now() FROM wh_perspective_events WHERE event_work_id = $1",
    )
    .bind(w.event_work_id)
    .fetch_one(store.pool())
    .await?;
    assert!(due, "due now");
    let dl = store.dead_letter(dl_id).await?.expect("still recorded");
    assert_eq!(dl.status, "requeued");
    let history = store.dead_letter_history(dl_id).await?;
    assert_eq!(
        history
            .iter()
            .map(|h| (h.kind.as_str(), h.actor.as_str()))
            .collect::<Vec<_>>()[1],
        ("Requeued", "ops")
    );
    assert_eq!(
        history_kinds(store, dl_id).await?,
        vec!["Exhausted", "Requeued"]
    );

    // It is claimable, as a first claim.
    let rows = claim_streams(store, a, &[s]).await?;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].attempts, 1);

    // A second requeue: false, nothing changes.
    let work_before = all_work(store).await?;
    let dls_before = dead_letters(store).await?;
    assert!(!store.requeue_dead_letter(dl_id, "ops").await?);
    assert_eq!(all_work(store).await?, work_before);
    assert_eq!(dead_letters(store).await?, dls_before);
    assert_eq!(
        history_kinds(store, dl_id).await?,
        vec!["Exhausted", "Requeued"]
    );

    // Exhausted again: the same dead letter is reopened.
    poke(
        store,
        "UPDATE wh_perspective_events SET attempts = 11 WHERE event_work_id = ANY ($1)",
        &[rows[0].event_work_id],
    )
    .await?;
    let again = vantage::internals::leases::move_to_dead_letters(
        store.pool(),
        a,
        rows[0].event_work_id,
        FAILURE_MAX_ATTEMPTS,
        "second",
    )
    .await?;
    assert_eq!(
        again,
        MoveOutcome::Moved(dl_id),
        "reopened, not minted anew"
    );
    let dls = dead_letters(store).await?;
    assert_eq!(dls.len(), 1, "one dead letter per message: {dls:?}");
    assert_eq!(dls[0].status, "exhausted");
    assert_eq!(dls[0].attempts_when_dlq, 11);
    assert!(dls[0]
        .error_text
        .as_deref()
        .unwrap_or("")
        .contains("second"));
    assert_eq!(
        history_kinds(store, dl_id).await?,
        vec!["Exhausted", "Requeued", "Exhausted"]
    );
    assert_eq!(
        count(store, "SELECT count(*) FROM wh_perspective_events").await?,
        0
    );
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Fencing and release
// ------------------------------------------------------------------------------------------

/// Rule 9. complete_perspective_events, renew_leases and record_perspective_event_failure do
/// nothing for a non-holder (a live instance, an unknown id, the former holder after a
/// takeover): 0 / false, row unchanged. The holder's calls succeed (so the test is not vacuous).
/// move_to_dead_letters, made on behalf of a lease too, leaves another instance's row alone.
/// Catches: any of these missing its `instance_id = p_instance_id` fence.
#[tokio::test]
async fn non_holder_cannot_complete_renew_or_fail() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let a = live_instance(store).await?;
    let b = live_instance(store).await?;
    let s = Uuid::new_v4();
    append(store, s, &["A", "B"]).await?;
    let rows = claim_streams(store, a, &[s]).await?;
    let (r1, r2) = (rows[0].event_work_id, rows[1].event_work_id);
    let before = all_work(store).await?;

    let stranger = InstanceId::new();
    for other in [b, stranger] {
        assert_eq!(
            vantage::internals::leases::complete(store.pool(), other, &[r1, r2]).await?,
            0
        );
        assert_eq!(
            vantage::internals::leases::renew_leases(store.pool(), other, &[r1, r2], LEASE).await?,
            0
        );
        assert!(
            !vantage::internals::leases::record_failure(
                store.pool(),
                other,
                r1,
                "not mine",
                Duration::from_secs(5)
            )
            .await?
        );
        assert_eq!(
            vantage::internals::leases::move_to_dead_letters(
                store.pool(),
                other,
                r1,
                FAILURE_MAX_ATTEMPTS,
                "not mine"
            )
            .await?,
            MoveOutcome::AlreadyGone
        );
        assert_eq!(all_work(store).await?, before, "rows unchanged by {other}");
    }

    // The holder can.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        vantage::internals::leases::renew_leases(store.pool(), a, &[r1, r2], LEASE).await?,
        2
    );
    let renewed = must_work(store, r2).await?;
    assert!(
        renewed.lease_expiry > before[1].lease_expiry,
        "renewed: {renewed:?}"
    );
    assert_eq!(
        vantage::internals::leases::complete(store.pool(), a, &[r1]).await?,
        1
    );
    assert!(work(store, r1).await?.is_none());

    // After a takeover the former holder is fenced off.
    expire(store, &[r2]).await?;
    let taken = fetch(store, b, &[s]).await?;
    assert_eq!(ids_of(&taken), vec![r2]);
    let held_by_b = must_work(store, r2).await?;
    assert_eq!(
        vantage::internals::leases::complete(store.pool(), a, &[r2]).await?,
        0
    );
    assert_eq!(
        vantage::internals::leases::renew_leases(store.pool(), a, &[r2], LEASE).await?,
        0
    );
    assert!(
        !vantage::internals::leases::record_failure(
            store.pool(),
            a,
            r2,
            "stale",
            Duration::from_secs(5)
        )
        .await?
    );
    assert_eq!(
        vantage::internals::leases::move_to_dead_letters(
            store.pool(),
            a,
            r2,
            FAILURE_MAX_ATTEMPTS,
            "stale"
        )
        .await?,
        MoveOutcome::AlreadyGone
    );
    assert_eq!(must_work(store, r2).await?, held_by_b);
    assert_eq!(
        count(store, "SELECT count(*) FROM wh_dead_letters").await?,
        0
    );
    assert_eq!(
        vantage::internals::leases::complete(store.pool(), b, &[r2]).await?,
        1
    );
    Ok(())
}

/// Rule 9, the daemon's batch as a statement of its own (`wh_apply_and_complete_perspective_events_all_or_nothing`, 0019):
/// when a row of the batch is not the caller's, it raises `VL001` and nothing of the batch is
/// kept (the statements' writes roll back, the caller's rows stay); when every row is, the
/// writes and the completion commit together. Catches: the check missing or after the fact (a
/// write kept for rows another instance will apply again), a completion kept although the
/// batch failed, the all-ours case refused.
#[tokio::test]
async fn a_batch_applied_alone_keeps_nothing_when_a_row_is_not_ours() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    sqlx::query("CREATE TABLE public.alone_applied (v int)")
        .execute(store.pool())
        .await?;
    let a = live_instance(store).await?;
    let b = live_instance(store).await?;
    let (s, t) = (Uuid::new_v4(), Uuid::new_v4());
    append(store, s, &["A", "B"]).await?;
    let mine = claim_streams(store, a, &[s]).await?;
    append(store, t, &["A"]).await?;
    let theirs = claim_streams(store, b, &[t]).await?;
    assert_eq!((mine.len(), theirs.len()), (2, 1));
    let call = |ids: Vec<Uuid>| {
        sqlx::query_scalar::<_, i32>(
            "SELECT wh_apply_and_complete_perspective_events_all_or_nothing($1, $2, \
             ARRAY['INSERT INTO public.alone_applied VALUES ($6)'], $3, \
             NULL, NULL, NULL, NULL, NULL, $4, NULL)",
        )
        .bind(a.0)
        .bind(ids.clone())
        .bind(vec![1i32; ids.len()])
        .bind((1..=ids.len() as i32).collect::<Vec<i32>>())
        .fetch_one(store.pool())
    };
    let applied = || sqlx::query_scalar::<_, i64>("SELECT count(*) FROM public.alone_applied");

    let refused = call(vec![mine[0].event_work_id, theirs[0].event_work_id])
        .await
        .expect_err("a row of another instance's in the batch");
    assert_eq!(sqlstate(&refused).as_deref(), Some("VL001"), "{refused}");
    assert_eq!(
        applied().fetch_one(store.pool()).await?,
        0,
        "writes rolled back"
    );
    assert!(
        work(store, mine[0].event_work_id).await?.is_some(),
        "ours not completed"
    );
    assert!(work(store, theirs[0].event_work_id).await?.is_some());

    let ids: Vec<Uuid> = mine.iter().map(|r| r.event_work_id).collect();
    assert_eq!(call(ids.clone()).await?, 2);
    assert_eq!(applied().fetch_one(store.pool()).await?, 2);
    for id in ids {
        assert!(work(store, id).await?.is_none(), "{id} completed");
    }
    Ok(())
}

/// Rule 10. release_unstarted_leases unleases with a refund (attempts − 1, never below 0) and
/// only the caller's rows; deregister_instance releases every lease of the instance with the
/// same refund and removes it. Catches: no refund, a refund going negative, a release that is not
/// fenced, a deregistration that leaves leases behind (lanes stuck until expiry) or does not
/// refund.
#[tokio::test]
async fn release_and_deregister_refund_attempts() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let a = live_instance(store).await?;
    let b = live_instance(store).await?;
    let s = Uuid::new_v4();
    append(store, s, &["A", "B", "C"]).await?;
    let rows = claim_streams(store, a, &[s]).await?;
    let ids = ids_of(&rows);
    poke(
        store,
        "UPDATE wh_perspective_events SET attempts = 5 WHERE event_work_id = ANY ($1)",
        &ids[1..2],
    )
    .await?;
    poke(
        store,
        "UPDATE wh_perspective_events SET attempts = 0 WHERE event_work_id = ANY ($1)",
        &ids[2..3],
    )
    .await?;

    let before = all_work(store).await?;
    assert_eq!(
        vantage::internals::leases::release_unstarted(store.pool(), b, &ids).await?,
        0,
        "fenced"
    );
    assert_eq!(all_work(store).await?, before);

    assert_eq!(
        vantage::internals::leases::release_unstarted(store.pool(), a, &ids).await?,
        3
    );
    let l = lane(store, s, "P1").await?;
    assert_eq!(
        l.iter().map(|w| w.attempts).collect::<Vec<_>>(),
        vec![0, 4, 0]
    );
    assert!(l
        .iter()
        .all(|w| w.instance_id.is_none() && w.lease_expiry.is_none()));
    // Claimable again at once, and the refunded claim counts as the first again.
    let again = fetch(store, b, &[s]).await?;
    assert_eq!(
        again.iter().map(|r| r.attempts).collect::<Vec<_>>(),
        vec![1, 5, 1]
    );

    // deregister_instance: releases every lease of the instance with a refund, and removes it.
    let c = live_instance(store).await?;
    let s2 = Uuid::new_v4();
    append(store, s2, &["A", "B"]).await?;
    let rows = claim_streams(store, c, &[s2]).await?;
    assert_eq!(rows.len(), 2);
    poke(
        store,
        "UPDATE wh_perspective_events SET attempts = 3 WHERE event_work_id = ANY ($1)",
        &[rows[1].event_work_id],
    )
    .await?;
    assert_eq!(store.deregister(c).await?, 2);
    let l = lane(store, s2, "P1").await?;
    assert_eq!(l.iter().map(|w| w.attempts).collect::<Vec<_>>(), vec![0, 2]);
    assert!(l
        .iter()
        .all(|w| w.instance_id.is_none() && w.lease_expiry.is_none()));
    let registered: i64 =
        sqlx::query_scalar("SELECT count(*) FROM wh_service_instances WHERE instance_id = $1")
            .bind(c.0)
            .fetch_one(store.pool())
            .await?;
    assert_eq!(registered, 0, "deregistered");
    // b's leases are not touched by c's deregistration.
    assert!(lane(store, s, "P1")
        .await?
        .iter()
        .all(|w| w.instance_id == Some(b.0)));
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Producers
// ------------------------------------------------------------------------------------------

async fn perspectives_of(store: &Store, event_id: Uuid) -> anyhow::Result<Vec<String>> {
    Ok(sqlx::query_scalar(
        "SELECT perspective_name FROM wh_perspective_events WHERE event_id = $1 ORDER BY 1",
    )
    .bind(event_id)
    .fetch_all(store.pool())
    .await?)
}

async fn notified(listener: &mut PgListener) -> anyhow::Result<String> {
    let n = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .map_err(|_| anyhow::anyhow!("no notification on vantage_work within 10 s"))??;
    Ok(n.channel().to_string())
}

/// Integers in `text`, once the stream id is taken out.
fn numbers_in(text: &str, stream: Uuid) -> BTreeSet<i64> {
    text.replace(&stream.to_string(), " ")
        .split(|c: char| !c.is_ascii_digit())
        .filter(|t| !t.is_empty())
        .filter_map(|t| t.parse().ok())
        .collect()
}

/// Rule 12. append_events: versions 1..n and on; the expected version is checked (mismatch →
/// SQLSTATE 40001, `StoreError::Conflict`, naming the stream and both versions, nothing
/// written; NULL = any); one work row per subscribed perspective (`*` = all, unsubscribed types
/// none); NOTIFY on `vantage_work`. Catches: a missing or wrong version check, a partial write
/// on conflict, a fan-out ignoring `*` or subscribing everyone, no notification.
#[tokio::test]
async fn append_events_checks_versions_and_fans_out() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["A", "B"]).await?;
    perspective(store, "P2", &["*"]).await?;
    perspective(store, "P3", &["C"]).await?;
    let mut listener = PgListener::connect(&ctx.db.url).await?;
    listener.listen("vantage_work").await?;

    let s = Uuid::new_v4();
    let first = store
        .append_events(s, Some(0), &events(&["A", "B", "X"]))
        .await?;
    assert_eq!(
        first.iter().map(|e| e.stream_version).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert!(first
        .windows(2)
        .all(|w| w[0].global_position < w[1].global_position));
    assert_eq!(notified(&mut listener).await?, "vantage_work");
    assert_eq!(
        perspectives_of(store, first[0].event_id).await?,
        vec!["P1", "P2"]
    );
    assert_eq!(
        perspectives_of(store, first[1].event_id).await?,
        vec!["P1", "P2"]
    );
    assert_eq!(perspectives_of(store, first[2].event_id).await?, vec!["P2"]);
    assert_eq!(
        count(
            store,
            "SELECT count(*) FROM wh_perspective_events WHERE perspective_name = 'P3'"
        )
        .await?,
        0
    );
    let stored: Vec<(Uuid, i32, String)> = sqlx::query_as(
        "SELECT event_id, stream_version, event_type FROM wh_event_store \
         WHERE stream_id = $1 ORDER BY stream_version",
    )
    .bind(s)
    .fetch_all(store.pool())
    .await?;
    assert_eq!(
        stored,
        first
            .iter()
            .zip(["A", "B", "X"])
            .map(|(e, t)| (e.event_id, e.stream_version, t.to_string()))
            .collect::<Vec<_>>()
    );

    // A stale expected version: Conflict naming the stream and both versions; nothing written.
    let events_before = count(store, "SELECT count(*) FROM wh_event_store").await?;
    let work_before = all_work(store).await?;
    match store.append_events(s, Some(7), &events(&["A"])).await {
        Err(StoreError::Conflict(message)) => {
            assert!(
                message.contains(&s.to_string()),
                "names the stream: {message}"
            );
            let numbers = numbers_in(&message, s);
            assert!(
                numbers.contains(&3) && numbers.contains(&7),
                "names both versions (3 current, 7 expected): {message}"
            );
        }
        other => panic!("expected StoreError::Conflict, got {other:?}"),
    }
    let raw = sqlx::query("SELECT * FROM append_events($1, 1, '[{\"event_type\": \"A\"}]')")
        .bind(s)
        .execute(store.pool())
        .await
        .expect_err("stale expected version");
    assert_eq!(sqlstate(&raw).as_deref(), Some("40001"), "{raw}");
    // A brand-new stream expected at a version it does not have.
    let fresh = Uuid::new_v4();
    assert!(matches!(
        store.append_events(fresh, Some(2), &events(&["A"])).await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(
        count(store, "SELECT count(*) FROM wh_event_store").await?,
        events_before
    );
    assert_eq!(all_work(store).await?, work_before);

    // The right expected version, then NULL = any.
    let next = store.append_events(s, Some(3), &events(&["C"])).await?;
    assert_eq!(
        next.iter().map(|e| e.stream_version).collect::<Vec<_>>(),
        vec![4]
    );
    assert_eq!(
        perspectives_of(store, next[0].event_id).await?,
        vec!["P2", "P3"]
    );
    let any = store.append_events(s, None, &events(&["Y", "Z"])).await?;
    assert_eq!(
        any.iter().map(|e| e.stream_version).collect::<Vec<_>>(),
        vec![5, 6]
    );
    let other = store.append_events(fresh, None, &events(&["Y"])).await?;
    assert_eq!(other[0].stream_version, 1, "each stream counts from 1");
    Ok(())
}

/// Rule 13. A plain INSERT into wh_event_store, from a session whose search_path does not include
/// the schema, fans out in the same transaction (visible inside it, gone on rollback) and
/// notifies. Catches: fan-out done by append_events only (not a trigger), a trigger function
/// resolving tables through the caller's search_path, fan-out outside the inserting transaction.
#[tokio::test]
async fn plain_insert_fans_out_from_any_search_path() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["Plain"]).await?;
    perspective(store, "P2", &["*"]).await?;
    let a = live_instance(store).await?;
    let plain = plain_pool(&ctx.db).await?;
    let path: String = sqlx::query_scalar("SHOW search_path")
        .fetch_one(&plain)
        .await?;
    assert!(
        !path.contains("vantage"),
        "the producer's search_path: {path}"
    );
    let mut listener = PgListener::connect(&ctx.db.url).await?;
    listener.listen("vantage_work").await?;

    let insert =
        "INSERT INTO vantage.wh_event_store (stream_id, stream_version, event_type, event_data) \
                  VALUES ($1, 1, 'Plain', '{\"n\": 1}'), ($1, 2, 'Other', '{\"n\": 2}')";
    let s = Uuid::new_v4();

    // Same transaction: the work rows exist inside it and vanish with a rollback.
    let mut tx = plain.begin().await?;
    sqlx::query(insert).bind(s).execute(&mut *tx).await?;
    let inside: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM vantage.wh_perspective_events WHERE stream_id = $1",
    )
    .bind(s)
    .fetch_one(&mut *tx)
    .await?;
    assert_eq!(inside, 3, "P1 gets 'Plain', P2 gets both");
    tx.rollback().await?;
    assert_eq!(
        count(store, "SELECT count(*) FROM wh_perspective_events").await?,
        0
    );

    sqlx::query(insert).bind(s).execute(&plain).await?;
    assert_eq!(notified(&mut listener).await?, "vantage_work");
    let l1 = lane(store, s, "P1").await?;
    let l2 = lane(store, s, "P2").await?;
    assert_eq!((versions(&l1), versions(&l2)), (vec![1], vec![1, 2]));

    let rows = claim_streams(store, a, &[s]).await?;
    assert_eq!(
        rows.iter()
            .map(|r| (
                r.perspective_name.as_str(),
                r.event_type.as_deref(),
                r.attempts
            ))
            .collect::<Vec<_>>(),
        vec![
            ("P1", Some("Plain"), 1),
            ("P2", Some("Plain"), 1),
            ("P2", Some("Other"), 1)
        ]
    );
    assert_eq!(rows[2].event_data, Some(json!({"n": 2})));
    plain.close().await;
    Ok(())
}

/// Rule 14. A non-default schema works end to end (migrate, append, plain insert, claim,
/// complete), and nothing is created in `vantage` or `public`. Catches: a schema-qualified
/// `vantage.` anywhere in the migrations or the storage code, objects leaking into public,
/// functions not pinned to their schema.
#[tokio::test]
async fn non_default_schema_works() -> TestResult {
    let db = support::fresh_database().await;
    let plain = plain_pool(&db).await?;
    let public_objects = "SELECT (SELECT count(*) FROM pg_class c JOIN pg_namespace n \
                                  ON n.oid = c.relnamespace WHERE n.nspname = 'public') \
                               + (SELECT count(*) FROM pg_proc p JOIN pg_namespace n \
                                  ON n.oid = p.pronamespace WHERE n.nspname = 'public')";
    let public_before: i64 = sqlx::query_scalar(public_objects).fetch_one(&plain).await?;

    let store = connect(&db, "custom_schema").await?;
    let applied = store.migrate().await?;
    assert_eq!(applied.len(), all_migrations().len(), "{applied:?}");
    perspective(&store, "P1", &["*"]).await?;
    let a = live_instance(&store).await?;
    let s = Uuid::new_v4();
    append(&store, s, &["A", "B"]).await?;
    sqlx::query(
        "INSERT INTO custom_schema.wh_event_store (stream_id, stream_version, event_type) \
         VALUES ($1, 3, 'C')",
    )
    .bind(s)
    .execute(&plain)
    .await?;
    let rows = claim_streams(&store, a, &[s]).await?;
    assert_eq!(
        rows.iter()
            .map(|r| (r.stream_version, r.attempts))
            .collect::<Vec<_>>(),
        vec![(1, 1), (2, 1), (3, 1)]
    );
    assert_eq!(
        vantage::internals::leases::complete(store.pool(), a, &ids_of(&rows)).await?,
        3
    );

    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM custom_schema.wh_perspective_events")
        .fetch_one(&plain)
        .await?;
    assert_eq!(left, 0);
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM custom_schema.wh_event_store")
        .fetch_one(&plain)
        .await?;
    assert_eq!(events, 3);
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_tables WHERE schemaname = 'custom_schema' \
         AND tablename IN ('wh_event_store', 'wh_perspectives', 'wh_perspective_events', \
                           'wh_service_instances', 'wh_dead_letters', 'wh_dead_letter_history', \
                           '_sqlx_migrations')",
    )
    .fetch_one(&plain)
    .await?;
    assert_eq!(tables, 7);
    let vantage: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_namespace WHERE nspname = 'vantage'")
            .fetch_one(&plain)
            .await?;
    assert_eq!(vantage, 0, "no vantage schema created");
    let public_after: i64 = sqlx::query_scalar(public_objects).fetch_one(&plain).await?;
    assert_eq!(public_after, public_before, "nothing created in public");

    plain.close().await;
    store.close().await;
    drop(db);
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Concurrency
// ------------------------------------------------------------------------------------------

type Lane = (Uuid, String);

/// One claim round of one instance, as the daemon does it: claim_orphaned, then
/// get_stream_events on the acquired streams, then on a few contested streams (the same for both
/// instances, so they race for the same lanes).
async fn claim_round(
    store: Store,
    instance: InstanceId,
    contested: Vec<Uuid>,
) -> Result<(Vec<ClaimedHead>, Vec<WorkRow>), StoreError> {
    let heads = store.claim_orphaned(instance, LEASE, 2, 2, None).await?;
    let mut acquired: Vec<Uuid> = heads.iter().map(|h| h.stream_id).collect();
    acquired.sort();
    acquired.dedup();
    // At most 2 streams × 2 perspectives = 4 lanes: a budget of 4 always covers every head.
    let mut rows = store
        .get_stream_events(instance, &acquired, LEASE, None, Some(4))
        .await?;
    let others: Vec<Uuid> = contested
        .into_iter()
        .filter(|s| !acquired.contains(s))
        .collect();
    rows.extend(
        store
            .get_stream_events(instance, &others, LEASE, None, Some(2))
            .await?,
    );
    Ok((heads, rows))
}

fn expect_no_deadlock<T>(who: &str, r: Result<T, StoreError>) -> T {
    match r {
        Ok(v) => v,
        Err(StoreError::Database(e)) if sqlstate(&e).as_deref() == Some("40P01") => {
            panic!("{who}: deadlock (40P01): {e}")
        }
        Err(e) => panic!("{who}: {e}"),
    }
}

/// Rule 15. Two registered instances claiming concurrently, round after round (about 90 rounds
/// over 960 rows in 30 streams × 2 perspectives, both instances also racing for the same two
/// streams every round): never the same row, never rows of one lane at the same time, every claim
/// a contiguous prefix of its lane with attempts 1 (no spurious takeover), every leased row
/// returned to its holder, no deadlock (40P01), lanes completed in stream_version order, and
/// everything completed in the end. Catches: a lost SKIP LOCKED, a prefix check done on the
/// snapshot only (two claimers splitting a lane), lock-order deadlocks, rows leased but not
/// returned (see `own_leased_rows_are_returned_while_another_session_locks_them`, which makes
/// that race deterministic).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claimers_never_share_rows_or_lanes() -> TestResult {
    const STREAMS: usize = 30;
    const EVENTS: usize = 16;
    const MAX_ROUNDS: usize = 600;

    let ctx = setup().await?;
    let store = ctx.store.clone();
    perspective(&store, "P1", &["*"]).await?;
    perspective(&store, "P2", &["*"]).await?;
    let streams: Vec<Uuid> = (0..STREAMS).map(|_| Uuid::new_v4()).collect();
    let types = vec!["E"; EVENTS];
    for s in &streams {
        append(&store, *s, &types).await?;
    }
    let total = count(&store, "SELECT count(*) FROM wh_perspective_events").await?;
    assert_eq!(total as usize, STREAMS * EVENTS * 2);
    let a = live_instance(&store).await?;
    let b = live_instance(&store).await?;

    let mut completed: BTreeMap<Lane, Vec<i32>> = BTreeMap::new();
    let mut contended_rounds = 0;
    let mut rounds = 0;
    let mut done = false;
    for round in 0..MAX_ROUNDS {
        if count(&store, "SELECT count(*) FROM wh_perspective_events").await? == 0 {
            done = true;
            break;
        }
        rounds += 1;
        let contested = vec![streams[round % STREAMS], streams[(round * 7 + 3) % STREAMS]];
        let ta = tokio::spawn(claim_round(store.clone(), a, contested.clone()));
        let tb = tokio::spawn(claim_round(store.clone(), b, contested));
        let (ra, rb) = (ta.await?, tb.await?);
        let (heads_a, ra) = expect_no_deadlock("instance a", ra);
        let (heads_b, rb) = expect_no_deadlock("instance b", rb);
        if !ra.is_empty() && !rb.is_empty() {
            contended_rounds += 1;
        }

        // Never the same row; never the same lane.
        let ids_a: HashSet<Uuid> = ra.iter().map(|r| r.event_work_id).collect();
        let ids_b: HashSet<Uuid> = rb.iter().map(|r| r.event_work_id).collect();
        assert_eq!(ids_a.len(), ra.len(), "round {round}: a got a row twice");
        assert_eq!(ids_b.len(), rb.len(), "round {round}: b got a row twice");
        assert!(
            ids_a.is_disjoint(&ids_b),
            "round {round}: a row claimed by both"
        );
        let lanes_a: HashSet<Lane> = ra
            .iter()
            .map(|r| (r.stream_id, r.perspective_name.clone()))
            .collect();
        let lanes_b: HashSet<Lane> = rb
            .iter()
            .map(|r| (r.stream_id, r.perspective_name.clone()))
            .collect();
        assert!(
            lanes_a.is_disjoint(&lanes_b),
            "round {round}: a lane held by both: {:?}",
            lanes_a.intersection(&lanes_b).collect::<Vec<_>>()
        );

        // The database agrees: exactly the returned rows are leased, each to its claimer.
        let leased: Vec<(Uuid, Uuid)> = sqlx::query_as(
            "SELECT event_work_id, instance_id FROM wh_perspective_events \
             WHERE instance_id IS NOT NULL",
        )
        .fetch_all(store.pool())
        .await?;
        let leased: HashMap<Uuid, Uuid> = leased.into_iter().collect();
        let mut expected: HashMap<Uuid, Uuid> = HashMap::new();
        expected.extend(ids_a.iter().map(|id| (*id, a.0)));
        expected.extend(ids_b.iter().map(|id| (*id, b.0)));
        if leased != expected {
            let heads: HashSet<Uuid> = heads_a
                .iter()
                .chain(&heads_b)
                .map(|h| h.event_work_id)
                .collect();
            let mut report = Vec::new();
            for w in all_work(&store).await? {
                let id = w.event_work_id;
                if leased.get(&id) != expected.get(&id) {
                    report.push(format!(
                        "row {id} (stream {}, {}, v{}, attempts {}): leased to {:?}, returned to \
                         {:?}, acquired by claim_orphaned: {}",
                        w.stream_id,
                        w.perspective_name,
                        w.stream_version,
                        w.attempts,
                        leased.get(&id),
                        expected.get(&id),
                        heads.contains(&id)
                    ));
                }
            }
            panic!(
                "round {round}: the rows leased are not the rows returned (a = {a}, b = {b}):\n{}",
                report.join("\n")
            );
        }

        // Each claim is a contiguous prefix of its lane, claimed once.
        let mut by_lane: BTreeMap<Lane, Vec<i32>> = BTreeMap::new();
        for r in ra.iter().chain(&rb) {
            assert_eq!(r.attempts, 1, "round {round}: spurious takeover of {r:?}");
            by_lane
                .entry((r.stream_id, r.perspective_name.clone()))
                .or_default()
                .push(r.stream_version);
        }
        for ((stream, p), vs) in &by_lane {
            let head: i32 = sqlx::query_scalar(
                "SELECT min(stream_version) FROM wh_perspective_events \
                 WHERE stream_id = $1 AND perspective_name = $2",
            )
            .bind(stream)
            .bind(p)
            .fetch_one(store.pool())
            .await?;
            let want: Vec<i32> = (head..head + vs.len() as i32).collect();
            assert_eq!(
                vs, &want,
                "round {round}: lane ({stream}, {p}) not a prefix"
            );
        }

        // Complete concurrently.
        let (store_a, store_b) = (store.clone(), store.clone());
        let done_a = ids_a.iter().copied().collect::<Vec<_>>();
        let done_b = ids_b.iter().copied().collect::<Vec<_>>();
        let (na, nb) = (done_a.len() as u64, done_b.len() as u64);
        let ca = tokio::spawn(async move {
            vantage::internals::leases::complete(store_a.pool(), a, &done_a).await
        });
        let cb = tokio::spawn(async move {
            vantage::internals::leases::complete(store_b.pool(), b, &done_b).await
        });
        assert_eq!(expect_no_deadlock("complete a", ca.await?), na);
        assert_eq!(expect_no_deadlock("complete b", cb.await?), nb);
        for (l, vs) in by_lane {
            completed.entry(l).or_default().extend(vs);
        }
    }
    assert!(done, "not drained after {MAX_ROUNDS} rounds");
    assert!(
        contended_rounds >= 10,
        "the instances rarely claimed at the same time ({contended_rounds} of {rounds} rounds)"
    );
    assert_eq!(completed.len(), STREAMS * 2);
    for (l, vs) in &completed {
        assert_eq!(
            vs,
            &(1..=EVENTS as i32).collect::<Vec<_>>(),
            "lane {l:?} completed in order, each row once"
        );
    }
    Ok(())
}

/// Rule 15, deterministically: rows validly leased to the caller are returned by
/// get_stream_events even while another session holds a row lock on them. That is the normal
/// state under contention: a concurrent claimer's `FOR UPDATE SKIP LOCKED`, whose snapshot
/// predates our lease, locks the row's latest version before its re-check rejects it, and keeps
/// that lock until its transaction ends. Catches: get_stream_events requiring its own lock on rows
/// that are already validly its own (it then skips them, drops their lane, and leaves them
/// leased to the caller but not returned — the lane stalls until the lease lapses and a takeover
/// charges an attempt no handler ever made).
#[tokio::test]
async fn own_leased_rows_are_returned_while_another_session_locks_them() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let a = live_instance(store).await?;
    let s = Uuid::new_v4();
    append(store, s, &["A", "B", "C"]).await?;
    let lock = "SELECT event_work_id FROM wh_perspective_events \
                WHERE event_work_id = ANY ($1) FOR UPDATE";
    let leased_to_a = "SELECT event_work_id FROM wh_perspective_events \
                       WHERE instance_id = $1 ORDER BY stream_version";

    // claim_orphaned acquired the head; a stale claimer holds a lock on it.
    let heads = orphaned(store, a).await?;
    assert_eq!(heads.len(), 1);
    let head = heads[0].event_work_id;
    let mut other = store.pool().begin().await?;
    sqlx::query(lock)
        .bind(vec![head])
        .execute(&mut *other)
        .await?;
    let rows = fetch(store, a, &[s]).await?;
    let held: Vec<Uuid> = sqlx::query_scalar(leased_to_a)
        .bind(a.0)
        .fetch_all(store.pool())
        .await?;
    assert_eq!(
        ids_of(&rows),
        held,
        "every row leased to a is returned to a"
    );
    assert_eq!(
        rows.iter().map(|r| r.stream_version).collect::<Vec<_>>(),
        vec![1, 2, 3],
        "the lane is fetched from its (own) head"
    );
    other.rollback().await?;

    // Re-fetch of the whole lane while all of it is locked elsewhere.
    let all = ids_of(&rows);
    let mut other = store.pool().begin().await?;
    sqlx::query(lock).bind(&all).execute(&mut *other).await?;
    let again = fetch(store, a, &[s]).await?;
    assert_eq!(ids_of(&again), all, "own valid rows are returned");
    other.rollback().await?;
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Migrations and the audit trail
// ------------------------------------------------------------------------------------------

/// Rule 16. migrate() twice: the first applies every migration, the second nothing; the history
/// table is append-only (UPDATE and DELETE raise, rows unchanged). Catches: non-idempotent
/// migrations, a missing or wrongly scoped append-only trigger.
#[tokio::test]
async fn migrate_is_idempotent_and_history_is_append_only() -> TestResult {
    let db = support::fresh_database().await;
    let store = connect(&db, "vantage").await?;
    let first = store.migrate().await?;
    assert_eq!(
        first.iter().map(|m| m.version).collect::<Vec<_>>(),
        all_migrations()
    );
    assert!(first.len() >= 2, "tables and functions: {first:?}");
    let second = store.migrate().await?;
    assert!(second.is_empty(), "second migrate applied {second:?}");
    store.check_migrations().await?;

    perspective(&store, "P1", &["*"]).await?;
    let a = live_instance(&store).await?;
    let s = Uuid::new_v4();
    append(&store, s, &["A"]).await?;
    let id = claim_streams(&store, a, &[s]).await?[0].event_work_id;
    let MoveOutcome::Moved(dl_id) = vantage::internals::leases::move_to_dead_letters(
        store.pool(),
        a,
        id,
        FAILURE_MAX_ATTEMPTS,
        "x",
    )
    .await?
    else {
        panic!("moved");
    };
    let history = store.dead_letter_history(dl_id).await?;
    assert_eq!(history.len(), 1);

    let update = sqlx::query("UPDATE wh_dead_letter_history SET actor = 'tampered'")
        .execute(store.pool())
        .await
        .expect_err("UPDATE on the history must raise");
    assert_eq!(sqlstate(&update).as_deref(), Some("55000"), "{update}");
    let delete = sqlx::query("DELETE FROM wh_dead_letter_history")
        .execute(store.pool())
        .await
        .expect_err("DELETE on the history must raise");
    assert_eq!(sqlstate(&delete).as_deref(), Some("55000"), "{delete}");
    assert_eq!(store.dead_letter_history(dl_id).await?, history);

    store.close().await;
    drop(db);
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Row budget
// ------------------------------------------------------------------------------------------

/// get_stream_events with no row budget (p_max_rows NULL, as claim_and_fetch_pending always
/// passes) must work for any number of lanes. Catches: int4 overflow in the per-lane window
/// (`2 * ceil(2147483647 / lanes)::int` for one or two lanes raised "integer out of range",
/// so claim_and_fetch_pending always failed; fixed in aea90f4).
#[tokio::test]
async fn unbounded_get_stream_events_works_for_one_and_two_lanes() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    perspective(store, "P2", &["*"]).await?;
    let a = live_instance(store).await?;
    let s = Uuid::new_v4();
    append(store, s, &["A", "B"]).await?;

    let one = store
        .get_stream_events(a, &[s], LEASE, Some(names(&["P1"]).as_slice()), None)
        .await?;
    assert_eq!(one.len(), 2, "one lane");
    let two = store.get_stream_events(a, &[s], LEASE, None, None).await?;
    assert_eq!(two.len(), 4, "two lanes");
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Rebuild lock, requeue refusals, purged stays purged (issue 7, defects 1, 2 and 9)
// ------------------------------------------------------------------------------------------

/// The key of a perspective's rebuild lock, as `vantage perspectives rebuild` takes it.
async fn lock_key(store: &Store, perspective: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT wh_perspective_lock_key($1)")
        .bind(perspective)
        .fetch_one(store.pool())
        .await?)
}

/// Claims, fetched rows, and the work rows of a perspective that nobody leases.
async fn unleased(store: &Store, perspective: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM wh_perspective_events \
         WHERE perspective_name = $1 AND instance_id IS NULL",
    )
    .bind(perspective)
    .fetch_one(store.pool())
    .await?)
}

/// Defects 1 and 2. While a session holds a perspective's rebuild lock (the session-level
/// advisory lock on `wh_perspective_lock_key(name)`), neither claim function leases or returns
/// a row of that perspective (others are claimed as usual), `move_to_dead_letters` and
/// `requeue_dead_letter` raise 55P03 saying the perspective is being rebuilt and change nothing;
/// a claim in progress holds the lock shared, so the rebuild's exclusive lock cannot be taken
/// under it; after the unlock everything is claimable again. The key depends on the schema, so
/// two vantage schemas in one database do not share locks. Catches: a claim that ignores the
/// lock (a rebuild's re-queued history overtaken by newer rows), a move or requeue that races a
/// rebuild (an open dead letter and a work row for one event).
#[tokio::test]
async fn rebuild_lock_stops_claims_moves_and_requeues_of_its_perspective() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    perspective(store, "P2", &["*"]).await?;
    let a = live_instance(store).await?;
    // A dead letter of P1 to requeue later.
    let poison_stream = Uuid::new_v4();
    append(store, poison_stream, &["Poison"]).await?;
    let rows = claim_streams(store, a, &[poison_stream]).await?;
    let poison_p1 = rows
        .iter()
        .find(|r| r.perspective_name == "P1")
        .unwrap()
        .event_work_id;
    let MoveOutcome::Moved(dl) = vantage::internals::leases::move_to_dead_letters(
        store.pool(),
        a,
        poison_p1,
        FAILURE_MAX_ATTEMPTS,
        "x",
    )
    .await?
    else {
        panic!("moved");
    };
    vantage::internals::leases::complete(store.pool(), a, &ids_of(&rows)).await?;

    let s = Uuid::new_v4();
    append(store, s, &["A", "B"]).await?;
    let key = lock_key(store, "P1").await?;
    assert_ne!(key, lock_key(store, "P2").await?);
    let other_schema = setup_schema("vantage_other").await?;
    assert_ne!(
        key,
        lock_key(&other_schema.store, "P1").await?,
        "the key names the schema"
    );

    let mut rebuild = store.pool().acquire().await?;
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(key)
        .execute(&mut *rebuild)
        .await?;

    let heads = orphaned(store, a).await?;
    assert_eq!(
        heads
            .iter()
            .map(|h| h.perspective_name.as_str())
            .collect::<Vec<_>>(),
        vec!["P2"],
        "only P2 is claimed while P1 is being rebuilt: {heads:?}"
    );
    let fetched = fetch(store, a, &[s]).await?;
    assert!(
        fetched.iter().all(|r| r.perspective_name == "P2") && fetched.len() == 2,
        "{fetched:?}"
    );
    let lane_rows = claim_lane(store, a, s, "P1").await?;
    assert!(lane_rows.is_empty(), "{lane_rows:?}");
    assert_eq!(unleased(store, "P1").await?, 2);

    let p1_head = lane(store, s, "P1").await?[0].event_work_id;
    let before = all_work(store).await?;
    let moved = vantage::internals::leases::move_to_dead_letters(
        store.pool(),
        a,
        p1_head,
        FAILURE_MAX_ATTEMPTS,
        "x",
    )
    .await;
    let Err(StoreError::Database(e)) = &moved else {
        panic!("the move must raise while P1 is rebuilt: {moved:?}");
    };
    assert_eq!(sqlstate(e).as_deref(), Some("55P03"), "{e}");
    assert!(e.to_string().contains("being rebuilt"), "{e}");
    let requeued = store.requeue_dead_letter(dl, "ops").await;
    let Err(StoreError::Database(e)) = &requeued else {
        panic!("the requeue must raise while P1 is rebuilt: {requeued:?}");
    };
    assert_eq!(sqlstate(e).as_deref(), Some("55P03"), "{e}");
    assert!(e.to_string().contains("being rebuilt"), "{e}");
    let mut replay = store.pool().begin().await?;
    let resolved = vantage::internals::store::resolve_dead_letter_in(&mut replay, dl, "ops").await;
    let Err(StoreError::Database(e)) = &resolved else {
        panic!("a replay's resolution must raise while P1 is rebuilt: {resolved:?}");
    };
    assert_eq!(sqlstate(e).as_deref(), Some("55P03"), "{e}");
    drop(replay);
    assert_eq!(all_work(store).await?, before);
    assert_eq!(store.dead_letter(dl).await?.unwrap().status, "exhausted");
    assert_eq!(history_kinds(store, dl).await?, vec!["Exhausted"]);
    let rebuilding = |name: &'static str| async move {
        sqlx::query_scalar::<_, bool>("SELECT wh_perspective_is_rebuilding($1)")
            .bind(name)
            .fetch_one(store.pool())
            .await
    };
    assert!(rebuilding("P1").await?);
    assert!(!rebuilding("P2").await?);

    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(key)
        .execute(&mut *rebuild)
        .await?;
    assert!(!rebuilding("P1").await?);
    let fetched = claim_streams(store, a, &[s]).await?;
    assert_eq!(fetched.len(), 4, "P1 is claimable again: {fetched:?}");

    // A claim in progress holds the lock shared: the rebuild's exclusive lock waits for it.
    let mut claim = store.pool().begin().await?;
    sqlx::query("SELECT * FROM claim_orphaned_perspective_events($1, 60, 10, 10, ARRAY['P1'])")
        .bind(a.0)
        .fetch_all(&mut *claim)
        .await?;
    let free: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(key)
        .fetch_one(&mut *rebuild)
        .await?;
    assert!(
        !free,
        "a claim in progress must hold the rebuild lock shared"
    );
    claim.commit().await?;
    let free: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(key)
        .fetch_one(&mut *rebuild)
        .await?;
    assert!(free, "released with the claim's transaction");
    drop(rebuild);
    drop(other_schema);
    Ok(())
}

/// Defect 2. requeue_dead_letter on an open dead letter whose event already has a work row for
/// that perspective (what a rebuild racing a move used to leave behind) raises 23505 and changes
/// nothing: no second work row, status still exhausted, no Requeued history. Catches: a requeue
/// whose insert did nothing (ON CONFLICT DO NOTHING) but which still reported success and wrote
/// `Requeued`.
#[tokio::test]
async fn requeue_refuses_when_the_event_is_already_queued() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let a = live_instance(store).await?;
    let s = Uuid::new_v4();
    append(store, s, &["Poison"]).await?;
    let id = claim_streams(store, a, &[s]).await?[0].event_work_id;
    let MoveOutcome::Moved(dl) = vantage::internals::leases::move_to_dead_letters(
        store.pool(),
        a,
        id,
        FAILURE_MAX_ATTEMPTS,
        "x",
    )
    .await?
    else {
        panic!("moved");
    };
    // The event is queued again behind the dead letter's back.
    sqlx::query(
        "INSERT INTO wh_perspective_events \
             (stream_id, event_id, global_position, stream_version, perspective_name) \
         SELECT stream_id, event_id, global_position, stream_version, perspective_name \
         FROM wh_dead_letters WHERE dead_letter_id = $1",
    )
    .bind(dl)
    .execute(store.pool())
    .await?;
    let work_before = all_work(store).await?;
    let dls_before = dead_letters(store).await?;

    let outcome = store.requeue_dead_letter(dl, "ops").await;
    match &outcome {
        Err(StoreError::Database(e)) => {
            assert_eq!(sqlstate(e).as_deref(), Some("23505"), "{e}");
            assert!(e.to_string().contains("already queued"), "{e}");
        }
        other => panic!("requeue must refuse: {other:?}"),
    }
    assert_eq!(all_work(store).await?, work_before);
    assert_eq!(dead_letters(store).await?, dls_before);
    assert_eq!(history_kinds(store, dl).await?, vec!["Exhausted"]);
    Ok(())
}

/// Defect 9. A purged dead letter is terminal: when its event is queued again (a rebuild
/// re-queues purged events) and exhausted again, the move mints a NEW dead letter; the purged
/// record and its history are untouched. The new record is the only open one at that position,
/// and a requeue and re-exhaustion of it reopens it (not the purged one). Catches: the move's
/// ON CONFLICT reopening a purged letter.
#[tokio::test]
async fn purged_dead_letter_stays_purged_when_its_event_is_exhausted_again() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let a = live_instance(store).await?;
    let s = Uuid::new_v4();
    let appended = append(store, s, &["Poison"]).await?;
    let position = appended[0].global_position;
    let id = claim_streams(store, a, &[s]).await?[0].event_work_id;
    let MoveOutcome::Moved(purged) = vantage::internals::leases::move_to_dead_letters(
        store.pool(),
        a,
        id,
        FAILURE_MAX_ATTEMPTS,
        "first",
    )
    .await?
    else {
        panic!("moved");
    };
    assert!(store.purge_dead_letter(purged, "ops").await?);
    let purged_row = store.dead_letter(purged).await?.unwrap();
    let purged_history = store.dead_letter_history(purged).await?;
    assert_eq!(
        history_kinds(store, purged).await?,
        vec!["Exhausted", "Purged"]
    );

    // Queued again the way a rebuild does it, then exhausted again.
    let mut conn = store.pool().acquire().await?;
    let (queued, _) =
        vantage::internals::store::requeue_history_batch_in(&mut conn, "P1", 0, position, 100)
            .await?;
    drop(conn);
    assert_eq!(
        queued, 1,
        "a purged event is not open: a rebuild re-queues it"
    );
    let again = claim_streams(store, a, &[s]).await?[0].event_work_id;
    let MoveOutcome::Moved(fresh) = vantage::internals::leases::move_to_dead_letters(
        store.pool(),
        a,
        again,
        FAILURE_MAX_ATTEMPTS,
        "second",
    )
    .await?
    else {
        panic!("moved again");
    };
    assert_ne!(fresh, purged, "a purged dead letter is never reopened");
    assert_eq!(store.dead_letter(purged).await?.unwrap(), purged_row);
    assert_eq!(store.dead_letter_history(purged).await?, purged_history);
    let open = store.open_dead_letters_at(position, None).await?;
    assert_eq!(
        open.iter().map(|d| d.dead_letter_id).collect::<Vec<_>>(),
        vec![fresh]
    );
    assert_eq!(open[0].status, "exhausted");
    assert_eq!(history_kinds(store, fresh).await?, vec!["Exhausted"]);

    // The new record follows the usual life: requeued, exhausted again = reopened.
    assert!(store.requeue_dead_letter(fresh, "ops").await?);
    let third = claim_streams(store, a, &[s]).await?[0].event_work_id;
    assert_eq!(
        vantage::internals::leases::move_to_dead_letters(
            store.pool(),
            a,
            third,
            FAILURE_MAX_ATTEMPTS,
            "third"
        )
        .await?,
        MoveOutcome::Moved(fresh)
    );
    assert_eq!(
        history_kinds(store, fresh).await?,
        vec!["Exhausted", "Requeued", "Exhausted"]
    );
    assert_eq!(store.dead_letter(purged).await?.unwrap(), purged_row);
    assert_eq!(
        count(store, "SELECT count(*) FROM wh_dead_letters").await?,
        2
    );
    Ok(())
}

// ------------------------------------------------------------------------------------------
// The lane index (migrations/0003_lanes.sql)
// ------------------------------------------------------------------------------------------

/// The lanes in the lane index and the lanes that have work rows.
async fn lane_sets(store: &Store) -> anyhow::Result<(BTreeSet<Lane>, BTreeSet<Lane>)> {
    let indexed: Vec<Lane> =
        sqlx::query_as("SELECT stream_id, perspective_name FROM wh_perspective_lanes")
            .fetch_all(store.pool())
            .await?;
    let worked: Vec<Lane> =
        sqlx::query_as("SELECT DISTINCT stream_id, perspective_name FROM wh_perspective_events")
            .fetch_all(store.pool())
            .await?;
    Ok((indexed.into_iter().collect(), worked.into_iter().collect()))
}

/// Rule 16. An append into a lane whose last row is being completed never strands the new row:
/// the completion does not wait for the appender (it may drop the lane, which it sees empty),
/// and the append's wake-up, committed with it, brings the lane back at the next claim's fold
/// (L1); once everything is done the index is empty. Deterministic: the append is held open
/// while the completion runs. Catches: an append without a wake-up, a fold that deletes a
/// wake-up without taking its lane, an emptiness check on a snapshot taken before the lane's
/// lock, a lane not made due when its head completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_racing_the_completion_of_its_lane_is_not_stranded() -> TestResult {
    let ctx = setup().await?;
    let store = ctx.store.clone();
    perspective(&store, "P1", &["*"]).await?;
    let stream = Uuid::new_v4();
    append(&store, stream, &["E"]).await?;
    let instance = live_instance(&store).await?;
    let first = store.claim_work(instance, LEASE, 10, 10, None).await?;
    assert_eq!(first.len(), 1);

    // The producer's append of version 2, not yet committed.
    let mut producer = store.pool().begin().await?;
    sqlx::query("SELECT * FROM append_events($1, NULL, $2)")
        .bind(stream)
        .bind(json!([{ "event_type": "E" }]))
        .execute(&mut *producer)
        .await?;

    let completion = {
        let store = store.clone();
        let ids = ids_of(&first);
        tokio::spawn(async move {
            vantage::internals::leases::complete(store.pool(), instance, &ids).await
        })
    };
    // The producer commits only once the completion has run while it was open: finished, or
    // (were it to wait for the appender) waiting for a lock.
    until_waiting_or_done(&store, "complete_perspective_events", &completion).await?;
    producer.commit().await?;
    assert_eq!(completion.await??, 1);

    let second = store.claim_work(instance, LEASE, 10, 10, None).await?;
    assert_eq!(
        second.iter().map(|r| r.stream_version).collect::<Vec<_>>(),
        vec![2],
        "the appended row is claimable (lanes: {:?})",
        lane_sets(&store).await?
    );
    vantage::internals::leases::complete(store.pool(), instance, &ids_of(&second)).await?;
    let (indexed, worked) = lane_sets(&store).await?;
    assert!(worked.is_empty(), "all work done");
    assert!(
        indexed.is_empty(),
        "empty lanes leave the index: {indexed:?}"
    );
    Ok(())
}

/// Rule 17. A perspective with many parked lanes does not starve another: every claim of a
/// daemon handling both returns the healthy perspective's rows, and the parked lanes are not
/// visited again until they are due. Catches: a claim that visits blocked lanes under a shared
/// budget (the parked ones eat it and the claim comes back empty), a lane index whose hint is
/// not moved to the parked head's scheduled_for.
#[tokio::test]
async fn parked_lanes_do_not_starve_another_perspective() -> TestResult {
    const PARKED: usize = 300;

    let ctx = setup().await?;
    let store = ctx.store.clone();
    perspective(&store, "Parked", &["Bad"]).await?;
    perspective(&store, "Healthy", &["Good"]).await?;
    for _ in 0..PARKED {
        append(&store, Uuid::new_v4(), &["Bad", "Bad"]).await?;
    }
    // Park every lane's head the way the daemon does: claim it, record a failure.
    let failing = live_instance(&store).await?;
    let heads = store
        .claim_work(
            failing,
            LEASE,
            PARKED as u32,
            PARKED as u32 * 2,
            Some(names(&["Parked"]).as_slice()),
        )
        .await?;
    assert_eq!(heads.len(), PARKED * 2);
    for r in heads.iter().filter(|r| r.stream_version == 1) {
        assert!(
            vantage::internals::leases::record_failure(
                store.pool(),
                failing,
                r.event_work_id,
                "down",
                Duration::from_secs(3600)
            )
            .await?
        );
    }
    let behind: Vec<Uuid> = heads
        .iter()
        .filter(|r| r.stream_version == 2)
        .map(|r| r.event_work_id)
        .collect();
    vantage::internals::leases::release_unstarted(store.pool(), failing, &behind).await?;

    let healthy: Vec<Uuid> = (0..60).map(|_| Uuid::new_v4()).collect();
    for s in &healthy {
        append(&store, *s, &["Good"]).await?;
    }
    let both = names(&["Parked", "Healthy"]);
    for round in 0..4 {
        let instance = live_instance(&store).await?;
        let rows = store
            .claim_work(instance, LEASE, 5, 5, Some(both.as_slice()))
            .await?;
        assert_eq!(rows.len(), 5, "round {round}: a full claim of healthy rows");
        assert!(rows.iter().all(|r| r.perspective_name == "Healthy"));
        // The contract's head claim too.
        let other = live_instance(&store).await?;
        let heads = store
            .claim_orphaned(other, LEASE, 5, 5, Some(both.as_slice()))
            .await?;
        assert!(
            !heads.is_empty(),
            "round {round}: claim_orphaned finds healthy heads"
        );
        assert!(heads.iter().all(|h| h.perspective_name == "Healthy"));
    }
    let visible_parked = count(
        &store,
        "SELECT count(*) FROM wh_perspective_lanes \
         WHERE perspective_name = 'Parked' AND due_at <= now()",
    )
    .await?;
    assert_eq!(
        visible_parked, 0,
        "parked lanes sit in the future part of the index"
    );
    Ok(())
}

/// Rule 17, by rows. A perspective whose lanes are deep (a rebuild re-queued its history) takes
/// at most its share of a claim's rows, and the lanes it does not need go to perspectives whose
/// lanes hold a row or two (fresh events), so a rebuild's backlog does not fill every batch
/// while fresh events wait; alone, it still gets whole claims. Catches: a claim that shares
/// lanes between perspectives but gives each lane an even share of the rows (a deep lane then
/// brings dozens where a fresh lane brings one), a claim that sizes every perspective's lanes
/// by one estimate of rows per lane, a share that is not given back when the others have no
/// work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deep_perspective_takes_its_share_of_a_claims_rows_not_the_whole_claim() -> TestResult {
    const DEEP_LANES: usize = 20;
    const DEEP_ROWS: usize = 80;
    const FRESH_LANES: usize = 200;
    const ROWS: u32 = 500;
    const LANES: u32 = 100;

    let ctx = setup().await?;
    let store = ctx.store.clone();
    perspective(&store, "Deep", &["Old"]).await?;
    perspective(&store, "FreshA", &["New"]).await?;
    perspective(&store, "FreshB", &["New"]).await?;
    for _ in 0..DEEP_LANES {
        append(&store, Uuid::new_v4(), &["Old"; DEEP_ROWS]).await?;
    }
    for _ in 0..FRESH_LANES {
        append(&store, Uuid::new_v4(), &["New"]).await?;
    }
    let all = names(&["Deep", "FreshA", "FreshB"]);
    let per_perspective = |rows: &[WorkRow]| {
        let mut n: BTreeMap<String, usize> = BTreeMap::new();
        for r in rows {
            *n.entry(r.perspective_name.clone()).or_default() += 1;
        }
        n
    };

    let instance = live_instance(&store).await?;
    let rows = store
        .claim_work(instance, LEASE, LANES, ROWS, Some(all.as_slice()))
        .await?;
    let got = per_perspective(&rows);
    let deep = got.get("Deep").copied().unwrap_or(0);
    let (a, b) = (
        got.get("FreshA").copied().unwrap_or(0),
        got.get("FreshB").copied().unwrap_or(0),
    );
    let share = (ROWS as usize).div_ceil(all.len());
    assert!(
        deep > 0 && deep <= share,
        "the deep perspective takes rows, at most its share of {share}: {got:?}"
    );
    // Every lane the deep perspective does not need goes to the fresh ones (one row each).
    assert!(
        a + b >= LANES as usize * 8 / 10 && a.min(b) >= (a + b) * 3 / 10,
        "the fresh perspectives get most of the claim's lanes, shared: {got:?}"
    );

    // Alone (another instance leases every fresh row first), the deep perspective gets whole
    // claims.
    let fresh = live_instance(&store).await?;
    let rows = store
        .claim_work(
            fresh,
            LEASE,
            BIG,
            BIG,
            Some(names(&["FreshA", "FreshB"]).as_slice()),
        )
        .await?;
    assert_eq!(rows.len() + a + b, 2 * FRESH_LANES);
    let other = live_instance(&store).await?;
    let rows = store
        .claim_work(other, LEASE, LANES, ROWS, Some(all.as_slice()))
        .await?;
    let got = per_perspective(&rows);
    assert_eq!(
        got.get("Deep").copied().unwrap_or(0),
        ROWS as usize,
        "alone, a deep perspective's claim is full: {got:?}"
    );
    Ok(())
}

/// Rule 18. A claim meeting a row of its lane locked by someone else (an old holder finishing)
/// neither waits for it nor leases rows behind it: it comes back at once without that lane, and
/// takes the whole lane once the lock is gone. Catches: a claim that waits on the lock (and can
/// deadlock with an old holder's completion waiting for the lane), a claim that skips the locked
/// head and leases the rows behind it (two holders in one lane).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_head_is_skipped_without_waiting_and_nothing_behind_it_is_taken() -> TestResult {
    let ctx = setup().await?;
    let store = ctx.store.clone();
    perspective(&store, "P1", &["*"]).await?;
    let stream = Uuid::new_v4();
    append(&store, stream, &["E", "E", "E"]).await?;
    let old = live_instance(&store).await?;
    let first = store.claim_work(old, LEASE, 10, 10, None).await?;
    assert_eq!(first.len(), 3);
    expire(&store, &ids_of(&first)).await?;

    // The old holder's session holds the head's row lock (as a completion under way would).
    let mut holder = store.pool().begin().await?;
    sqlx::query("SELECT 1 FROM wh_perspective_events WHERE event_work_id = $1 FOR UPDATE")
        .bind(first[0].event_work_id)
        .execute(&mut *holder)
        .await?;

    let new = live_instance(&store).await?;
    let started = std::time::Instant::now();
    let rows = store.claim_work(new, LEASE, 10, 10, None).await?;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the claim waited {:?}",
        started.elapsed()
    );
    assert!(
        rows.is_empty(),
        "nothing of a lane whose head is locked: {rows:?}"
    );
    let held_by_new = count(
        &store,
        &format!(
            "SELECT count(*) FROM wh_perspective_events WHERE instance_id = '{}'",
            new.0
        ),
    )
    .await?;
    assert_eq!(held_by_new, 0, "no row behind the locked head is leased");
    holder.rollback().await?;

    // The lane comes back within its retry hint (a second); then it is taken whole, in order.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let rows = loop {
        let rows = store.claim_work(new, LEASE, 10, 10, None).await?;
        if !rows.is_empty() || tokio::time::Instant::now() > deadline {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        rows.iter().map(|r| r.stream_version).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert!(
        rows.iter().all(|r| r.attempts == 2),
        "one takeover each, the refunded give-back not counted: {rows:?}"
    );
    Ok(())
}

// ------------------------------------------------------------------------------------------
// The batched apply (migrations 0005, 0009, 0012)
// ------------------------------------------------------------------------------------------

/// Rule 19. The batched apply runs every statement with the same seven parameters and in the
/// order given, whichever way it runs it (a cached PL/pgSQL function for plain writes, EXECUTE
/// for the rest), again and again on one session, and an error of any statement fails the call.
/// Catches: a plain write and an EXECUTE'd statement run out of order, a trailing semicolon or
/// comment breaking the cached form, a column named like a PL/pgSQL variable ("found") read as
/// the variable, a statement returning rows refused, a cached plan that survives the rollback of
/// the transaction that created it.
#[tokio::test]
async fn the_batched_apply_runs_every_kind_of_statement_in_order() -> TestResult {
    use vantage::internals::store::{StatementBatch, StatementParams};

    let nobody = InstanceId::new(); // nothing to complete: the statements alone

    let ctx = setup().await?;
    let store = ctx.store.clone();
    sqlx::query(
        "CREATE TABLE applied (seq bigserial, kind text, stream_id uuid, version int, \
         position bigint, event_type text, data jsonb, found boolean DEFAULT false)",
    )
    .execute(store.pool())
    .await?;
    let statements = [
        // a plain write, with a trailing semicolon and blank
        "INSERT INTO applied (kind, stream_id, version, position, event_type, data) \
         VALUES ('insert', $2, $6, $5, $4, $1);  ",
        // a plain write with a comment, reading a column named like a PL/pgSQL variable
        "UPDATE applied SET kind = kind || '+' WHERE stream_id = $2 AND NOT found -- note",
        // a write returning rows and a SELECT: EXECUTE'd
        "INSERT INTO applied (kind, stream_id, version) VALUES ('returning', $2, $6) RETURNING seq",
        "SELECT $3::uuid, $7::jsonb",
        // a comment after the semicolon: EXECUTE'd
        "INSERT INTO applied (kind, stream_id, version) VALUES ('commented', $2, $6); -- done",
    ];
    let stream = Uuid::new_v4();
    let data = json!({ "n": 1 });
    let meta = json!({});
    let mut conn = store.pool().acquire().await?;
    for round in 0..3 {
        let mut batch = StatementBatch::default();
        for (i, s) in statements.iter().enumerate() {
            batch.push(
                s,
                StatementParams {
                    data: &data,
                    stream_id: stream,
                    event_id: Uuid::new_v4(),
                    event_type: "T",
                    global_position: (round * 10 + i) as i64,
                    stream_version: (round * 10 + i) as i32,
                    metadata: &meta,
                },
            );
        }
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        vantage::internals::leases::apply_statements_and_complete(&mut tx, &batch, nobody, &[])
            .await?;
        if round == 1 {
            tx.rollback().await?; // what this round created is gone: the next one must not care
        } else {
            tx.commit().await?;
        }
    }
    let rows: Vec<(String, i32)> = sqlx::query_as("SELECT kind, version FROM applied ORDER BY seq")
        .fetch_all(&mut *conn)
        .await?;
    // Round 0 and round 2 committed (round 1 rolled back); each round's UPDATE marks every row
    // of the stream there is at that point, so round 0's rows carry two marks.
    let expected: Vec<(String, i32)> = [
        ("insert++", 0),
        ("returning+", 2),
        ("commented+", 4),
        ("insert+", 20),
        ("returning", 22),
        ("commented", 24),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), *v))
    .collect();
    assert_eq!(rows, expected);
    let data_kept: serde_json::Value =
        sqlx::query_scalar("SELECT data FROM applied WHERE version = 0")
            .fetch_one(&mut *conn)
            .await?;
    assert_eq!(data_kept, data, "$1 is the event's data");

    // Parameters no statement of the batch mentions are not sent (NULL arrays): the others
    // still reach every statement, in both forms, and $4 stays what it is when mentioned.
    for round in 0..2 {
        let mut batch = StatementBatch::default();
        for s in [
            "INSERT INTO applied (kind, stream_id, version, event_type) \
             VALUES ('unsent', $2, $6, $4)",
            "INSERT INTO applied (kind, stream_id, version) VALUES ('unsent-r', $2, $6) \
             RETURNING seq",
        ] {
            batch.push(
                s,
                StatementParams {
                    data: &data,
                    stream_id: stream,
                    event_id: Uuid::new_v4(),
                    event_type: "U",
                    global_position: 0,
                    stream_version: 100 + round,
                    metadata: &meta,
                },
            );
        }
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        vantage::internals::leases::apply_statements_and_complete(&mut tx, &batch, nobody, &[])
            .await?;
        tx.commit().await?;
    }
    let unsent: Vec<(String, i32, Option<String>, Option<serde_json::Value>)> = sqlx::query_as(
        "SELECT kind, version, event_type, data FROM applied WHERE kind LIKE 'unsent%' ORDER BY seq",
    )
    .fetch_all(&mut *conn)
    .await?;
    assert_eq!(
        unsent,
        vec![
            ("unsent".to_string(), 100, Some("U".to_string()), None),
            ("unsent-r".to_string(), 100, None, None),
            ("unsent".to_string(), 101, Some("U".to_string()), None),
            ("unsent-r".to_string(), 101, None, None),
        ]
    );

    // An error of any statement fails the call, in either form.
    for bad in [
        "INSERT INTO missing_table (a) VALUES ($6)",
        "SELECT 1 / ($6 - $6)",
    ] {
        let mut batch = StatementBatch::default();
        batch.push(
            bad,
            StatementParams {
                data: &data,
                stream_id: stream,
                event_id: Uuid::new_v4(),
                event_type: "T",
                global_position: 1,
                stream_version: 1,
                metadata: &meta,
            },
        );
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        assert!(
            vantage::internals::leases::apply_statements_and_complete(&mut tx, &batch, nobody, &[])
                .await
                .is_err(),
            "{bad}"
        );
        tx.rollback().await?;
    }
    Ok(())
}

/// Rule 19a. A statement that returns no rows is compiled into the session's dispatcher (planned
/// once per session), a data-modifying WITH included; one that returns rows, or whose text the
/// reader cannot be sure of, runs through EXECUTE (an inlined statement returning rows would fail
/// every event it runs for). Catches: a WITH write parsed and planned at every event (migration
/// 0026's finding), a top-level RETURNING or a SELECT taken for a write, a RETURNING or a
/// parenthesis hidden in a literal, an identifier or a comment misread either way.
#[tokio::test]
async fn a_with_write_is_compiled_once_and_a_statement_returning_rows_is_not() -> TestResult {
    use vantage::internals::store::{StatementBatch, StatementParams};

    let ctx = setup().await?;
    let store = ctx.store.clone();
    let cases: &[(&str, bool)] = &[
        ("INSERT INTO t (a) VALUES ($6)", true),
        (
            "WITH a AS (INSERT INTO t AS s (a) VALUES ($6) ON CONFLICT (a) DO UPDATE \
             SET n = s.n + 1 RETURNING s.n), c AS (SELECT 1 AS one) \
             INSERT INTO u (n) SELECT a.n FROM a, c;",
            true,
        ),
        (
            "WITH RECURSIVE \"Odd Name\" (x) AS NOT MATERIALIZED (SELECT ')returning(') \
             -- a comment's quote ' and RETURNING\n\
             UPDATE t SET label = 'it''s (returning)' WHERE a = $6",
            true,
        ),
        (
            "WITH a AS MATERIALIZED (SELECT 1) DELETE FROM t WHERE a = $6",
            true,
        ),
        // rows to the caller
        ("INSERT INTO t (a) VALUES ($6) RETURNING a", false),
        (
            "WITH a AS (SELECT 1) INSERT INTO t (a) SELECT 1 FROM a RETURNING a",
            false,
        ),
        (
            "WITH a AS (INSERT INTO t (a) VALUES ($6) RETURNING a) SELECT * FROM a",
            false,
        ),
        ("SELECT $6", false),
        ("WITH a AS (SELECT 1) SELECT * FROM a", false),
        // text the reader cannot be sure of
        (
            "WITH a AS (SELECT $$)$$) INSERT INTO t (a) VALUES ($6)",
            false,
        ),
        (
            "WITH a AS (SELECT E'\\')') INSERT INTO t (a) VALUES ($6)",
            false,
        ),
        (
            "WITH a AS (SELECT 1) /* x */ INSERT INTO t (a) VALUES ($6)",
            false,
        ),
        ("WITH a AS (SELECT 1)) INSERT INTO t (a) VALUES ($6)", false),
        (
            "WITH a AS (SELECT 1) INSERT INTO t (a) VALUES ($6); SELECT 1",
            false,
        ),
        (
            "WITH a AS (SELECT 'open) INSERT INTO t (a) VALUES ($6)",
            false,
        ),
        // $8 and above are the dispatcher's own parameters
        ("WITH a AS (SELECT $8) INSERT INTO t (a) VALUES ($6)", false),
    ];
    for (statement, inline) in cases {
        let got: bool = sqlx::query_scalar("SELECT wh_statement_returns_no_rows($1)")
            .bind(statement)
            .fetch_one(store.pool())
            .await?;
        assert_eq!(got, *inline, "{statement}");
    }

    // The dispatcher runs the WITH write inline, and it counts each event once, across batches
    // on one session.
    sqlx::query("CREATE TABLE counted (position bigint PRIMARY KEY, n int NOT NULL DEFAULT 1)")
        .execute(store.pool())
        .await?;
    sqlx::query("CREATE TABLE seen (position bigint, n int)")
        .execute(store.pool())
        .await?;
    let statement = "WITH a AS (INSERT INTO counted AS c (position) VALUES ($5) \
                     ON CONFLICT (position) DO UPDATE SET n = c.n + 1 RETURNING c.n) \
                     INSERT INTO seen (position, n) SELECT $5, a.n FROM a";
    let data = json!({});
    let mut conn = store.pool().acquire().await?;
    for round in 0..3i64 {
        let mut batch = StatementBatch::default();
        for k in 0..2i64 {
            batch.push(
                statement,
                StatementParams {
                    data: &data,
                    stream_id: Uuid::new_v4(),
                    event_id: Uuid::new_v4(),
                    event_type: "T",
                    global_position: round * 2 + k,
                    stream_version: 1,
                    metadata: &data,
                },
            );
        }
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        vantage::internals::leases::apply_statements_and_complete(
            &mut tx,
            &batch,
            InstanceId::new(),
            &[],
        )
        .await?;
        tx.commit().await?;
    }
    let seen: Vec<(i64, i32)> = sqlx::query_as("SELECT position, n FROM seen ORDER BY position")
        .fetch_all(&mut *conn)
        .await?;
    assert_eq!(seen, (0..6).map(|p| (p, 1)).collect::<Vec<_>>());
    let bodies: Vec<String> = sqlx::query_scalar(
        "SELECT prosrc FROM pg_proc WHERE pronamespace = pg_my_temp_schema() \
         AND proname LIKE 'vantage_apply_inline_%'",
    )
    .fetch_all(&mut *conn)
    .await?;
    assert_eq!(bodies.len(), 1, "one dispatcher for the statement list");
    assert!(
        bodies[0].contains("INSERT INTO seen") && !bodies[0].contains("EXECUTE"),
        "the WITH write is compiled into the dispatcher, not EXECUTE'd:\n{}",
        bodies[0]
    );
    Ok(())
}

/// Rule 20. `move_many_to_dead_letters` moves rows the way `move_to_dead_letters` does, many at a
/// time: only rows leased to the caller, each with its own error text and the row's last_error,
/// attempts and failures, one `Exhausted` history record each, a requeued message's dead letter
/// reopened (not a second one), and rows already gone or not ours left out of the answer.
/// Catches: an unfenced delete, error texts paired with the wrong rows, a lost history record, a
/// second dead letter for one message.
#[tokio::test]
async fn move_many_to_dead_letters_moves_each_row_like_move_to_dead_letters() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let (a, b) = (live_instance(store).await?, live_instance(store).await?);
    let mine = Uuid::new_v4();
    append(store, mine, &["A", "B"]).await?;
    let rows = store.claim_work(a, LEASE, 10, 10, None).await?;
    let (first, second) = (rows[0].event_work_id, rows[1].event_work_id);
    poke(
        store,
        "UPDATE wh_perspective_events SET failures = 2, last_error = 'kaboom' \
         WHERE event_work_id = ANY ($1)",
        &[first],
    )
    .await?;
    let theirs = Uuid::new_v4();
    append(store, theirs, &["C"]).await?;
    let other = store.claim_work(b, LEASE, 10, 10, None).await?[0].event_work_id;

    let moves = vec![
        (first, "text one".to_string()),
        (second, "text two".to_string()),
        (other, "not ours".to_string()),
        (Uuid::new_v4(), "gone".to_string()),
    ];
    let moved = vantage::internals::leases::move_many_to_dead_letters(
        store.pool(),
        a,
        &moves,
        FAILURE_MAX_ATTEMPTS,
    )
    .await?;
    let moved_ids: BTreeSet<Uuid> = moved.iter().map(|(id, _)| *id).collect();
    assert_eq!(moved_ids, BTreeSet::from([first, second]));
    assert!(
        work(store, other).await?.is_some(),
        "another holder's row is untouched"
    );

    let dls = dead_letters(store).await?;
    assert_eq!(dls.len(), 2);
    for dl in &dls {
        let text = dl.error_text.clone().unwrap_or_default();
        if dl.source_id == first {
            assert!(
                text.contains("text one") && text.contains("kaboom"),
                "{text}"
            );
        } else {
            assert!(
                text.contains("text two") && !text.contains("kaboom"),
                "{text}"
            );
        }
        assert_eq!(
            history_kinds(store, dl.dead_letter_id).await?,
            vec!["Exhausted"]
        );
    }

    // Requeued, claimed and exhausted again: the same dead letter is reopened.
    let first_dl = dls
        .iter()
        .find(|d| d.source_id == first)
        .unwrap()
        .dead_letter_id;
    assert!(store.requeue_dead_letter(first_dl, "test").await?);
    let again = store.claim_work(a, LEASE, 10, 10, None).await?;
    assert_eq!(again.len(), 1);
    let moved = vantage::internals::leases::move_many_to_dead_letters(
        store.pool(),
        a,
        &[(again[0].event_work_id, "again".to_string())],
        FAILURE_MAX_ATTEMPTS,
    )
    .await?;
    assert_eq!(moved, vec![(again[0].event_work_id, first_dl)]);
    assert_eq!(
        dead_letters(store).await?.len(),
        2,
        "one dead letter per message"
    );
    Ok(())
}

/// Rule 21. A dead letter's `error_fingerprint` is always `wh_error_fingerprint` of its
/// perspective, event type and error text: when a batched move supplies it (computed once per
/// distinct error), when another writer inserts a dead letter without it, and after an update
/// of the error text. Catches: fingerprints paired with the wrong rows in a move of several
/// errors, a column left NULL for other writers, a stale fingerprint after an edit.
#[tokio::test]
async fn a_dead_letters_fingerprint_is_always_that_of_its_error() -> TestResult {
    let ctx = setup().await?;
    let store = &ctx.store;
    perspective(store, "P1", &["*"]).await?;
    let me = live_instance(store).await?;
    append(store, Uuid::new_v4(), &["A", "B", "C"]).await?;
    append(store, Uuid::new_v4(), &["A"]).await?;
    let rows = store.claim_work(me, LEASE, 10, 10, None).await?;
    assert_eq!(rows.len(), 4);
    poke(
        store,
        "UPDATE wh_perspective_events SET last_error = 'duplicate key (id)=(7) (SQLSTATE 23505)' \
         WHERE event_work_id = ANY ($1)",
        &[rows[0].event_work_id],
    )
    .await?;
    let moves: Vec<(Uuid, String)> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| (r.event_work_id, format!("text {}", i % 2)))
        .collect();
    let moved = vantage::internals::leases::move_many_to_dead_letters(
        store.pool(),
        me,
        &moves,
        FAILURE_MAX_ATTEMPTS,
    )
    .await?;
    assert_eq!(moved.len(), 4);
    let distinct: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT error_fingerprint) FROM wh_dead_letters")
            .fetch_one(store.pool())
            .await?;
    assert!(
        distinct >= 3,
        "different errors, different fingerprints: {distinct}"
    );

    // Another writer, without a fingerprint; then an edit of the text.
    sqlx::query(
        "INSERT INTO wh_dead_letters (dead_letter_id, source_table, source_id, stream_id, event_id, \
         global_position, stream_version, event_type, perspective_name, failure_reason, error_text, \
         attempts_when_dlq, failures_when_dlq, dead_lettered_at, status, status_changed_at) \
         VALUES (gen_random_uuid(), 'wh_perspective_events', gen_random_uuid(), gen_random_uuid(), \
         gen_random_uuid(), 999, 1, 'X', 'P1', 'PermanentFailure', 'by hand 42', 1, 1, now(), \
         'exhausted', now())",
    )
    .execute(store.pool())
    .await?;
    sqlx::query("UPDATE wh_dead_letters SET error_text = 'edited' WHERE source_id = $1")
        .bind(rows[1].event_work_id)
        .execute(store.pool())
        .await?;

    let wrong: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM wh_dead_letters WHERE error_fingerprint IS DISTINCT FROM \
         wh_error_fingerprint(perspective_name, event_type, error_text)",
    )
    .fetch_one(store.pool())
    .await?;
    assert_eq!(wrong, 0, "every fingerprint is that of its row's error");
    Ok(())
}

// ------------------------------------------------------------------------------------------
// The producer rule (migrations/0001_tables.sql, 0003_lanes.sql): a producer's append never
// waits for vantage, vantage never waits for a producer, and vantage never makes a producer's
// transaction fail. Each test holds one side's transaction open at the moment that used to
// conflict, and gives the other side a lock_timeout (or a generous deadline) so a wait shows as
// an error instead of a hang.
// ------------------------------------------------------------------------------------------

/// A producer's connection whose every lock wait fails after `lock_timeout`.
async fn producer_conn(
    store: &Store,
    lock_timeout: &str,
) -> anyhow::Result<sqlx::pool::PoolConnection<sqlx::Postgres>> {
    let mut conn = store.pool().acquire().await?;
    sqlx::query("SELECT set_config('lock_timeout', $1, false)")
        .bind(lock_timeout)
        .execute(&mut *conn)
        .await?;
    Ok(conn)
}

/// Appends `n` events of type E to `stream` on `conn` (inside whatever transaction it is in).
async fn append_on(
    conn: &mut sqlx::PgConnection,
    stream: Uuid,
    n: usize,
) -> Result<(), sqlx::Error> {
    let events: Vec<serde_json::Value> = (0..n).map(|_| json!({ "event_type": "E" })).collect();
    sqlx::query("SELECT * FROM append_events($1, NULL, $2)")
        .bind(stream)
        .bind(serde_json::Value::Array(events))
        .execute(conn)
        .await
        .map(|_| ())
}

/// Runs `fut` with a deadline far above anything it should need; a hang (a wait on a lock
/// nobody will release during the test) becomes an error naming `what`.
async fn no_hang<T>(what: &str, fut: impl std::future::Future<Output = T>) -> anyhow::Result<T> {
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .map_err(|_| anyhow::anyhow!("{what} waited on a lock held by an open transaction"))
}

/// Producer rule 1. A producer holding its append to stream S open does not stop vantage: the
/// rows already claimed of S, A and B are completed and given back, new work on another stream
/// is claimed and completed, the instance deregisters, and when the producer commits its event is
/// claimable at once, first claim (nothing charged). Catches: lane bookkeeping written by the
/// producer (a lane row it locks until it commits: every completion, release and deregistration
/// of that lane waits for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producers_open_transaction_does_not_stop_claims_completions_or_shutdown() -> TestResult {
    let ctx = setup().await?;
    let store = ctx.store.clone();
    perspective(&store, "P1", &["*"]).await?;
    let (s, a, b, c) = (
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
    );
    for stream in [s, a, b] {
        append(&store, stream, &["E", "E"]).await?;
    }
    let daemon = live_instance(&store).await?;
    let claimed = store.claim_work(daemon, LEASE, 10, 10, None).await?;
    assert_eq!(claimed.len(), 6);

    let mut producer = producer_conn(&store, "5s").await?;
    sqlx::query("BEGIN").execute(&mut *producer).await?;
    append_on(&mut producer, s, 1).await?;

    let of = |stream: Uuid| -> Vec<Uuid> {
        claimed
            .iter()
            .filter(|r| r.stream_id == stream)
            .map(|r| r.event_work_id)
            .collect()
    };
    assert_eq!(
        no_hang(
            "a completion",
            vantage::internals::leases::complete(store.pool(), daemon, &of(a))
        )
        .await??,
        2
    );
    assert_eq!(
        no_hang(
            "a completion of S",
            vantage::internals::leases::complete(store.pool(), daemon, &of(s)[..1])
        )
        .await??,
        1
    );
    assert_eq!(
        no_hang(
            "a give-back of S",
            vantage::internals::leases::release_started(store.pool(), daemon, &of(s)[1..])
        )
        .await??,
        1
    );
    assert!(
        no_hang(
            "a failure of B",
            vantage::internals::leases::record_failure(
                store.pool(),
                daemon,
                of(b)[0],
                "boom",
                Duration::ZERO
            )
        )
        .await??
    );
    append(&store, c, &["E"]).await?;
    let next = no_hang("a claim", store.claim_work(daemon, LEASE, 10, 10, None)).await??;
    assert!(
        next.iter().any(|r| r.stream_id == c),
        "new work on another stream is claimed: {next:?}"
    );
    no_hang(
        "a completion",
        vantage::internals::leases::complete(store.pool(), daemon, &ids_of(&next)),
    )
    .await??;
    no_hang("deregistration", store.deregister(daemon)).await??;

    sqlx::query("COMMIT").execute(&mut *producer).await?;
    let after = live_instance(&store).await?;
    let rows = store.claim_work(after, LEASE, 10, 10, None).await?;
    let held: Vec<&WorkRow> = rows.iter().filter(|r| r.stream_id == s).collect();
    assert_eq!(
        held.iter().map(|r| r.stream_version).collect::<Vec<_>>(),
        vec![3],
        "the held append is claimable once committed: {rows:?}"
    );
    assert_eq!(held[0].attempts, 1, "nothing was charged for the wait");
    Ok(())
}

/// Producer rule 2. While vantage holds its own transactions open on a stream's lane (a failed head
/// being settled in a batch that is still running; a rebuild re-queueing the history of the
/// stream), an append to that stream does not wait: the producer's lock_timeout is 200 ms, so a
/// wait for either fails it. Catches: a fan-out that upserts the lane row (waits for the failure's
/// or the re-queue's lock on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_never_waits_for_a_failing_head_or_a_rebuild() -> TestResult {
    let ctx = setup().await?;
    let store = ctx.store.clone();
    perspective(&store, "P1", &["*"]).await?;
    let failing = Uuid::new_v4();
    let rebuilt = Uuid::new_v4();
    append(&store, failing, &["E", "E"]).await?;
    append(&store, rebuilt, &["E", "E"]).await?;
    let daemon = live_instance(&store).await?;
    let claimed = store.claim_work(daemon, LEASE, 10, 10, None).await?;
    let head = claimed
        .iter()
        .find(|r| r.stream_id == failing && r.stream_version == 1)
        .expect("the failing head")
        .event_work_id;
    let behind = claimed
        .iter()
        .find(|r| r.stream_id == failing && r.stream_version == 2)
        .expect("the row behind")
        .event_work_id;

    // The careful pass: the head's failure and the give-back of the row behind it, in the
    // batch's transaction, which stays open while the pass goes on.
    let mut batch = store.pool().begin().await?;
    assert!(
        vantage::internals::leases::record_failure(&mut *batch, daemon, head, "boom", LEASE)
            .await?
    );
    vantage::internals::leases::release_started(&mut *batch, daemon, &[behind]).await?;
    let mut producer = producer_conn(&store, "200ms").await?;
    append_on(&mut producer, failing, 1)
        .await
        .map_err(|e| anyhow::anyhow!("an append to a failing lane waited: {e}"))?;
    batch.commit().await?;

    // A rebuild's re-queue of the perspective's history, not yet committed.
    sqlx::query("DELETE FROM wh_perspective_events WHERE stream_id = $1")
        .bind(rebuilt)
        .execute(store.pool())
        .await?;
    let mut rebuild = store.pool().begin().await?;
    let up_to: i64 = sqlx::query_scalar("SELECT max(global_position) FROM wh_event_store")
        .fetch_one(&mut *rebuild)
        .await?;
    let (queued, _) =
        vantage::internals::store::requeue_history_batch_in(&mut rebuild, "P1", 0, up_to, 1000)
            .await?;
    assert_eq!(queued, 2, "the rebuilt stream's history is queued again");
    append_on(&mut producer, rebuilt, 1)
        .await
        .map_err(|e| anyhow::anyhow!("an append during a rebuild waited: {e}"))?;
    rebuild.commit().await?;
    Ok(())
}

/// Producer rule 3. REPEATABLE READ and SERIALIZABLE producers that took their snapshot before a
/// claim touched their stream's lane still append: 0 serialization failures caused by vantage over
/// 1 000 appends (500 per isolation level).
/// Catches: a fan-out that updates a row a claim updated after the producer's snapshot (40001,
/// "could not serialize access due to concurrent update").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeatable_read_and_serializable_producers_never_fail_because_of_a_claim() -> TestResult {
    let ctx = setup().await?;
    let store = ctx.store.clone();
    perspective(&store, "P1", &["*"]).await?;
    let daemon = live_instance(&store).await?;
    for isolation in ["REPEATABLE READ", "SERIALIZABLE"] {
        for round in 0..500 {
            let stream = Uuid::new_v4();
            append(&store, stream, &["E"]).await?;
            let mut producer = producer_conn(&store, "5s").await?;
            sqlx::query(&format!("BEGIN ISOLATION LEVEL {isolation}"))
                .execute(&mut *producer)
                .await?;
            // The producer's snapshot, taken before the claim below.
            sqlx::query("SELECT count(*) FROM wh_event_store")
                .execute(&mut *producer)
                .await?;
            // The claim leases the lane's head (and writes the lane's hint) after that snapshot.
            let rows = store.claim_work(daemon, LEASE, 100, 100, None).await?;
            assert!(rows.iter().any(|r| r.stream_id == stream));
            append_on(&mut producer, stream, 1).await.map_err(|e| {
                anyhow::anyhow!("{isolation} producer, round {round}: the append failed: {e}")
            })?;
            sqlx::query("COMMIT")
                .execute(&mut *producer)
                .await
                .map_err(|e| anyhow::anyhow!("{isolation} producer, round {round}: {e}"))?;
            vantage::internals::leases::complete(store.pool(), daemon, &ids_of(&rows)).await?;
        }
    }
    Ok(())
}

/// Producer rule 4 (no stale hint). A claim holding a lane writes the hint it read before the
/// head's holder failed it with a 1 s backoff ("due when that lease expires", a minute away);
/// the failure must still leave the lane due at its backoff. The claim is played by hand (its
/// lock, then its stale write), so the interleaving is exact: the failure runs while the lane is
/// locked, and the stale hint is written after the failure's change. Catches: a failure that
/// lowers the hint only if it is later than the backoff as the failure's snapshot saw it (no
/// wait for the lock: the claim's stale hint overwrites it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_head_is_due_at_its_backoff_even_after_a_racing_claims_stale_hint() -> TestResult {
    let ctx = setup().await?;
    let store = ctx.store.clone();
    perspective(&store, "P1", &["*"]).await?;
    let stream = Uuid::new_v4();
    append(&store, stream, &["E"]).await?;
    let holder = live_instance(&store).await?;
    let rows = store.claim_work(holder, LEASE, 10, 10, None).await?;
    assert_eq!(rows.len(), 1);
    let head = rows[0].event_work_id;
    // The lane looks due (hints may be early), as when a claimer picks it.
    sqlx::query("UPDATE wh_perspective_lanes SET due_at = now() - interval '1 second'")
        .execute(store.pool())
        .await?;

    // The claimer: takes the lane's lock and reads the head, leased by `holder` for a minute.
    let mut claimer = store.pool().begin().await?;
    sqlx::query(
        "SELECT 1 FROM wh_perspective_lanes WHERE stream_id = $1 AND perspective_name = 'P1' \
         FOR UPDATE SKIP LOCKED",
    )
    .bind(stream)
    .execute(&mut *claimer)
    .await?;
    let stale: DateTime<Utc> = sqlx::query_scalar(
        "SELECT lease_expiry FROM wh_perspective_events WHERE event_work_id = $1",
    )
    .bind(head)
    .fetch_one(&mut *claimer)
    .await?;

    // The holder fails the head with a 1 s backoff, while the claimer holds the lane.
    let failure = {
        let store = store.clone();
        tokio::spawn(async move {
            vantage::internals::leases::record_failure(
                store.pool(),
                holder,
                head,
                "boom",
                Duration::from_secs(1),
            )
            .await
        })
    };
    // Wait until the failure has either finished or is waiting for the lane's lock.
    until_waiting_or_done(&store, "record_perspective_event_failure", &failure).await?;
    // The claimer writes the hint it computed from its read, and commits.
    sqlx::query(
        "UPDATE wh_perspective_lanes SET due_at = $2, holder = $3 \
         WHERE stream_id = $1 AND perspective_name = 'P1'",
    )
    .bind(stream)
    .bind(stale)
    .bind(holder.0)
    .execute(&mut *claimer)
    .await?;
    claimer.commit().await?;
    assert!(failure.await??, "the holder's failure is recorded");

    let (due, scheduled): (DateTime<Utc>, DateTime<Utc>) = sqlx::query_as(
        "SELECT l.due_at, pe.scheduled_for FROM wh_perspective_lanes l \
         JOIN wh_perspective_events pe ON pe.stream_id = l.stream_id \
                                       AND pe.perspective_name = l.perspective_name \
         WHERE l.stream_id = $1",
    )
    .bind(stream)
    .fetch_one(store.pool())
    .await?;
    assert!(
        due <= scheduled,
        "the lane is due at the head's backoff ({scheduled}), not at the stale hint ({due})"
    );
    // And a claim once the backoff has passed takes it (no waiting for the old lease).
    loop {
        let passed: bool = sqlx::query_scalar(
            "SELECT scheduled_for <= now() FROM wh_perspective_events WHERE event_work_id = $1",
        )
        .bind(head)
        .fetch_one(store.pool())
        .await?;
        if passed {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let other = live_instance(&store).await?;
    let again = store.claim_work(other, LEASE, 10, 10, None).await?;
    assert_eq!(
        ids_of(&again),
        vec![head],
        "re-claimed right after its backoff"
    );
    Ok(())
}

// ------------------------------------------------------------------------------------------
// The baseline and its live text
// ------------------------------------------------------------------------------------------

/// Every function, trigger, table (columns and storage options), constraint and index of a
/// freshly migrated schema, as the server prints them, sorted: the current text of the schema,
/// in one file (tests/golden/schema.sql), so a migration that redefines a function shows its live
/// text in one reviewed diff. `UPDATE_GOLDEN=1 cargo test --test sql_contract the_live_schema`
/// rewrites the file after review.
#[tokio::test]
async fn the_live_schema_is_the_golden_one() -> TestResult {
    let ctx = setup().await?;
    let parts: Vec<String> = sqlx::query_scalar(
        r#"
        WITH s AS (SELECT 'vantage'::regnamespace AS ns)
        SELECT part FROM (
            SELECT 1 AS kind, c.relname AS name,
                   format(E'-- table %s%s\nCREATE TABLE %s (\n%s\n);', c.relname,
                          coalesce(' WITH (' || array_to_string(c.reloptions, ', ') || ')', ''),
                          c.relname,
                          (SELECT string_agg(format('    %I %s%s%s%s', a.attname,
                                                    format_type(a.atttypid, a.atttypmod),
                                                    CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END,
                                                    coalesce(' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid), ''),
                                                    CASE a.attidentity
                                                        WHEN 'a' THEN ' GENERATED ALWAYS AS IDENTITY'
                                                        WHEN 'd' THEN ' GENERATED BY DEFAULT AS IDENTITY'
                                                        ELSE '' END),
                                             E',\n' ORDER BY a.attnum)
                           FROM pg_attribute a
                           LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                           WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped)) AS part
            FROM pg_class c, s WHERE c.relnamespace = s.ns AND c.relkind = 'r'
              AND c.relname <> '_sqlx_migrations'
            UNION ALL
            SELECT 2, conrelid::regclass::text || '.' || conname,
                   format('-- constraint %s.%s%sALTER TABLE %s ADD CONSTRAINT %s %s;',
                          conrelid::regclass, conname, E'\n', conrelid::regclass, conname,
                          pg_get_constraintdef(oid))
            FROM pg_constraint, s WHERE connamespace = s.ns
              AND conrelid <> 'vantage._sqlx_migrations'::regclass
            UNION ALL
            SELECT 3, i.relname, format(E'-- index %s\n%s;', i.relname, pg_get_indexdef(i.oid))
            FROM pg_class i JOIN pg_index x ON x.indexrelid = i.oid, s
            WHERE i.relnamespace = s.ns AND NOT x.indisprimary
              AND NOT EXISTS (SELECT 1 FROM pg_constraint k WHERE k.conindid = i.oid)
              AND x.indrelid <> 'vantage._sqlx_migrations'::regclass
            UNION ALL
            SELECT 4, p.oid::regprocedure::text,
                   format(E'-- function %s\n%s;', p.oid::regprocedure, pg_get_functiondef(p.oid))
            FROM pg_proc p, s WHERE p.pronamespace = s.ns
            UNION ALL
            SELECT 5, t.tgname, format(E'-- trigger %s\n%s;', t.tgname, pg_get_triggerdef(t.oid))
            FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid, s
            WHERE c.relnamespace = s.ns AND NOT t.tgisinternal
        ) x
        ORDER BY kind, name
        "#,
    )
    .fetch_all(ctx.store.pool())
    .await?;
    let actual = parts.join("\n\n") + "\n";
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/schema.sql");
    if std::env::var("UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &actual)?;
        return Ok(());
    }
    let expected = std::fs::read_to_string(&path)?;
    assert!(
        actual == expected,
        "the live schema differs from {} (a migration changed it: review the difference, then \
         UPDATE_GOLDEN=1 rewrites the file). Live:\n{actual}",
        path.display()
    );
    Ok(())
}

/// A database migrated by the builds before the baseline (migrations 0001 to 0014) is refused
/// with a message saying what to do, not "checksum mismatch"; exit 78 (configuration). Catches:
/// the baseline's versions silently taken as the old ones, or the old ones as newer.
#[tokio::test]
async fn a_database_migrated_before_the_baseline_is_refused() -> TestResult {
    let db = support::fresh_database().await;
    let store = connect(&db, "vantage").await?;
    sqlx::raw_sql(
        "CREATE SCHEMA vantage; \
         CREATE TABLE vantage._sqlx_migrations (version bigint PRIMARY KEY, description text NOT NULL, \
             installed_on timestamptz NOT NULL DEFAULT now(), success boolean NOT NULL, \
             checksum bytea NOT NULL, execution_time bigint NOT NULL); \
         INSERT INTO vantage._sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (1, 'tables', true, '\\x00', 1), (2, 'functions', true, '\\x00', 1), \
                (14, 'fingerprint once per error', true, '\\x00', 1);",
    )
    .execute(store.pool())
    .await?;
    for result in [
        store.migrate().await.map(|_| ()),
        store.check_migrations().await,
    ] {
        let error = result.expect_err("a pre-baseline schema is refused");
        assert!(
            matches!(error, StoreError::PreBaseline(2)),
            "refused as pre-baseline: {error}"
        );
        let message = error.to_string();
        assert!(
            message.contains("pre-release build") && message.contains("vantage migrate"),
            "the message says what happened and what to do: {message}"
        );
    }
    Ok(())
}

// An append behind a parked head wakes nothing: the fold keeps the head's hint (so no claim is
// sent to look at a lane that cannot be claimed), and deletes the wake-up; an event requeued
// ahead of the queued ones, or the first row of a lane, is due at once.
#[tokio::test]
async fn an_append_behind_a_parked_head_leaves_the_lane_hint_alone() -> TestResult {
    let ctx = setup().await?;
    let store = ctx.store.clone();
    perspective(&store, "P1", &["*"]).await?;
    let stream = Uuid::new_v4();
    append(&store, stream, &["E"]).await?;
    let holder = live_instance(&store).await?;
    let rows = store.claim_work(holder, LEASE, 10, 10, None).await?;
    assert_eq!(rows.len(), 1);
    let head = rows[0].event_work_id;
    assert!(
        vantage::internals::leases::record_failure(
            store.pool(),
            holder,
            head,
            "boom",
            Duration::from_secs(3600)
        )
        .await?
    );
    let due = |store: Store| async move {
        sqlx::query_scalar::<_, DateTime<Utc>>(
            "SELECT due_at FROM wh_perspective_lanes WHERE stream_id = $1",
        )
        .bind(stream)
        .fetch_one(store.pool())
        .await
    };
    let parked_until = due(store.clone()).await?;
    assert!(parked_until > Utc::now(), "the parked lane is not due now");

    // Appends behind the parked head, then the fold every claim begins with.
    append(&store, stream, &["E", "E"]).await?;
    let folded: i32 = sqlx::query_scalar("SELECT wh_fold_lane_wakeups(1000)")
        .fetch_one(store.pool())
        .await?;
    assert_eq!(folded, 1);
    let wakeups: i64 = sqlx::query_scalar("SELECT count(*) FROM wh_lane_wakeups")
        .fetch_one(store.pool())
        .await?;
    assert_eq!(wakeups, 0, "the wake-up is folded");
    assert_eq!(
        due(store.clone()).await?,
        parked_until,
        "the lane stays due at its head's backoff"
    );
    let claimed = store.claim_work(holder, LEASE, 10, 10, None).await?;
    assert!(
        claimed.is_empty(),
        "nothing behind a parked head is claimable"
    );

    // The head dead-lettered and requeued: a row ahead of the queued ones, due now.
    let moved: Option<Uuid> = sqlx::query_scalar(
        "SELECT move_to_dead_letters(gen_random_uuid(), 'wh_perspective_events', $1, \
         'PermanentFailure', 'boom', NULL)",
    )
    .bind(head)
    .fetch_one(store.pool())
    .await?;
    let letter = moved.expect("the head is dead-lettered");
    // (the move made the next row the head, due now; park it again to see the requeue wake it)
    sqlx::query(
        "UPDATE wh_perspective_lanes SET due_at = now() + interval '1 hour' WHERE stream_id = $1",
    )
    .bind(stream)
    .execute(store.pool())
    .await?;
    assert!(store.requeue_dead_letter(letter, "test").await?);
    let claimed = store.claim_work(holder, LEASE, 10, 10, None).await?;
    assert_eq!(
        claimed.iter().map(|r| r.stream_version).collect::<Vec<_>>(),
        vec![1, 2, 3],
        "the requeued head and the rows behind it are claimed at once"
    );
    Ok(())
}

/// The wake-ups of one lane, as stored.
async fn wakeups_of(store: &Store, stream: Uuid) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM wh_lane_wakeups WHERE stream_id = $1")
            .bind(stream)
            .fetch_one(store.pool())
            .await?,
    )
}

/// A fold never waits for another transaction inserting the same lane (L3; RELIABILITY.md,
/// finding D): claim A's fold inserts a new lane and its claim is still running; a producer
/// appends to that lane; claim B's fold, with a lock_timeout far shorter than any claim, must
/// leave the lane's wake-up for later instead of waiting for A. Catches: a fold that inserts a
/// lane with ON CONFLICT while another fold's insert of it is uncommitted (the convoy of finding
/// D); a wake-up deleted by a fold that did not fold its lane (L1: the lane would be lost).
#[tokio::test]
async fn a_fold_never_waits_for_another_fold_inserting_the_same_lane() -> TestResult {
    let ctx = setup().await?;
    let store = ctx.store.clone();
    perspective(&store, "P1", &["*"]).await?;
    let holder = live_instance(&store).await?;
    let stream = Uuid::new_v4();
    append(&store, stream, &["E"]).await?;

    let fold = "SELECT wh_fold_lane_wakeups(1000)";
    let mut a = store.pool().begin().await?;
    let folded: i32 = sqlx::query_scalar(fold).fetch_one(&mut *a).await?;
    assert_eq!(folded, 1, "claim A folds the new lane");
    append(&store, stream, &["E"]).await?;

    let mut b = store.pool().acquire().await?;
    sqlx::query("SET lock_timeout = '2s'")
        .execute(&mut *b)
        .await?;
    let folded = sqlx::query_scalar::<_, i32>(fold).fetch_one(&mut *b).await;
    sqlx::query("RESET lock_timeout").execute(&mut *b).await?;
    assert_eq!(
        folded?, 0,
        "claim B leaves the lane A is inserting, without waiting for A"
    );
    a.commit().await?;
    assert_eq!(wakeups_of(&store, stream).await?, 1, "B kept its wake-up");
    let folded: i32 = sqlx::query_scalar(fold).fetch_one(&mut *b).await?;
    assert_eq!(
        folded, 1,
        "once A committed, the next fold takes the wake-up"
    );
    drop(b);
    assert_eq!(wakeups_of(&store, stream).await?, 0);
    let claimed = store.claim_work(holder, LEASE, 10, 10, None).await?;
    assert_eq!(
        claimed.iter().map(|r| r.stream_version).collect::<Vec<_>>(),
        vec![1, 2],
        "both rows are claimable"
    );
    Ok(())
}

/// A fold takes every wake-up of the lanes it folds, not only the first p_max it found
/// (RELIABILITY.md, finding D: 563 000 wake-ups of 6 000 lanes were folded a thousand at a
/// time, each lane again and again). Catches: a fold that deletes only the wake-ups of its
/// first batch.
#[tokio::test]
async fn a_fold_takes_every_wake_up_of_the_lanes_it_folds() -> TestResult {
    let ctx = setup().await?;
    let store = ctx.store.clone();
    perspective(&store, "P1", &["*"]).await?;
    let stream = Uuid::new_v4();
    for _ in 0..20 {
        append(&store, stream, &["E"]).await?;
    }
    assert_eq!(
        wakeups_of(&store, stream).await?,
        20,
        "one wake-up per append"
    );
    let folded: i32 = sqlx::query_scalar("SELECT wh_fold_lane_wakeups(1)")
        .fetch_one(store.pool())
        .await?;
    assert_eq!(folded, 20, "the fold took the lane's whole backlog");
    assert_eq!(wakeups_of(&store, stream).await?, 0);
    Ok(())
}

/// A fold that takes a lane's other wake-ups decides from all of them (L2): an append behind a
/// parked head (which alone leaves the hint) and a requeue ahead of it (which makes the lane due
/// now), folded by one fold that found only one of them first, leave the lane due now.
/// Catches: a fold that decides from its first batch and deletes the rest unread (the requeued
/// head would wait out the parked row's backoff).
#[tokio::test]
async fn a_fold_decides_from_every_wake_up_it_takes() -> TestResult {
    let ctx = setup().await?;
    let store = ctx.store.clone();
    perspective(&store, "P1", &["*"]).await?;
    let stream = Uuid::new_v4();
    append(&store, stream, &["E", "E"]).await?;
    let holder = live_instance(&store).await?;
    let rows = store.claim_work(holder, LEASE, 1, 1, None).await?;
    assert_eq!(rows.len(), 1);
    let head = rows[0].event_work_id;
    let moved: Option<Uuid> = sqlx::query_scalar(
        "SELECT move_to_dead_letters(gen_random_uuid(), 'wh_perspective_events', $1, \
         'PermanentFailure', 'boom', NULL)",
    )
    .bind(head)
    .fetch_one(store.pool())
    .await?;
    let letter = moved.expect("the head is dead-lettered");
    // The next row is the head now; park the lane as a failing head would.
    sqlx::query(
        "UPDATE wh_perspective_lanes SET due_at = now() + interval '1 hour' WHERE stream_id = $1",
    )
    .bind(stream)
    .execute(store.pool())
    .await?;
    append(&store, stream, &["E"]).await?; // behind the head: leaves the hint
    assert!(store.requeue_dead_letter(letter, "test").await?); // ahead of it: due now
    assert_eq!(wakeups_of(&store, stream).await?, 2);

    let folded: i32 = sqlx::query_scalar("SELECT wh_fold_lane_wakeups(1)")
        .fetch_one(store.pool())
        .await?;
    assert_eq!(folded, 2, "one fold takes both wake-ups");
    let due_now: bool =
        sqlx::query_scalar("SELECT due_at <= now() FROM wh_perspective_lanes WHERE stream_id = $1")
            .bind(stream)
            .fetch_one(store.pool())
            .await?;
    assert!(due_now, "the requeued head makes the lane due now");
    Ok(())
}

/// The lane index's safety net (`wh_reconcile_lanes`) repairs a lane only when, in one snapshot,
/// it has work and neither a lane row nor a wake-up. Its walk of the work table and its check
/// of the lane index were two statements, two snapshots: a lane drained between them (its last
/// row completed, its lane row deleted with it) was "repaired", an empty lane given a row and a
/// WARN telling the operator of a restore that never happened (ten such lines in a six-minute
/// `vantage soak`). Here one lane is filled and drained over and over, first in the walk's
/// order, while the safety net walks it and a few hundred lanes that keep their work.
/// Catches: the check not re-reading the work in its own snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lane_safety_net_never_repairs_a_lane_drained_while_it_walked() -> TestResult {
    let env = setup().await?;
    let store = env.store.clone();
    perspective(&store, "p", &["E"]).await?;
    // Lanes the walk visits after the churned one (it walks in (perspective, stream) order).
    for _ in 0..300 {
        append(&store, Uuid::new_v4(), &["E"]).await?;
    }
    sqlx::query("SELECT wh_fold_lane_wakeups(100000)")
        .execute(store.pool())
        .await?;
    let churned = Uuid::from_u128(1);
    let instance = live_instance(&store).await?;

    const CYCLES: usize = 300;
    let churn = {
        let store = store.clone();
        tokio::spawn(async move {
            for _ in 0..CYCLES {
                append(&store, churned, &["E"]).await?;
                sqlx::query("SELECT wh_fold_lane_wakeups(1000)")
                    .execute(store.pool())
                    .await?;
                let rows = claim_lane(&store, instance, churned, "p").await?;
                let ids: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
                sqlx::query("SELECT complete_perspective_events($1, $2)")
                    .bind(instance.0)
                    .bind(&ids)
                    .execute(store.pool())
                    .await?;
            }
            anyhow::Ok(())
        })
    };
    let mut walks = 0;
    let mut repaired = Vec::new();
    while !churn.is_finished() {
        let found: Vec<(Uuid, String)> = sqlx::query_as(
            "SELECT repaired_stream, repaired_perspective \
             FROM wh_reconcile_lanes(NULL, NULL, 1000) WHERE repaired_stream IS NOT NULL",
        )
        .fetch_all(store.pool())
        .await?;
        repaired.extend(found);
        walks += 1;
    }
    churn.await??;
    assert!(walks > 10, "the safety net walked only {walks} times");
    assert!(
        repaired.is_empty(),
        "{} lanes \"repaired\" in {walks} walks that never lost their index: {:?}",
        repaired.len(),
        &repaired[..repaired.len().min(5)]
    );
    Ok(())
}

/// The queue tables empty their tail pages again and again (every completed row is deleted), and
/// autovacuum then truncated them: to truncate it takes the table's ACCESS EXCLUSIVE lock, which
/// every claim, completion and append needs too, and waits up to 5 s for it (the soak's lone
/// one-second lag spikes long after a fault, beside `VacuumTruncate` waits). The pages are reused
/// by the next inserts anyway, so vacuum leaves them: here a vacuum of the drained tables, with a
/// reader holding its ordinary lock, never waits to truncate.
/// Catches: `vacuum_truncate` left on for a queue table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vacuum_never_waits_to_truncate_a_queue_table() -> TestResult {
    let env = setup().await?;
    let store = env.store.clone();
    perspective(&store, "p", &["E"]).await?;
    for _ in 0..400 {
        append(&store, Uuid::new_v4(), &["E", "E", "E"]).await?;
    }
    sqlx::query("SELECT wh_fold_lane_wakeups(100000)")
        .execute(store.pool())
        .await?;
    for table in [
        "wh_perspective_events",
        "wh_lane_wakeups",
        "wh_perspective_lanes",
    ] {
        sqlx::query(&format!("DELETE FROM {table}"))
            .execute(store.pool())
            .await?;
        // A reader in the middle of a transaction, as a claim or a producer always is somewhere.
        let mut reader = store.pool().begin().await?;
        sqlx::query(&format!("SELECT count(*) FROM {table}"))
            .execute(&mut *reader)
            .await?;
        let mut vacuum = store.pool().acquire().await?;
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *vacuum)
            .await?;
        let statement = format!("VACUUM {table}");
        let running = tokio::spawn(async move {
            sqlx::query(&statement)
                .execute(&mut *vacuum)
                .await
                .map(|_| ())
        });
        let mut waited_to_truncate = false;
        while !running.is_finished() {
            let wait: Option<String> =
                sqlx::query_scalar("SELECT wait_event FROM pg_stat_activity WHERE pid = $1")
                    .bind(pid)
                    .fetch_optional(store.pool())
                    .await?
                    .flatten();
            waited_to_truncate |= wait.as_deref() == Some("VacuumTruncate");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        running.await??;
        reader.rollback().await?;
        assert!(
            !waited_to_truncate,
            "VACUUM {table} waited for the table's exclusive lock to truncate it"
        );
    }
    Ok(())
}

/// Every claim begins by folding wake-ups into the lane index, and when the fold fell behind (a
/// fault, a rebuild, a saturated machine) it stayed behind: the fold's statement that gathers
/// every wake-up of the lanes it took was planned from the wake-ups table's statistics, which
/// autovacuum takes when the table is nearly empty (a queue's usual state), and the planner
/// joined a scan of all wake-ups against the lanes one pair at a time. With 30 000 wake-ups that
/// is 22 million comparisons per claim: claims of 5 to 18 s on the CPU, eight at once, while the
/// wake-ups piled up further (`vantage soak`, minutes of lag after every fault). Here the table
/// holds 30 000 wake-ups while its statistics say it is empty, and the work of one fold (rows
/// produced and rows filtered out, over every plan node of every statement it runs, as
/// `auto_explain` counts them) must stay in proportion to the wake-ups, whatever the plan.
/// Catches: a fold statement whose cost is the product of the wake-ups and the lanes folded.
#[tokio::test(flavor = "current_thread")]
async fn a_fold_behind_by_thousands_of_wakeups_does_work_in_proportion_to_them() -> TestResult {
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::layer::SubscriberExt as _;

    let env = setup().await?;
    let store = env.store.clone();
    perspective(&store, "p", &["E"]).await?;
    const LANES: i32 = 6_000;
    const PER_LANE: i32 = 5;
    const WAKEUPS: i64 = (LANES * PER_LANE) as i64;
    let fill = "INSERT INTO wh_lane_wakeups (stream_id, perspective_name, min_version) \
                SELECT md5(l::text)::uuid, 'p', v \
                FROM generate_series(1, $1) v, generate_series(1, $2) l";
    // Statistics taken while the table was empty, its pages kept (as autovacuum leaves a queue).
    sqlx::query(fill)
        .bind(PER_LANE)
        .bind(LANES)
        .execute(store.pool())
        .await?;
    sqlx::query("DELETE FROM wh_lane_wakeups")
        .execute(store.pool())
        .await?;
    sqlx::query("VACUUM ANALYZE wh_lane_wakeups")
        .execute(store.pool())
        .await?;
    sqlx::query(fill)
        .bind(PER_LANE)
        .bind(LANES)
        .execute(store.pool())
        .await?;

    // The plans of the fold's statements, as notices to this session (a current-thread runtime:
    // the connection's notices are traced on this thread, where the collector is installed).
    let notices = Arc::new(Mutex::new(Vec::<String>::new()));
    let _collector = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(NoticeCollector(notices.clone())),
    );
    let mut session = store.pool().acquire().await?;
    for set in [
        "LOAD 'auto_explain'",
        "SET auto_explain.log_min_duration = 0",
        "SET auto_explain.log_nested_statements = on",
        "SET auto_explain.log_analyze = on",
        "SET auto_explain.log_timing = off",
        "SET auto_explain.log_format = 'json'",
        "SET auto_explain.log_level = 'notice'",
        "SET client_min_messages = 'notice'",
    ] {
        sqlx::query(set).execute(&mut *session).await?;
    }
    let folded: i32 = sqlx::query_scalar("SELECT wh_fold_lane_wakeups(1000)")
        .fetch_one(&mut *session)
        .await?;
    // (closed, not returned: its explain settings must not reach another user of the pool)
    sqlx::Connection::close(session.detach()).await?;
    assert!(folded > 0, "the fold folded nothing");

    let notices = notices.lock().unwrap().clone();
    let mut work = 0.0;
    let mut worst = (0.0, String::new());
    for notice in &notices {
        let Some((_, json)) = notice.split_once('\n') else {
            continue;
        };
        let Ok(explained) = serde_json::from_str::<serde_json::Value>(json) else {
            continue;
        };
        let statement = plan_work(&explained["Plan"]);
        work += statement;
        if statement > worst.0 {
            let text = explained["Query Text"].as_str().unwrap_or("").trim();
            worst = (statement, text.chars().take(120).collect());
        }
    }
    assert!(
        notices.len() > 3,
        "auto_explain reported {} plans: {notices:?}",
        notices.len()
    );
    // A fold that takes its lanes' wake-ups by the lane, with hashing or an index, does a few
    // units of work per wake-up (3 here); the plan that compared every wake-up with every lane
    // taken did 1 839 here.
    assert!(
        work <= 20.0 * WAKEUPS as f64,
        "one fold of {folded} wake-ups (of {WAKEUPS}) did {work} units of work, \
         {:.0} per wake-up; the most in: {} ({} units)",
        work / WAKEUPS as f64,
        worst.1,
        worst.0
    );
    Ok(())
}

/// The rows a plan node and its children produced and filtered out, over all their loops.
fn plan_work(node: &serde_json::Value) -> f64 {
    let number = |key: &str| node[key].as_f64().unwrap_or(0.0);
    let loops = number("Actual Loops").max(1.0);
    let own = (number("Actual Rows")
        + number("Rows Removed by Filter")
        + number("Rows Removed by Join Filter")
        + number("Rows Removed by Index Recheck"))
        * loops;
    let children: f64 = node["Plans"]
        .as_array()
        .map(|plans| plans.iter().map(plan_work).sum())
        .unwrap_or(0.0);
    own + children
}

/// Collects the messages of the notices sqlx traces for a session.
struct NoticeCollector(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for NoticeCollector {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() != "sqlx::postgres::notice" {
            return;
        }
        struct Message(Option<String>);
        impl tracing::field::Visit for Message {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                if field.name() == "message" {
                    self.0 = Some(value.to_owned());
                }
            }
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" && self.0.is_none() {
                    self.0 = Some(format!("{value:?}"));
                }
            }
        }
        let mut message = Message(None);
        event.record(&mut message);
        if let Some(text) = message.0 {
            self.0.lock().unwrap().push(text);
        }
    }
}
