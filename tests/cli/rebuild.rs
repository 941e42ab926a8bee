//! `vantage perspectives rebuild` against a running daemon (issue 7, defects 1 and 2): the real
//! binary and an in-process daemon sharing one PostgreSQL database.
//!
//! The tests are deterministic, not timing races: the perspective's apply statement and its
//! `reset` statement each wait on a row lock the test holds (a "gate"), so the test decides
//! what is in flight when. Waits are bounded liveness waits; nothing asserts a duration.

use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};
use uuid::Uuid;
use vantage::config::Settings;
use vantage::daemon::{DaemonBuilder, RunningDaemon};
use vantage::internals::store::{InstanceInfo, MoveOutcome, StoreInternals as _};
use vantage::store::{InstanceId, NewEvent};

use crate::support::{self, Env};

/// `ledger` records every apply, in apply order (`seq`), with no uniqueness: an event applied
/// twice shows up twice. Its apply waits while `apply_gate` is locked, its reset while
/// `reset_gate` is locked. The reset is DELETE-based (no table lock to hide behind).
const LEDGER: &str = r#"
[[perspectives]]
name = "ledger"
events = ["Tick"]
reset = "WITH gate AS (SELECT id FROM public.reset_gate FOR SHARE), wiped AS (DELETE FROM public.rebuild_log RETURNING 1) SELECT (SELECT count(*) FROM gate), (SELECT count(*) FROM wiped)"
[perspectives.sql]
Tick = "INSERT INTO public.rebuild_log (stream_id, version) SELECT $2, $6 FROM public.apply_gate FOR SHARE"
"#;

const TABLES: &str = "
CREATE TABLE public.rebuild_log (seq bigserial PRIMARY KEY, stream_id uuid NOT NULL, version int NOT NULL);
CREATE TABLE public.apply_gate (id int PRIMARY KEY); INSERT INTO public.apply_gate VALUES (1);
CREATE TABLE public.reset_gate (id int PRIMARY KEY); INSERT INTO public.reset_gate VALUES (1);
";

async fn env() -> Env {
    let mut env = Env::migrated().await;
    env.exec(TABLES).await;
    env.store
        .register_perspective("ledger", &["Tick".to_owned()])
        .await
        .unwrap();
    let toml = support::fast_daemon_toml(&env.url, LEDGER);
    env.set_config(&toml);
    env
}

/// This file's own helpers on the shared [`Env`].
impl Env {
    async fn daemon(&self) -> RunningDaemon {
        DaemonBuilder::new(Settings::from_toml_str(&self.toml).unwrap())
            .store(self.store.clone())
            .without_http()
            .start()
            .await
            .expect("daemon starts")
    }

    /// `vantage perspectives rebuild ledger --yes`, started (not awaited).
    fn start_rebuild(&self) -> tokio::process::Child {
        let mut cmd = support::base_command();
        cmd.arg("--config")
            .arg(&self.config)
            .args(["perspectives", "rebuild", "ledger", "--yes"])
            .current_dir(self.dir.path());
        cmd.spawn().expect("spawn vantage")
    }

    /// Appends `n` `Tick` events to `stream`.
    async fn append_ticks(&self, stream: Uuid, n: usize) {
        let events: Vec<NewEvent> = (0..n)
            .map(|_| NewEvent::new("Tick", serde_json::json!({})))
            .collect();
        self.store
            .append_events(stream, None, &events)
            .await
            .unwrap();
    }

    /// Waits until `sql` counts at least one row; false after `limit`.
    async fn eventually(&self, sql: &str, limit: Duration) -> bool {
        let started = Instant::now();
        while started.elapsed() < limit {
            if self.scalar(sql).await > 0 {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        false
    }

    /// A session of this test (outside the store's pool) holding `gate` locked until committed.
    async fn lock_gate(&self, gate: &str) -> PgConnection {
        let mut conn = PgConnection::connect(&self.db.url).await.unwrap();
        sqlx::raw_sql(&format!("BEGIN; SELECT id FROM public.{gate} FOR UPDATE"))
            .execute(&mut conn)
            .await
            .unwrap();
        conn
    }

    /// Versions of `stream` in apply order.
    async fn applied(&self, stream: Uuid) -> Vec<i32> {
        sqlx::query_scalar(
            "SELECT version FROM public.rebuild_log WHERE stream_id = $1 ORDER BY seq",
        )
        .bind(stream)
        .fetch_all(self.store.pool())
        .await
        .unwrap()
    }
}

/// Some backend of this database waits for a lock while running a statement mentioning `what`.
fn waiting_on(what: &str) -> String {
    format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND wait_event_type = 'Lock' AND query LIKE '%{what}%'"
    )
}

async fn open(gate: PgConnection) {
    let mut gate = gate;
    sqlx::raw_sql("COMMIT").execute(&mut gate).await.unwrap();
    let _ = gate.close().await;
}

async fn finished(child: tokio::process::Child) -> support::Run {
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("the rebuild did not finish within 60 s")
        .unwrap();
    support::Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

const DRAINED: &str =
    "SELECT count(*) FROM wh_perspective_events WHERE perspective_name = 'ledger'";

async fn wait_drained(env: &Env) {
    let started = Instant::now();
    while env.scalar(DRAINED).await > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the daemon did not drain ledger within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Defect 1. A rebuild of a perspective while the daemon runs it: one lane has an apply in
/// flight when the rebuild starts, and new events arrive on both lanes while the rebuild resets
/// and re-queues. Afterwards every lane was applied, since the reset, in stream order and each
/// event exactly once. Before the fix, the daemon applied the newer rows while the re-queued
/// history was still invisible (`[4, 1, 2, 3]`), and the in-flight apply that committed after
/// the reset's snapshot was both kept and re-applied (`[4, 5, 1, 2, 3, 4]`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuild_on_a_running_daemon_keeps_lanes_in_order_and_applies_each_event_once() {
    let env = env().await;
    let daemon = env.daemon().await;
    let (s1, s2) = (Uuid::new_v4(), Uuid::new_v4());
    env.append_ticks(s1, 3).await;
    env.append_ticks(s2, 3).await;
    wait_drained(&env).await;
    assert_eq!(env.applied(s1).await, [1, 2, 3]);

    // An apply in flight: s1 v4 waits at the apply gate, leased to the daemon.
    let apply_gate = env.lock_gate("apply_gate").await;
    env.append_ticks(s1, 1).await;
    assert!(
        env.eventually(&waiting_on("apply_gate"), Duration::from_secs(20))
            .await,
        "the daemon never started applying s1 v4"
    );

    // The rebuild starts; its reset waits at the reset gate (if it gets that far).
    let reset_gate = env.lock_gate("reset_gate").await;
    let rebuild = env.start_rebuild();
    env.eventually(&waiting_on("reset_gate"), Duration::from_secs(3))
        .await;
    // The in-flight apply finishes, and new events arrive during the rebuild.
    open(apply_gate).await;
    env.append_ticks(s1, 1).await;
    env.append_ticks(s2, 1).await;
    // Give the daemon every chance to apply them (it must not, before the rebuild is done).
    env.eventually(
        &format!(
            "SELECT count(*) FROM public.rebuild_log \
             WHERE (stream_id = '{s1}' AND version = 5) OR (stream_id = '{s2}' AND version = 4)"
        ),
        Duration::from_secs(2),
    )
    .await;
    open(reset_gate).await;

    let run = finished(rebuild).await;
    assert_eq!(run.code, 0, "{run:#?}");
    wait_drained(&env).await;
    assert_eq!(env.applied(s1).await, [1, 2, 3, 4, 5], "s1, in apply order");
    assert_eq!(env.applied(s2).await, [1, 2, 3, 4], "s2, in apply order");
    daemon.shutdown().await.unwrap();
}

/// Defect 2. A rebuild racing a dead-letter move (the move's transaction is open while the
/// rebuild re-queues history) never leaves an open dead letter AND a work row for one event:
/// either the move commits first and the rebuild skips the event, or the move waits. Before
/// the fix, the rebuild's re-queue waited for the move's row lock, then inserted the event
/// again next to its fresh dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuild_racing_a_dead_letter_move_never_queues_a_dead_lettered_event() {
    let env = env().await;
    let instance = InstanceId::new();
    env.store
        .heartbeat(instance, &InstanceInfo::current("vantage-test"))
        .await
        .unwrap();
    let s = Uuid::new_v4();
    env.append_ticks(s, 3).await;
    let poison: Uuid = sqlx::query_scalar(
        "SELECT event_work_id FROM wh_perspective_events WHERE stream_id = $1 AND stream_version = 2",
    )
    .bind(s)
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    // Leased to the instance, as the daemon's pre-filter sees it.
    sqlx::query(
        "UPDATE wh_perspective_events SET instance_id = $1, lease_expiry = now() + interval '1 minute', \
         attempts = 11 WHERE event_work_id = $2",
    )
    .bind(instance.0)
    .bind(poison)
    .execute(env.store.pool())
    .await
    .unwrap();
    // The daemon's v1 was applied and completed before (so the rebuild re-queues it).
    sqlx::query("DELETE FROM wh_perspective_events WHERE stream_id = $1 AND stream_version = 1")
        .bind(s)
        .execute(env.store.pool())
        .await
        .unwrap();

    let mut mover = env.store.pool().begin().await.unwrap();
    let moved = vantage::internals::leases::move_to_dead_letters(
        &mut *mover,
        instance,
        poison,
        "MaxAttemptsExceeded",
        "claimed 11 times",
    )
    .await
    .unwrap();
    assert!(matches!(moved, MoveOutcome::Moved(_)), "{moved:?}");

    let rebuild = env.start_rebuild();
    // The rebuild waits for the move (before the fix: on its row; after: on the rebuild lock).
    assert!(
        env.eventually(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock'",
            Duration::from_secs(20)
        )
        .await,
        "the rebuild never waited for the move"
    );
    mover.commit().await.unwrap();
    let run = finished(rebuild).await;
    assert_eq!(run.code, 0, "{run:#?}");

    let both = env
        .scalar(
            "SELECT count(*) FROM wh_dead_letters d JOIN wh_perspective_events pe \
             ON pe.perspective_name = d.perspective_name AND pe.event_id = d.event_id \
             WHERE d.status = 'exhausted'",
        )
        .await;
    assert_eq!(both, 0, "an open dead letter and a work row for one event");
    let queued: Vec<i32> = sqlx::query_scalar(
        "SELECT stream_version FROM wh_perspective_events WHERE stream_id = $1 ORDER BY stream_version",
    )
    .bind(s)
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    assert_eq!(
        queued,
        [1, 3],
        "v1 re-queued, v3 still queued, v2 dead-lettered"
    );
}

/// A rebuild interrupted (the CLI killed while its reset runs) changes nothing and leaves
/// nothing paused: the read model and the queue are as before, and the daemon goes on applying
/// the perspective's new events once the server has ended the killed session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_rebuild_changes_nothing_and_pauses_nothing() {
    let env = env().await;
    let daemon = env.daemon().await;
    let s = Uuid::new_v4();
    env.append_ticks(s, 2).await;
    wait_drained(&env).await;

    let reset_gate = env.lock_gate("reset_gate").await;
    let mut rebuild = env.start_rebuild();
    assert!(
        env.eventually(&waiting_on("reset_gate"), Duration::from_secs(20))
            .await,
        "the rebuild never reached its reset"
    );
    rebuild.kill().await.unwrap();
    // The killed session's backend notices once its statement ends.
    open(reset_gate).await;

    env.append_ticks(s, 1).await;
    wait_drained(&env).await;
    assert_eq!(
        env.applied(s).await,
        [1, 2, 3],
        "nothing reset, nothing re-queued"
    );
    daemon.shutdown().await.unwrap();
}

/// A second rebuild of a perspective while one runs (holds the rebuild lock) is refused with
/// exit 2 and changes nothing; once the first is done, a rebuild runs.
#[tokio::test]
async fn a_second_rebuild_of_a_perspective_is_refused_while_one_runs() {
    let env = env().await;
    let s = Uuid::new_v4();
    env.append_ticks(s, 2).await;
    let mut first = env.store.pool().acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(wh_perspective_lock_key('ledger'))")
        .execute(&mut *first)
        .await
        .unwrap();
    finished(env.start_rebuild()).await.expect_error(
        "Perspective 'ledger' is already being rebuilt by another command. Nothing was changed.",
    );
    assert_eq!(env.scalar(DRAINED).await, 2, "nothing re-queued or reset");

    sqlx::query("SELECT pg_advisory_unlock(wh_perspective_lock_key('ledger'))")
        .execute(&mut *first)
        .await
        .unwrap();
    let run = finished(env.start_rebuild()).await;
    assert_eq!(run.code, 0, "{run:#?}");
}

/// A rebuild never waits without bound inside its transaction: a reset stuck behind another
/// session's lock gives up after `worker.lease` (here 1 s), exit 2, nothing changed, the lock
/// released.
#[tokio::test]
async fn a_rebuild_stuck_behind_a_lock_gives_up_after_the_lease_and_changes_nothing() {
    let env = env().await;
    std::fs::write(
        &env.config,
        env.toml.replace("lease = \"10s\"", "lease = \"1s\""),
    )
    .unwrap();
    let s = Uuid::new_v4();
    env.append_ticks(s, 2).await;
    let reset_gate = env.lock_gate("reset_gate").await;
    let run = finished(env.start_rebuild()).await;
    assert_eq!((run.code, run.stdout.as_str()), (2, ""), "{run:#?}");
    assert!(
        run.stderr
            .starts_with("Rebuild of 'ledger' failed: the reset statement failed: ")
            && run.stderr.contains("lock timeout")
            && run.stderr.ends_with(". Nothing was changed.\n"),
        "{run:#?}"
    );
    open(reset_gate).await;
    assert_eq!(env.scalar(DRAINED).await, 2, "the queue as it was");
    let rebuilding: bool = sqlx::query_scalar("SELECT wh_perspective_is_rebuilding('ledger')")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    assert!(!rebuilding, "the rebuild lock is released");
}

/// A rebuild killed after its reset, while it re-queues the history in chunks (played here by
/// the mark such a rebuild leaves: `rebuild_up_to` set, no lock held), leaves the perspective
/// unclaimed: no lane is applied with a gap. Rebuilding again redoes it: every event applied
/// once after the reset, in stream order, and the mark gone. Catches: a re-queue in one long
/// transaction (this test's shape is what it avoids), claims that resume on a partly re-queued
/// perspective.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_killed_while_requeueing_leaves_the_perspective_unclaimed_until_redone() {
    let env = env().await;
    let daemon = env.daemon().await;
    let s = Uuid::new_v4();
    env.append_ticks(s, 2).await;
    wait_drained(&env).await;

    // The killed rebuild: reset done, mark set, part of the history not queued again.
    sqlx::raw_sql(
        "TRUNCATE public.rebuild_log; \
         UPDATE wh_perspectives SET rebuild_up_to = (SELECT max(global_position) FROM wh_event_store), \
                rebuild_started_at = now() WHERE perspective_name = 'ledger'",
    )
    .execute(env.store.pool())
    .await
    .unwrap();
    env.append_ticks(s, 1).await;
    assert!(
        !env.eventually(
            "SELECT count(*) FROM public.rebuild_log",
            Duration::from_secs(2)
        )
        .await,
        "nothing of a perspective with an unfinished rebuild is applied"
    );

    let run = finished(env.start_rebuild()).await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert!(
        run.stderr.contains("was interrupted"),
        "the rebuild says it redoes an interrupted one: {run:#?}"
    );
    wait_drained(&env).await;
    assert_eq!(env.applied(s).await, [1, 2, 3], "each event once, in order");
    assert_eq!(
        env.scalar("SELECT count(*) FROM wh_perspectives WHERE rebuild_up_to IS NOT NULL")
            .await,
        0,
        "the mark is cleared"
    );
    daemon.shutdown().await.unwrap();
}

/// (stream_version, replay) of the rows a claim returns for `stream` (migration 0016).
async fn claimed_replay(env: &Env, instance: InstanceId, stream: Uuid) -> Vec<(i32, bool)> {
    sqlx::query_as(
        "SELECT g.stream_version, g.replay FROM get_stream_events($1, $2, 60) g \
         ORDER BY g.stream_version",
    )
    .bind(instance.0)
    .bind(vec![stream])
    .fetch_all(env.store.pool())
    .await
    .unwrap()
}

/// Issue 21 item 5. Every event `perspectives rebuild` delivers again is claimed with `replay`
/// true (a perspective with side effects skips them), while an event appended after the rebuild,
/// and one still queued when it began (never delivered), are claimed with `replay` false.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuilds_redeliveries_are_replays_and_later_events_are_not() {
    let env = env().await;
    let daemon = env.daemon().await;
    let s = Uuid::new_v4();
    env.append_ticks(s, 3).await;
    wait_drained(&env).await;
    daemon.shutdown().await.unwrap();
    // Appended while no daemon runs: still queued when the rebuild starts.
    env.append_ticks(s, 1).await;

    let run = finished(env.start_rebuild()).await;
    assert_eq!(run.code, 0, "{run:#?}");
    env.append_ticks(s, 1).await;

    let instance = InstanceId::new();
    env.store
        .heartbeat(instance, &InstanceInfo::current("vantage-test"))
        .await
        .unwrap();
    assert_eq!(
        claimed_replay(&env, instance, s).await,
        [(1, true), (2, true), (3, true), (4, false), (5, false)]
    );
}
