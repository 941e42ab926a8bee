//! End to end: triage at scale (docs/cli.md, "Commands" and "vantage dlq"; issue 11) through the
//! built binary against a real PostgreSQL: `dlq groups`, `requeue | purge --group`, `--limit`,
//! `status --blocked`, `perspectives pause | resume`, `dlq replay --dry-run`.

use serde_json::{json, Value};
use uuid::Uuid;
use vantage::internals::store::StoreInternals as _;

use crate::support;
use crate::support::{assert_golden, seeded, Env};

const NUMERIC: &str = "invalid input syntax for type numeric: \"{v}\" (SQLSTATE 22P02)";
const DUPLICATE: &str = "duplicate key value violates unique constraint \"order_summary_pkey\" Key (order_id)=({v}) already exists. (SQLSTATE 23505)";

/// [`seeded`] plus six more OrderPlaced events (positions 5-10, one stream each), dead-lettered
/// in three error groups: order_summary 5, 6, 7 (numeric, three different values), order_summary
/// 8, 9 (duplicate key, two different ids), audit 10 (no SQLSTATE).
async fn with_groups() -> Env {
    let env = seeded().await;
    for i in 0..6 {
        let order = Uuid::new_v4().to_string();
        env.append(
            Uuid::new_v4(),
            &[("OrderPlaced", json!({"order_id": order, "total": i}))],
        )
        .await;
    }
    for (position, value) in [(5, "abc"), (6, "12x"), (7, "")] {
        env.dead_letter_with_error(
            "order_summary",
            position,
            "MaxAttemptsExceeded",
            &NUMERIC.replace("{v}", value),
        )
        .await;
    }
    for position in [8, 9] {
        env.dead_letter_with_error(
            "order_summary",
            position,
            "MaxAttemptsExceeded",
            &DUPLICATE.replace("{v}", &Uuid::new_v4().to_string()),
        )
        .await;
    }
    env.dead_letter_with_error("audit", 10, "PermanentFailure", "handler failed: boom 42")
        .await;
    env
}

fn groups_of(run: &support::Run) -> Vec<Value> {
    assert_eq!(run.code, 0, "{run:#?}");
    run.json()["data"]["groups"].as_array().unwrap().clone()
}

#[tokio::test]
async fn groups_mask_the_variable_parts_biggest_first() {
    let env = with_groups().await;

    let run = env.run(&["dlq", "groups"]).await;
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{run:#?}");
    assert_golden("dlq_groups.txt", &run.stdout);

    let groups = groups_of(&env.run(&["dlq", "groups", "--json"]).await);
    assert_eq!(groups.len(), 3, "{groups:#?}");
    let summary: Vec<(i64, &str, Value, &str, i64)> = groups
        .iter()
        .map(|g| {
            (
                g["count"].as_i64().unwrap(),
                g["perspective"].as_str().unwrap(),
                g["sqlstate"].clone(),
                g["message"].as_str().unwrap(),
                g["sample_position"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            (
                3,
                "order_summary",
                json!("22P02"),
                "invalid input syntax for type numeric: \"?\"",
                5
            ),
            (
                2,
                "order_summary",
                json!("23505"),
                "duplicate key value violates unique constraint \"order_summary_pkey\" Key (order_id)=(?) already exists.",
                8
            ),
            (1, "audit", Value::Null, "handler failed: boom <n>", 10),
        ]
    );
    for g in &groups {
        let keys: Vec<&str> = g.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "count",
                "event_type",
                "fingerprint",
                "first_seen",
                "last_seen",
                "message",
                "perspective",
                "sample_position",
                "sqlstate"
            ]
        );
        assert_eq!(g["event_type"], "OrderPlaced");
        let fp = g["fingerprint"].as_str().unwrap();
        assert_eq!(fp.len(), 12, "{fp}");
        assert!(fp.chars().all(|c| c.is_ascii_hexdigit()), "{fp}");
    }

    // One perspective; an unknown one; none at all.
    let audit = groups_of(
        &env.run(&["dlq", "groups", "--perspective", "audit", "--json"])
            .await,
    );
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0]["fingerprint"], groups[2]["fingerprint"]);
    env.run(&["dlq", "groups", "--perspective", "nope"])
        .await
        .expect_error("No perspective named 'nope' is registered.");
    env.run(&["dlq", "groups", "--perspective", "legacy"])
        .await
        .expect(0, "No dead-lettered events.\n", "");
}

#[tokio::test]
async fn requeue_and_purge_by_group_with_dry_run_limit_and_confirmation() {
    let env = with_groups().await;
    let groups = groups_of(&env.run(&["dlq", "groups", "--json"]).await);
    let numeric = groups[0]["fingerprint"].as_str().unwrap().to_owned();
    let duplicate = groups[1]["fingerprint"].as_str().unwrap().to_owned();

    // Dry run: the group's members, nothing changed.
    env.run(&["dlq", "requeue", "--group", &numeric, "--dry-run"])
        .await
        .expect(
            0,
            "Would requeue 3 dead-lettered event(s) (dry run; nothing was changed):\n  \
             position 5 of 'order_summary' (MaxAttemptsExceeded)\n  \
             position 6 of 'order_summary' (MaxAttemptsExceeded)\n  \
             position 7 of 'order_summary' (MaxAttemptsExceeded)\n",
            "",
        );
    // No terminal, no --yes: refused after the count.
    let run = env.run(&["dlq", "requeue", "--group", &numeric]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert!(
        run.stderr
            .starts_with("3 dead-lettered event(s) to requeue:\n"),
        "{run:#?}"
    );
    assert_eq!(env.status_of("order_summary", 5).await, "exhausted");

    // --limit 2: the two lowest positions, the rest left and said so.
    let run = env
        .run(&[
            "dlq", "requeue", "--group", &numeric, "--limit", "2", "--yes",
        ])
        .await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert_eq!(
        run.stdout,
        "Requeued position 5 of 'order_summary'.\n\
         Requeued position 6 of 'order_summary'.\n\
         Requeued 2 of 2 dead-lettered event(s).\n"
    );
    assert!(
        run.stderr
            .contains("1 more match beyond --limit; they are left as they are.\n"),
        "{run:#?}"
    );
    assert_eq!(env.status_of("order_summary", 5).await, "requeued");
    assert_eq!(env.status_of("order_summary", 6).await, "requeued");
    assert_eq!(env.status_of("order_summary", 7).await, "exhausted");
    // The daemon has the work back, attempts reset.
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM wh_perspective_events \
             WHERE perspective_name = 'order_summary' AND global_position IN (5, 6) AND attempts = 0"
        )
        .await,
        2
    );
    let left = groups_of(&env.run(&["dlq", "groups", "--json"]).await);
    assert_eq!(left[0]["fingerprint"], json!(duplicate));
    assert_eq!(left[0]["count"], 2);

    // Purge by group: dry run, then confirmed, JSON.
    let run = env
        .run(&["dlq", "purge", "--group", &duplicate, "--dry-run", "--json"])
        .await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert_eq!(run.json()["data"]["count"], 2);
    assert_eq!(run.json()["data"]["purged"], 0);
    assert_eq!(env.status_of("order_summary", 8).await, "exhausted");
    let run = env
        .run(&["dlq", "purge", "--group", &duplicate, "--yes", "--json"])
        .await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert_eq!(
        run.json()["data"],
        json!({
            "count": 2, "dry_run": false, "purged": 2,
            "items": [
                {"outcome": "purged", "perspective": "order_summary", "position": 8, "reason": "MaxAttemptsExceeded"},
                {"outcome": "purged", "perspective": "order_summary", "position": 9, "reason": "MaxAttemptsExceeded"},
            ],
        })
    );
    assert_eq!(env.status_of("order_summary", 9).await, "purged");
    let kinds: Vec<String> = env
        .history_of("order_summary", 9)
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(kinds, ["Exhausted", "Purged"]);

    // A group with nothing open left; a group of another perspective than the filter.
    env.run(&["dlq", "purge", "--group", &duplicate, "--yes"])
        .await
        .expect(0, "No dead-lettered events match; nothing to purge.\n", "");
    env.run(&[
        "dlq",
        "requeue",
        "--group",
        &numeric,
        "--perspective",
        "audit",
        "--yes",
    ])
    .await
    .expect(
        0,
        "No dead-lettered events match; nothing to requeue.\n",
        "",
    );

    // --limit on --all too; usage errors.
    let run = env
        .run(&["dlq", "requeue", "--all", "--limit", "1", "--yes", "--json"])
        .await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert_eq!(run.json()["data"]["requeued"], 1);
    assert_eq!(run.json()["data"]["matching"], 2);
    assert_eq!(
        env.run(&["dlq", "purge", "--limit", "2", "3"]).await.code,
        2
    );
    assert_eq!(env.run(&["dlq", "purge"]).await.code, 2);
    assert_eq!(
        env.run(&["dlq", "requeue", "4", "--limit", "2"]).await.code,
        2
    );
}

// ---------------------------------------------------------------------------------------------
// status --blocked

/// Makes the row of (`perspective`, `position`) a failing head: failures, an error, parked for
/// an hour (as `record_perspective_event_failure` leaves it).
async fn fail_head(env: &Env, perspective: &str, position: i64, failures: i32, error: &str) {
    sqlx::query(
        "UPDATE wh_perspective_events \
         SET attempts = $3, failures = $3, last_error = $4, instance_id = NULL, \
             lease_expiry = NULL, scheduled_for = now() + interval '1 hour' \
         WHERE perspective_name = $1 AND global_position = $2",
    )
    .bind(perspective)
    .bind(position)
    .bind(failures)
    .bind(error)
    .execute(env.store.pool())
    .await
    .unwrap();
}

#[tokio::test]
async fn status_blocked_lists_failing_heads_and_what_waits_behind_them() {
    let env = seeded().await;
    env.run(&["status", "--blocked"])
        .await
        .expect(0, "No blocked lanes.\n", "");

    // order_summary: the head of stream A (position 1) fails; position 2 waits behind it.
    // audit: position 2 fails, but it is not the head (position 1 is): not blocked by it.
    let error = NUMERIC.replace("{v}", "abc");
    fail_head(&env, "order_summary", 1, 3, &error).await;
    fail_head(&env, "audit", 2, 1, "boom").await;

    let run = env.run(&["status", "--blocked", "--json"]).await;
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{run:#?}");
    let data = &run.json()["data"];
    let lanes = data["lanes"].as_array().unwrap();
    assert_eq!(lanes.len(), 1, "{data:#}");
    let os = &lanes[0];
    assert_eq!(os["perspective"], "order_summary");
    assert_eq!(os["head_position"], 1);
    assert_eq!(os["stream_id"], support::STREAM_A.to_string());
    assert_eq!(os["attempts"], 3);
    assert_eq!(os["failures"], 3);
    assert_eq!(os["waiting"], 1);
    assert_eq!(os["leased"], false);
    assert!(os["next_retry_at"].is_string() && os["waiting_since"].is_string());
    assert_eq!(os["last_error"], json!(error));
    assert_eq!(
        data["totals"],
        json!([{"events": 1, "lanes": 1, "perspective": "order_summary"}])
    );

    // The fingerprint is the one its dead letter will have.
    let fingerprint = os["fingerprint"].as_str().unwrap().to_owned();
    env.dead_letter_with_error("order_summary", 1, "MaxAttemptsExceeded", &error)
        .await;
    let groups = groups_of(&env.run(&["dlq", "groups", "--json"]).await);
    assert_eq!(groups[0]["fingerprint"], json!(fingerprint));
    // Dead-lettered, the lane moves on: nothing blocked in order_summary any more.
    let run = env
        .run(&["status", "--blocked", "--perspective", "order_summary"])
        .await;
    run.expect(0, "No blocked lanes.\n", "");

    // The plain status counts them too.
    fail_head(&env, "order_summary", 3, 2, "boom").await;
    let run = env.run(&["status", "--json"]).await;
    let rows = run.json()["data"]["perspectives"]
        .as_array()
        .unwrap()
        .clone();
    let os = rows
        .iter()
        .find(|p| p["perspective"] == "order_summary")
        .unwrap();
    assert_eq!(
        (os["blocked_lanes"].clone(), os["blocked_events"].clone()),
        (json!(1), json!(1))
    );
    let run = env.run(&["status"]).await;
    assert!(
        run.stdout.contains(
            "1 blocked lane(s) holding 1 event(s) behind a parked or failing head: vantage status --blocked"
        ),
        "{run:#?}"
    );
    let run = env.run(&["status", "--blocked"]).await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert!(run.stdout.contains("| order_summary |"), "{run:#?}");
    assert!(
        run.stdout
            .contains("1 blocked lane(s) holding 1 event(s) in 1 perspective(s)."),
        "{run:#?}"
    );
    env.run(&["status", "--blocked", "--perspective", "nope"])
        .await
        .expect_error("No perspective named 'nope' is registered.");
    assert_eq!(env.run(&["status", "--perspective", "audit"]).await.code, 2);
}

// ---------------------------------------------------------------------------------------------
// perspectives pause | resume

/// How many rows of `perspective` one claim of our instance takes (and gives them back, refunded).
async fn claimed(env: &Env, perspective: &str) -> i64 {
    let rows: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT event_work_id, perspective_name \
         FROM get_stream_events($1, NULL, 60, NULL, 100, 100)",
    )
    .bind(env.instance.0)
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    let ids: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
    sqlx::query("SELECT release_unstarted_leases($1, $2)")
        .bind(env.instance.0)
        .bind(&ids)
        .execute(env.store.pool())
        .await
        .unwrap();
    rows.iter().filter(|r| r.1 == perspective).count() as i64
}

#[tokio::test]
async fn a_paused_perspective_is_not_claimed_until_it_is_resumed() {
    let env = seeded().await;
    assert_eq!(claimed(&env, "order_summary").await, 4);

    let run = env
        .run(&[
            "perspectives",
            "pause",
            "order_summary",
            "--reason",
            "fixing the schema",
        ])
        .await;
    run.expect(
        0,
        "Paused perspective 'order_summary': every daemon stops claiming it at its next claim; batches in flight finish, nothing is charged. Resume with: vantage perspectives resume order_summary\n",
        "",
    );
    // Neither claim path takes it; the others are claimed as before; nobody is charged.
    assert_eq!(claimed(&env, "order_summary").await, 0);
    assert_eq!(claimed(&env, "audit").await, 4);
    assert_eq!(
        env.scalar(&format!(
            "SELECT count(*) FROM get_stream_events('{}', ARRAY['{}'::uuid], 60) \
             WHERE perspective_name = 'order_summary'",
            env.instance.0,
            support::STREAM_A
        ))
        .await,
        0
    );
    sqlx::query("SELECT release_unstarted_leases($1, ARRAY(SELECT event_work_id FROM wh_perspective_events WHERE instance_id = $1))")
        .bind(env.instance.0)
        .execute(env.store.pool())
        .await
        .unwrap();
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM wh_perspective_events \
             WHERE perspective_name = 'order_summary' AND attempts > 0"
        )
        .await,
        0
    );

    // status (text and JSON) says so, with the reason and since when.
    let run = env.run(&["status", "--json"]).await;
    let rows = run.json()["data"]["perspectives"]
        .as_array()
        .unwrap()
        .clone();
    let os = rows
        .iter()
        .find(|p| p["perspective"] == "order_summary")
        .unwrap();
    assert_eq!(os["paused"]["reason"], "fixing the schema");
    assert_eq!(
        os["paused"]["by"],
        "operator tester@".to_owned() + &hostname()
    );
    assert!(os["paused"]["since"].is_string());
    let audit = rows.iter().find(|p| p["perspective"] == "audit").unwrap();
    assert_eq!(audit["paused"], Value::Null);
    let run = env.run(&["status"]).await;
    assert!(
        run.stdout.contains("Paused: 'order_summary' since ")
            && run.stdout.contains(": fixing the schema. Its work waits"),
        "{run:#?}"
    );

    // Pausing again changes nothing; JSON.
    let run = env
        .run(&["perspectives", "pause", "order_summary", "--json"])
        .await;
    assert_eq!(run.code, 0, "{run:#?}");
    let data = &run.json()["data"];
    assert_eq!(data["changed"], false);
    assert_eq!(data["paused"], true);
    assert_eq!(data["paused_reason"], "fixing the schema");

    // Resume: claimed again.
    env.run(&["perspectives", "resume", "order_summary"])
        .await
        .expect(
            0,
            "Resumed perspective 'order_summary': daemons claim its work again.\n",
            "",
        );
    assert_eq!(claimed(&env, "order_summary").await, 4);
    env.run(&["perspectives", "resume", "order_summary"])
        .await
        .expect(
            0,
            "Perspective 'order_summary' is not paused. Nothing was changed.\n",
            "",
        );
    for verb in ["pause", "resume"] {
        env.run(&["perspectives", verb, "nope"])
            .await
            .expect_error("No perspective named 'nope' is registered.");
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// dlq replay --dry-run

#[tokio::test]
async fn replay_dry_run_shows_the_rows_before_and_after_or_the_error_and_writes_nothing() {
    let env = seeded().await;
    for (p, n) in [
        ("order_summary", 1),
        ("order_summary", 2),
        ("order_summary", 4),
        ("audit", 1),
    ] {
        env.dead_letter(p, n, "MaxAttemptsExceeded").await;
    }
    let order_3 = support::ORDER_3;
    sqlx::query(
        "INSERT INTO public.order_summary (order_id, total, status) VALUES ($1::uuid, 7, 'placed')",
    )
    .bind(order_3)
    .execute(env.store.pool())
    .await
    .unwrap();
    let header = |n: i64, p: &str| {
        format!("Dry run of the replay of position {n} through '{p}' (in a transaction that was rolled back: nothing was written, no history).\n")
    };

    // The poison event: the error it would fail with, exit 1.
    let error = "invalid input syntax for type numeric: \"abc\" (SQLSTATE 22P02)";
    env.run(&[
        "dlq",
        "replay",
        "2",
        "--perspective",
        "order_summary",
        "--dry-run",
    ])
    .await
    .expect(
        1,
        &format!("{}The handler fails: {error}\n", header(2, "order_summary")),
        &format!("A replay of position 2 would fail again: {error}. Nothing was done.\n"),
    );

    // An insert: no row before, the new row after.
    let run = env
        .run(&[
            "dlq",
            "replay",
            "1",
            "--perspective",
            "order_summary",
            "--dry-run",
        ])
        .await;
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{run:#?}");
    assert_eq!(
        run.stdout,
        format!(
            "{}The handler succeeds: a replay would resolve position 1.\n\
             Rows it would write (1):\n  \
             public.order_summary (primary key order_id):\n    \
             before: (none)\n    \
             after:  {{\"total\": 10.50, \"status\": \"placed\", \"order_id\": \"{}\"}}\n\
             To replay it: vantage dlq replay 1 --perspective order_summary\n",
            header(1, "order_summary"),
            support::ORDER_1
        )
    );

    // An update: before and after, JSON.
    let run = env
        .run(&[
            "dlq",
            "replay",
            "4",
            "--perspective",
            "order_summary",
            "--dry-run",
            "--json",
        ])
        .await;
    assert_eq!(run.code, 0, "{run:#?}");
    let data = &run.json()["data"];
    assert_eq!(data["outcome"], "would_resolve");
    assert_eq!(data["dry_run"], true);
    assert_eq!(data["changes"]["kind"], "rows");
    let row = &data["changes"]["rows"][0];
    assert_eq!(row["table"], "public.order_summary");
    assert_eq!(row["key"], json!(["order_id"]));
    assert_eq!(row["before"]["status"], "placed");
    assert_eq!(row["after"]["status"], "shipped");

    // A table without a primary key: the row written, no before.
    let run = env
        .run(&["dlq", "replay", "1", "--perspective", "audit", "--dry-run"])
        .await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert!(
        run.stdout
            .contains("  public.audit_log (no primary key: before not known):\n    written: {"),
        "{run:#?}"
    );

    // Nothing was written: the read model as before, every dead letter open, no history.
    assert_eq!(
        env.scalar("SELECT count(*) FROM public.order_summary")
            .await,
        1
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM public.order_summary WHERE status = 'placed'")
            .await,
        1
    );
    assert_eq!(env.scalar("SELECT count(*) FROM public.audit_log").await, 0);
    for (p, n) in [
        ("order_summary", 1),
        ("order_summary", 2),
        ("order_summary", 4),
        ("audit", 1),
    ] {
        assert_eq!(env.status_of(p, n).await, "exhausted");
        assert_eq!(
            env.history_of(p, n).await.len(),
            1,
            "{p} {n}: Exhausted only"
        );
    }

    // The same refusals as a replay.
    env.run(&["dlq", "replay", "3", "--dry-run"])
        .await
        .expect_error("No dead-lettered event at position 3.");
}

// ---------------------------------------------------------------------------------------------
// A running daemon: pause stops its claims within a poll interval, resume starts them again

#[tokio::test]
async fn a_running_daemon_stops_claiming_a_paused_perspective_and_resumes() {
    use std::time::Duration;
    let env = Env::migrated().await;
    env.exec(
        "CREATE TABLE public.applied (event_id uuid PRIMARY KEY); \
         CREATE TABLE public.other (event_id uuid PRIMARY KEY)",
    )
    .await;
    let settings = support::fast_settings(
        &env.url,
        r#"
[[perspectives]]
name = "paused_one"
events = ["Tick"]
[perspectives.sql]
Tick = "INSERT INTO public.applied (event_id) VALUES ($3)"

[[perspectives]]
name = "running_one"
events = ["Tick"]
[perspectives.sql]
Tick = "INSERT INTO public.other (event_id) VALUES ($3)"
"#,
    );
    let daemon = vantage::daemon::DaemonBuilder::new(settings)
        .store(env.store.clone())
        .without_http()
        .start()
        .await
        .expect("daemon starts");
    let tick = |n: i64| vantage::store::NewEvent::new("Tick", json!({ "n": n }));

    env.store
        .append_events(Uuid::new_v4(), None, &[tick(1)])
        .await
        .unwrap();
    env.wait_until(
        "SELECT count(*) FROM public.applied",
        1,
        Duration::from_secs(30),
    )
    .await;

    assert_eq!(
        env.store
            .pause_perspective("paused_one", Some("test"), "tester")
            .await
            .unwrap(),
        Some(true)
    );
    // A claim already under way when the pause committed may not have seen it: wait until
    // every statement that started before the pause has finished.
    let paused_at: String = sqlx::query_scalar("SELECT clock_timestamp()::text")
        .fetch_one(env.store.pool())
        .await
        .unwrap();
    env.wait_until(
        &format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND state = 'active' AND pid <> pg_backend_pid() \
             AND query_start <= '{paused_at}'::timestamptz"
        ),
        0,
        Duration::from_secs(30),
    )
    .await;
    for n in 2..=6 {
        env.store
            .append_events(Uuid::new_v4(), None, &[tick(n)])
            .await
            .unwrap();
    }
    // The other perspective drains; the paused one is not claimed: nothing leased, nobody
    // charged, its read model unchanged.
    env.wait_until(
        "SELECT count(*) FROM public.other",
        6,
        Duration::from_secs(30),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(env.scalar("SELECT count(*) FROM public.applied").await, 1);
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM wh_perspective_events \
             WHERE perspective_name = 'paused_one' AND instance_id IS NULL AND attempts = 0"
        )
        .await,
        5
    );

    assert_eq!(
        env.store.resume_perspective("paused_one").await.unwrap(),
        Some(true)
    );
    env.wait_until(
        "SELECT count(*) FROM public.applied",
        6,
        Duration::from_secs(30),
    )
    .await;
    daemon.shutdown().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Ctrl-C in the middle of a bulk action

#[tokio::test]
async fn an_interrupted_bulk_requeue_leaves_every_dead_letter_done_or_untouched() {
    use std::time::Duration;
    let env = support::Env::new().await;
    // 5 000 dead letters of one group, made in SQL (one statement each would take too long).
    sqlx::query(
        "SELECT count(*) FROM append_events(gen_random_uuid(), NULL, \
             (SELECT jsonb_agg(jsonb_build_object('event_type', 'OrderPlaced', \
                 'data', jsonb_build_object('order_id', gen_random_uuid(), 'total', 'x'))) \
              FROM generate_series(1, 5000)))",
    )
    .execute(env.store.pool())
    .await
    .unwrap();
    sqlx::query(
        "UPDATE wh_perspective_events SET instance_id = $1, lease_expiry = now() + interval '1 hour', \
             attempts = 11, last_error = 'boom (SQLSTATE 22P02)' \
         WHERE perspective_name = 'order_summary'",
    )
    .bind(env.instance.0)
    .execute(env.store.pool())
    .await
    .unwrap();
    sqlx::query(
        "SELECT count(move_to_dead_letters(gen_random_uuid(), 'wh_perspective_events', \
             event_work_id, 'MaxAttemptsExceeded', 'claimed 11 times', $1)) \
         FROM wh_perspective_events WHERE perspective_name = 'order_summary'",
    )
    .bind(env.instance.0)
    .execute(env.store.pool())
    .await
    .unwrap();
    let fp: String = sqlx::query_scalar(
        "SELECT DISTINCT error_fingerprint FROM wh_dead_letters WHERE perspective_name = 'order_summary'",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap();

    let mut child = env
        .command(&["dlq", "requeue", "--group", &fp, "--yes"])
        .spawn()
        .expect("spawn");
    let requeued = "SELECT count(*) FROM wh_dead_letters WHERE status = 'requeued'";
    let started = std::time::Instant::now();
    while env.scalar(requeued).await < 100 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the requeue never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("it stops soon after Ctrl-C")
        .unwrap();
    let done = env.scalar(requeued).await;
    if done < 5000 {
        assert_eq!(status.code(), Some(130), "interrupted: {status:?}");
    }
    // Each one is done (requeued, with its work row back) or untouched (still exhausted).
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM wh_perspective_events WHERE perspective_name = 'order_summary'"
        )
        .await,
        done
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM wh_dead_letters WHERE status = 'exhausted'")
            .await,
        5000 - done
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM wh_dead_letter_history WHERE kind = 'Requeued'")
            .await,
        done
    );
}

/// Item 8 / issue 19: a dry run's memory is bounded per request: each row it collects (the row
/// written, before, after, or what the statement returns) is at most `text::MAX_TEXT` bytes and
/// the count of the rest, cut by the database, and at most `dlq::DRY_RUN_ROWS` rows. Before:
/// every row came back whole (a 1 MB payload copied into three read models: 3 MB of text,
/// times the rows), and the CLI printed it all.
#[tokio::test]
async fn a_replay_dry_run_collects_capped_rows_only() {
    let env = Env::with_extra_config(
        "\n[[perspectives]]\nname = \"keyed\"\nevents = [\"Big\"]\n[perspectives.sql]\n\
         Big = \"INSERT INTO public.copy_keyed (id, data) VALUES ($3, $1)\"\n\
         [[perspectives]]\nname = \"loose\"\nevents = [\"Big\"]\n[perspectives.sql]\n\
         Big = \"INSERT INTO public.copy_loose (data) SELECT $1 FROM generate_series(1, 60)\"\n\
         [[perspectives]]\nname = \"echo\"\nevents = [\"Big\"]\n[perspectives.sql]\n\
         Big = \"SELECT $1 AS data, n FROM generate_series(1, 60) n\"\n",
    )
    .await;
    sqlx::raw_sql(
        "CREATE TABLE public.copy_keyed (id uuid PRIMARY KEY, data jsonb);\n\
         CREATE TABLE public.copy_loose (data jsonb);",
    )
    .execute(env.store.pool())
    .await
    .unwrap();
    for p in ["keyed", "loose", "echo"] {
        env.store
            .register_perspective(p, &["Big".to_owned()])
            .await
            .unwrap();
    }
    let big = "é".repeat(500_000); // 1 MB of two-byte characters
    let appended = env
        .append(Uuid::new_v4(), &[("Big", json!({ "big": big }))])
        .await;
    let n = appended[0].global_position;
    let max = vantage::internals::text::MAX_TEXT;
    for p in ["keyed", "loose", "echo"] {
        env.dead_letter(p, n, "MaxAttemptsExceeded").await;
        let run = env
            .run(&[
                "dlq",
                "replay",
                &n.to_string(),
                "--perspective",
                p,
                "--dry-run",
            ])
            .await;
        assert_eq!(run.code, 0, "{p}: {}", run.stderr);
        // At most 50 rows of at most 64 KiB each (and a line of text around each).
        let lines: Vec<&str> = run.stdout.lines().collect();
        assert!(
            lines.iter().all(|l| l.len() < max + 200),
            "{p}: a line of {} bytes",
            lines.iter().map(|l| l.len()).max().unwrap_or(0)
        );
        assert!(
            run.stdout.len() < 60 * (max + 200),
            "{p}: {} bytes",
            run.stdout.len()
        );
        assert!(run.stdout.contains("bytes more)"), "{p}: the cut is said");
        let json = env
            .run(&[
                "dlq",
                "replay",
                &n.to_string(),
                "--perspective",
                p,
                "--dry-run",
                "--json",
            ])
            .await;
        assert_eq!(json.code, 0, "{p}: {}", json.stderr);
        let rows = json.json()["data"]["changes"]["rows"]
            .as_array()
            .unwrap()
            .len();
        assert!(rows <= 50, "{p}: {rows} rows");
        assert!(
            json.stdout.len() < 60 * 3 * (max + 200),
            "{p}: {} bytes",
            json.stdout.len()
        );
    }
    // Nothing was written, and the key still found the row: before (none), after capped.
    assert_eq!(
        env.scalar("SELECT count(*) FROM public.copy_keyed").await,
        0
    );
    let run = env
        .run(&[
            "dlq",
            "replay",
            &n.to_string(),
            "--perspective",
            "keyed",
            "--dry-run",
        ])
        .await;
    assert!(
        run.stdout.contains("    before: (none)\n"),
        "{}",
        &run.stdout[..2000.min(run.stdout.len())]
    );
}
