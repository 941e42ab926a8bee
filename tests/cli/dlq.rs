//! End to end: `vantage dlq list | inspect | replay | purge | requeue` against a real PostgreSQL,
//! through the built binary (docs/cli.md, "vantage dlq"): exit codes, stdout, stderr, the JSON
//! envelope, prompts, races, golden output.

use serde_json::json;
use uuid::Uuid;

use crate::support;
use crate::support::{assert_golden, seeded, Env, ORDER_1, ORDER_2, STREAM_A};

const RACE: &str = "is no longer dead-lettered: another command changed it while this one was waiting. Nothing was done.";

/// [`seeded`] plus dead letters: order_summary 2 (MaxAttemptsExceeded) and 4
/// (PermanentFailure), audit 2 (MaxAttemptsExceeded).
async fn with_dead_letters() -> Env {
    let env = seeded().await;
    env.dead_letter("order_summary", 2, "MaxAttemptsExceeded")
        .await;
    env.dead_letter("audit", 2, "MaxAttemptsExceeded").await;
    env.dead_letter("order_summary", 4, "PermanentFailure")
        .await;
    env
}

fn replay_warning(perspective: &str, n: i64) -> String {
    format!("Warning: replay re-runs the handler's side effects out of order: '{perspective}' applies position {n} now, after later events of its stream may already have been applied.")
}

fn race(n: i64) -> String {
    format!("Position {n} {RACE}")
}

const NO_TERMINAL: &str =
    "Cannot ask for confirmation: stdin is not a terminal. Pass --yes to proceed without asking.";

// ---------------------------------------------------------------------------------------------
// list

#[tokio::test]
async fn list_table_json_and_filter() {
    let env = with_dead_letters().await;

    let run = env.run(&["dlq", "list"]).await;
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{run:#?}");
    assert_golden("dlq_list.txt", &run.stdout);
    assert!(run
        .stdout
        .ends_with("\n3 dead-lettered event(s) across 2 perspective(s).\n"));

    let run = env.run(&["dlq", "list", "--json"]).await;
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{run:#?}");
    assert_eq!(
        run.json(),
        json!({
            "data": {"perspectives": [
                {"count": 1, "last_reason": "MaxAttemptsExceeded", "perspective": "audit", "positions": [2]},
                {"count": 2, "last_reason": "PermanentFailure", "perspective": "order_summary", "positions": [2, 4]},
            ]},
            "diagnostics": [],
            "status": "pass",
            "version": "1",
        })
    );
    // Keys sorted in the text itself, not only after parsing.
    let keys: Vec<&str> = ["\"data\"", "\"diagnostics\"", "\"status\"", "\"version\""].to_vec();
    let offsets: Vec<usize> = keys.iter().map(|k| run.stdout.find(k).unwrap()).collect();
    assert!(offsets.windows(2).all(|w| w[0] < w[1]), "{}", run.stdout);

    let run = env.run(&["dlq", "list", "--perspective", "audit"]).await;
    assert_eq!(run.code, 0);
    assert!(run.stdout.contains("| audit "), "{}", run.stdout);
    assert!(!run.stdout.contains("order_summary"), "{}", run.stdout);
    assert!(run
        .stdout
        .ends_with("1 dead-lettered event(s) across 1 perspective(s).\n"));

    // Registered, nothing dead-lettered: not shown.
    env.run(&["dlq", "list", "--perspective", "legacy"])
        .await
        .expect(0, "No dead-lettered events.\n", "");

    let missing = "No perspective named 'nope' is registered.";
    env.run(&["dlq", "list", "--perspective", "nope"])
        .await
        .expect_error(missing);
    env.run(&["dlq", "list", "--perspective", "nope", "--json"])
        .await
        .expect_json_error(missing);
}

#[tokio::test]
async fn list_when_nothing_is_dead_lettered() {
    let env = seeded().await;
    env.run(&["dlq", "list"])
        .await
        .expect(0, "No dead-lettered events.\n", "");
    let run = env.run(&["dlq", "list", "--json"]).await;
    assert_eq!(run.code, 0);
    assert_eq!(
        run.json(),
        json!({"data": {"perspectives": []}, "diagnostics": [], "status": "pass", "version": "1"})
    );
}

// ---------------------------------------------------------------------------------------------
// inspect

#[tokio::test]
async fn inspect_text_and_json() {
    let env = with_dead_letters().await;

    let run = env.run(&["dlq", "inspect", "4"]).await;
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{run:#?}");
    assert_golden("dlq_inspect.txt", &run.stdout);

    let run = env
        .run(&[
            "dlq",
            "inspect",
            "2",
            "--perspective",
            "order_summary",
            "--json",
        ])
        .await;
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{run:#?}");
    let v = run.json();
    assert_eq!(v["status"], "pass");
    assert_eq!(v["version"], "1");
    assert_eq!(v["diagnostics"], json!([]));
    let d = &v["data"];
    let keys: Vec<&str> = d.as_object().unwrap().keys().map(String::as_str).collect();
    for required in [
        "attempts",
        "data",
        "dead_lettered_at",
        "error_text",
        "failures",
        "global_position",
        "history",
        "perspective",
        "position",
        "reason",
        "stream_id",
        "stream_version",
        "type",
    ] {
        assert!(keys.contains(&required), "{required} missing from {keys:?}");
    }
    assert_eq!(d["position"], 2);
    assert_eq!(d["global_position"], 2);
    assert_eq!(d["perspective"], "order_summary");
    assert_eq!(d["type"], "OrderPlaced");
    assert_eq!(d["stream_id"], STREAM_A.to_string());
    assert_eq!(d["stream_version"], 2);
    assert_eq!(d["data"], json!({"order_id": ORDER_2, "total": "abc"}));
    assert_eq!(d["reason"], "MaxAttemptsExceeded");
    assert_eq!(
        d["error_text"],
        "attempts 11 > max 10\nlast error: handler failed: boom"
    );
    assert_eq!(d["attempts"], 11);
    assert_eq!(d["failures"], 10);
    assert_eq!(d["dead_lettered_by"], env.instance.to_string());
    assert_eq!(d["history"].as_array().unwrap().len(), 1);
    assert_eq!(d["history"][0]["kind"], "Exhausted");
}

#[tokio::test]
async fn addressing_errors() {
    let env = with_dead_letters().await;

    let ambiguous = "Position 2 is dead-lettered in several perspectives (audit, order_summary). Pass --perspective to choose one.";
    for cmd in [
        vec!["dlq", "inspect", "2"],
        vec!["dlq", "replay", "2", "--yes"],
        vec!["dlq", "purge", "2", "--yes"],
        vec!["dlq", "requeue", "2", "--yes"],
    ] {
        env.run(&cmd).await.expect_error(ambiguous);
    }
    env.run(&["dlq", "purge", "2", "--json"])
        .await
        .expect_json_error(ambiguous);

    for n in ["1", "99"] {
        let msg = format!("No dead-lettered event at position {n}.");
        for cmd in ["inspect", "replay", "purge", "requeue"] {
            env.run(&["dlq", cmd, n, "--yes"][..if cmd == "inspect" { 3 } else { 4 }])
                .await
                .expect_error(&msg);
        }
        env.run(&["dlq", "inspect", n, "--json"])
            .await
            .expect_json_error(&msg);
    }
    // Dead-lettered in another perspective only.
    env.run(&["dlq", "inspect", "4", "--perspective", "audit"])
        .await
        .expect_error("No dead-lettered event at position 4.");
    let unknown = "No perspective named 'nope' is registered.";
    for cmd in ["inspect", "replay", "purge", "requeue"] {
        env.run(&["dlq", cmd, "2", "--perspective", "nope"])
            .await
            .expect_error(unknown);
    }
    env.run(&["dlq", "requeue", "--all", "--perspective", "nope"])
        .await
        .expect_error(unknown);
    // Nothing was changed by any of that.
    assert_eq!(env.status_of("order_summary", 2).await, "exhausted");
    assert_eq!(env.history_of("order_summary", 2).await.len(), 1);
}

#[tokio::test]
async fn an_event_that_cannot_be_reread_is_not_shown_but_can_be_purged() {
    let env = with_dead_letters().await;

    // Another event now sits at position 4 (its id differs from the dead letter's).
    sqlx::query("UPDATE wh_event_store SET event_id = gen_random_uuid() WHERE global_position = 4")
        .execute(env.store.pool())
        .await
        .unwrap();
    let msg = "Could not re-read the event at position 4.";
    env.run(&["dlq", "inspect", "4"]).await.expect_error(msg);
    env.run(&["dlq", "inspect", "4", "--json"])
        .await
        .expect_json_error(msg);
    env.run(&["dlq", "replay", "4", "--yes"])
        .await
        .expect_error(msg);

    // The event is gone altogether.
    sqlx::query("DELETE FROM wh_event_store WHERE global_position = 4")
        .execute(env.store.pool())
        .await
        .unwrap();
    env.run(&["dlq", "inspect", "4"]).await.expect_error(msg);
    env.run(&["dlq", "replay", "4", "--yes"])
        .await
        .expect_error(msg);
    assert_eq!(env.status_of("order_summary", 4).await, "exhausted");

    env.run(&["dlq", "purge", "4", "--yes"])
        .await
        .expect(0, "Purged position 4.\n", "");
    assert_eq!(env.status_of("order_summary", 4).await, "purged");
}

// ---------------------------------------------------------------------------------------------
// replay

#[tokio::test]
async fn replay_resolves_or_fails_again() {
    let env = seeded().await;
    env.dead_letter("order_summary", 1, "MaxAttemptsExceeded")
        .await;
    env.dead_letter("order_summary", 2, "MaxAttemptsExceeded")
        .await;
    env.dead_letter("audit", 1, "MaxAttemptsExceeded").await;

    // A healthy event: applied, resolved, in one transaction.
    env.run(&[
        "dlq",
        "replay",
        "1",
        "--perspective",
        "order_summary",
        "--yes",
    ])
    .await
    .expect(
        0,
        "Replayed position 1 through 'order_summary': resolved.\n",
        &format!("{}\n", replay_warning("order_summary", 1)),
    );
    assert_eq!(env.status_of("order_summary", 1).await, "resolved");
    assert_eq!(
        env.scalar(&format!(
            "SELECT count(*) FROM public.order_summary WHERE order_id = '{ORDER_1}'"
        ))
        .await,
        1
    );
    let kinds: Vec<String> = env
        .history_of("order_summary", 1)
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(kinds, ["Exhausted", "ReplaySucceeded"]);
    // Now the position is dead-lettered in audit only: no ambiguity, and order_summary is done.
    env.run(&[
        "dlq",
        "replay",
        "1",
        "--perspective",
        "order_summary",
        "--yes",
    ])
    .await
    .expect_error("No dead-lettered event at position 1.");

    // With --json: one object on stdout, the warning on stderr.
    let run = env.run(&["dlq", "replay", "1", "--yes", "--json"]).await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert_eq!(run.stderr, format!("{}\n", replay_warning("audit", 1)));
    assert_eq!(
        run.json(),
        json!({
            "data": {"outcome": "resolved", "perspective": "audit", "position": 1},
            "diagnostics": [], "status": "pass", "version": "1",
        })
    );
    assert_eq!(env.scalar("SELECT count(*) FROM public.audit_log").await, 1);

    // A poison event fails again: rolled back, still dead-lettered, the error in the history.
    let run = env.run(&["dlq", "replay", "2", "--yes"]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert_eq!(run.stdout, "");
    let error = "invalid input syntax for type numeric: \"abc\" (SQLSTATE 22P02)";
    assert_eq!(
        run.stderr,
        format!(
            "{}\nReplay of position 2 failed again: {error}. It stays dead-lettered.\n",
            replay_warning("order_summary", 2)
        )
    );
    assert_eq!(env.status_of("order_summary", 2).await, "exhausted");
    let history = env.history_of("order_summary", 2).await;
    assert_eq!(history.len(), 2);
    assert_eq!(
        history[1],
        ("ReplayFailed".to_owned(), Some(error.to_owned()))
    );

    let run = env.run(&["dlq", "replay", "2", "--yes", "--json"]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert_eq!(
        run.json(),
        json!({
            "data": {
                "error": format!("Replay of position 2 failed again: {error}. It stays dead-lettered."),
                "outcome": "failed",
                "perspective": "order_summary",
                "position": 2,
                "replay_error": error,
            },
            "diagnostics": [], "status": "fail", "version": "1",
        })
    );
    assert_eq!(env.status_of("order_summary", 2).await, "exhausted");
    assert_eq!(env.history_of("order_summary", 2).await.len(), 3);
}

#[tokio::test]
async fn replay_refuses_what_it_cannot_run() {
    let env = seeded().await;
    env.dead_letter("legacy", 3, "MaxAttemptsExceeded").await;
    env.dead_letter("audit", 4, "MaxAttemptsExceeded").await;
    env.dead_letter("order_summary", 1, "MaxAttemptsExceeded")
        .await;

    // Registered, but this configuration has no handler for it.
    let msg =
        "Perspective 'legacy' has no handler in this configuration; cannot replay position 3.";
    env.run(&["dlq", "replay", "3", "--yes"])
        .await
        .expect_error(msg);
    env.run(&["dlq", "replay", "3", "--yes", "--json"])
        .await
        .expect_json_error(msg);
    // A handler without a statement for this type would run nothing: refused, not resolved.
    env.run(&["dlq", "replay", "4", "--yes"]).await.expect_error(
        "Perspective 'audit' has no statement for event type 'OrderShipped' in this configuration; cannot replay position 4.",
    );
    assert_eq!(env.status_of("legacy", 3).await, "exhausted");
    assert_eq!(env.status_of("audit", 4).await, "exhausted");

    // No terminal and no --yes: refuses instead of hanging.
    env.run(&["dlq", "replay", "1"]).await.expect(
        1,
        "",
        &format!("{}\n{NO_TERMINAL}\n", replay_warning("order_summary", 1)),
    );
    // Declined.
    env.run_with_input(&["dlq", "replay", "1"], "n\n", true)
        .await
        .expect(
            1,
            "",
            &format!(
                "{}\nReplay dead-lettered position 1 through 'order_summary'? [y/N] Aborted.\n",
                replay_warning("order_summary", 1)
            ),
        );
    // End of input counts as no.
    let run = env.run_with_input(&["dlq", "replay", "1"], "", true).await;
    assert_eq!(run.code, 1);
    assert!(run.stderr.ends_with("Aborted.\n"), "{run:#?}");
    let run = env
        .run_with_input(&["dlq", "replay", "1", "--json"], "no\n", true)
        .await;
    assert_eq!(run.code, 1);
    assert_eq!(
        run.json(),
        json!({"data": {"error": "Aborted."}, "diagnostics": [], "status": "fail", "version": "1"})
    );
    assert_eq!(env.status_of("order_summary", 1).await, "exhausted");
    assert_eq!(
        env.scalar("SELECT count(*) FROM public.order_summary")
            .await,
        0
    );

    // Confirmed at the prompt.
    env.run_with_input(&["dlq", "replay", "1"], "y\n", true)
        .await
        .expect(
            0,
            "Replayed position 1 through 'order_summary': resolved.\n",
            &format!(
                "{}\nReplay dead-lettered position 1 through 'order_summary'? [y/N] ",
                replay_warning("order_summary", 1)
            ),
        );
    assert_eq!(env.status_of("order_summary", 1).await, "resolved");
}

// ---------------------------------------------------------------------------------------------
// purge

#[tokio::test]
async fn purge_confirms_and_keeps_history() {
    let env = with_dead_letters().await;
    let prompt = "Purge dead-lettered position 4? A terminal record is kept in the history. [y/N]";

    env.run(&["dlq", "purge", "4"])
        .await
        .expect(1, "", &format!("{NO_TERMINAL}\n"));
    env.run_with_input(&["dlq", "purge", "4"], "n\n", true)
        .await
        .expect(1, "", &format!("{prompt} Aborted.\n"));
    assert_eq!(env.status_of("order_summary", 4).await, "exhausted");

    env.run_with_input(&["dlq", "purge", "4"], "y\n", true)
        .await
        .expect(0, "Purged position 4.\n", &format!("{prompt} "));
    assert_eq!(env.status_of("order_summary", 4).await, "purged");
    let kinds: Vec<String> = env
        .history_of("order_summary", 4)
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(kinds, ["Exhausted", "Purged"]);
    env.run(&["dlq", "purge", "4", "--yes"])
        .await
        .expect_error("No dead-lettered event at position 4.");

    let run = env
        .run(&[
            "dlq",
            "purge",
            "2",
            "--perspective",
            "audit",
            "--yes",
            "--json",
        ])
        .await;
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{run:#?}");
    assert_eq!(
        run.json(),
        json!({
            "data": {"outcome": "purged", "perspective": "audit", "position": 2},
            "diagnostics": [], "status": "pass", "version": "1",
        })
    );
    // With --json the prompt goes to stderr and stdout is only the envelope.
    let run = env
        .run_with_input(&["dlq", "purge", "2", "--json"], "y\n", true)
        .await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert_eq!(
        run.stderr,
        "Purge dead-lettered position 2? A terminal record is kept in the history. [y/N] "
    );
    assert_eq!(run.json()["data"]["perspective"], "order_summary");
    env.run(&["dlq", "list"])
        .await
        .expect(0, "No dead-lettered events.\n", "");
}

// ---------------------------------------------------------------------------------------------
// requeue

async fn work_rows(env: &Env, perspective: &str, position: i64) -> Vec<(i32, Option<Uuid>)> {
    sqlx::query_as(
        "SELECT attempts, instance_id FROM wh_perspective_events \
         WHERE perspective_name = $1 AND global_position = $2",
    )
    .bind(perspective)
    .bind(position)
    .fetch_all(env.store.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn requeue_single_bulk_and_dry_run() {
    let env = with_dead_letters().await;

    // Dry run: shows, changes nothing, needs no confirmation.
    env.run(&["dlq", "requeue", "--all", "--dry-run"])
        .await
        .expect(
            0,
            "Would requeue 3 dead-lettered event(s) (dry run; nothing was changed):\n  \
         position 2 of 'audit' (MaxAttemptsExceeded)\n  \
         position 2 of 'order_summary' (MaxAttemptsExceeded)\n  \
         position 4 of 'order_summary' (PermanentFailure)\n",
            "",
        );
    let run = env
        .run(&[
            "dlq",
            "requeue",
            "--all",
            "--reason",
            "PermanentFailure",
            "--dry-run",
            "--json",
        ])
        .await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert_eq!(
        run.json()["data"],
        json!({
            "count": 1, "dry_run": true, "requeued": 0,
            "items": [{"outcome": "would_requeue", "perspective": "order_summary", "position": 4, "reason": "PermanentFailure"}],
        })
    );
    assert!(work_rows(&env, "order_summary", 4).await.is_empty());
    assert_eq!(env.status_of("order_summary", 4).await, "exhausted");

    // Bulk: count first, then the question.
    let listing = "3 dead-lettered event(s) to requeue:\n  \
         position 2 of 'audit' (MaxAttemptsExceeded)\n  \
         position 2 of 'order_summary' (MaxAttemptsExceeded)\n  \
         position 4 of 'order_summary' (PermanentFailure)\n";
    env.run(&["dlq", "requeue", "--all"])
        .await
        .expect(1, "", &format!("{listing}{NO_TERMINAL}\n"));
    env.run_with_input(&["dlq", "requeue", "--all"], "n\n", true)
        .await
        .expect(
            1,
            "",
            &format!("{listing}Requeue 3 dead-lettered event(s)? [y/N] Aborted.\n"),
        );
    assert_eq!(env.status_of("audit", 2).await, "exhausted");

    // Single.
    env.run(&["dlq", "requeue", "4"])
        .await
        .expect(1, "", &format!("{NO_TERMINAL}\n"));
    env.run_with_input(&["dlq", "requeue", "4"], "y\n", true)
        .await
        .expect(
            0,
            "Requeued position 4 of 'order_summary'.\n",
            "Requeue dead-lettered position 4 of 'order_summary'? [y/N] ",
        );
    assert_eq!(env.status_of("order_summary", 4).await, "requeued");
    assert_eq!(work_rows(&env, "order_summary", 4).await, vec![(0, None)]);
    env.run(&["dlq", "requeue", "4", "--yes"])
        .await
        .expect_error("No dead-lettered event at position 4.");

    // Bulk with filters.
    let run = env
        .run(&[
            "dlq",
            "requeue",
            "--all",
            "--perspective",
            "audit",
            "--yes",
            "--json",
        ])
        .await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert_eq!(
        run.json(),
        json!({
            "data": {
                "count": 1, "dry_run": false, "requeued": 1,
                "items": [{"outcome": "requeued", "perspective": "audit", "position": 2, "reason": "MaxAttemptsExceeded"}],
            },
            "diagnostics": [], "status": "pass", "version": "1",
        })
    );
    env.run(&["dlq", "requeue", "--all", "--yes"]).await.expect(
        0,
        "Requeued position 2 of 'order_summary'.\nRequeued 1 of 1 dead-lettered event(s).\n",
        "1 dead-lettered event(s) to requeue:\n  position 2 of 'order_summary' (MaxAttemptsExceeded)\n",
    );
    assert_eq!(work_rows(&env, "order_summary", 2).await, vec![(0, None)]);
    assert_eq!(work_rows(&env, "audit", 2).await, vec![(0, None)]);
    env.run(&["dlq", "requeue", "--all", "--yes"]).await.expect(
        0,
        "No dead-lettered events match; nothing to requeue.\n",
        "",
    );

    // Usage: a position or --all, not both, not neither (clap's usage errors exit 2 too).
    assert_eq!(env.run(&["dlq", "requeue", "2", "--all"]).await.code, 2);
    assert_eq!(env.run(&["dlq", "requeue"]).await.code, 2);
}

// ---------------------------------------------------------------------------------------------
// races

#[tokio::test]
async fn purge_loses_to_a_purge_made_while_it_was_prompting() {
    let env = with_dead_letters().await;
    let waiting = env.start_prompting(&["dlq", "purge", "4"]).await;
    env.run(&["dlq", "purge", "4", "--yes"])
        .await
        .expect(0, "Purged position 4.\n", "");
    let run = waiting.answer("y\n").await;
    assert_eq!((run.code, run.stdout.as_str()), (2, ""), "{run:#?}");
    assert!(
        run.stderr.ends_with(&format!("[y/N] {}\n", race(4))),
        "{run:#?}"
    );
    // One purge, one history record.
    let kinds: Vec<String> = env
        .history_of("order_summary", 4)
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(kinds, ["Exhausted", "Purged"]);
}

#[tokio::test]
async fn replay_and_requeue_lose_to_a_purge_made_while_they_were_prompting() {
    let env = seeded().await;
    env.dead_letter("order_summary", 1, "MaxAttemptsExceeded")
        .await;
    env.dead_letter("order_summary", 3, "MaxAttemptsExceeded")
        .await;

    let replay = env.start_prompting(&["dlq", "replay", "1", "--json"]).await;
    let requeue = env.start_prompting(&["dlq", "requeue", "3"]).await;
    env.run(&["dlq", "purge", "1", "--yes"])
        .await
        .expect(0, "Purged position 1.\n", "");
    env.run(&["dlq", "purge", "3", "--yes"])
        .await
        .expect(0, "Purged position 3.\n", "");

    let run = replay.answer("y\n").await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert_eq!(
        run.json(),
        json!({"data": {"error": race(1)}, "diagnostics": [], "status": "error", "version": "1"})
    );
    // The handler ran but its effect was rolled back with the lost compare-and-set.
    assert_eq!(
        env.scalar("SELECT count(*) FROM public.order_summary")
            .await,
        0
    );
    assert_eq!(env.status_of("order_summary", 1).await, "purged");

    let run = requeue.answer("yes\n").await;
    assert_eq!((run.code, run.stdout.as_str()), (2, ""), "{run:#?}");
    assert!(run.stderr.ends_with(&format!("{}\n", race(3))), "{run:#?}");
    assert!(work_rows(&env, "order_summary", 3).await.is_empty());
    assert_eq!(env.status_of("order_summary", 3).await, "purged");
}

#[tokio::test]
async fn concurrent_commands_on_one_dead_letter_exactly_one_wins() {
    let env = seeded().await;
    env.dead_letter("audit", 1, "MaxAttemptsExceeded").await;
    env.dead_letter("audit", 3, "MaxAttemptsExceeded").await;

    // Two replays at once: `audit` inserts a row per apply, so a double apply would show.
    let (a, b) = tokio::join!(
        env.run(&["dlq", "replay", "1", "--yes"]),
        env.run(&["dlq", "replay", "1", "--yes"])
    );
    let runs = [a, b];
    let winners = runs.iter().filter(|r| r.code == 0).count();
    assert_eq!(winners, 1, "{runs:#?}");
    for r in runs.iter().filter(|r| r.code != 0) {
        assert_eq!(r.code, 2, "{r:#?}");
        // The loser either lost the compare-and-set or arrived after the winner committed.
        assert!(
            r.stderr.ends_with(&format!("{}\n", race(1)))
                || r.stderr
                    .ends_with("No dead-lettered event at position 1.\n"),
            "{r:#?}"
        );
    }
    assert_eq!(env.scalar("SELECT count(*) FROM public.audit_log").await, 1);

    // A purge and a replay at once.
    let (a, b) = tokio::join!(
        env.run(&["dlq", "purge", "3", "--yes"]),
        env.run(&["dlq", "replay", "3", "--yes"])
    );
    let runs = [a, b];
    assert_eq!(runs.iter().filter(|r| r.code == 0).count(), 1, "{runs:#?}");
    assert!(runs.iter().all(|r| r.code == 0 || r.code == 2), "{runs:#?}");
    let status = env.status_of("audit", 3).await;
    let applied = env
        .scalar("SELECT count(*) FROM public.audit_log WHERE global_position = 3")
        .await;
    match status.as_str() {
        "purged" => assert_eq!(applied, 0),
        "resolved" => assert_eq!(applied, 1),
        other => panic!("status {other}"),
    }
}

// ---------------------------------------------------------------------------------------------
// environment

#[tokio::test]
async fn environment_errors_exit_2() {
    let env = with_dead_letters().await;

    // Unreachable database: a quick, clear message naming host:port, never the password.
    let started = std::time::Instant::now();
    let run = env
        .run(&[
            "--database-url",
            "postgres://u:sekrit@127.0.0.1:1/nowhere",
            "dlq",
            "list",
        ])
        .await;
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
    assert_eq!((run.code, run.stdout.as_str()), (2, ""), "{run:#?}");
    assert!(
        run.stderr
            .starts_with("Database unreachable at 127.0.0.1:1: "),
        "{run:#?}"
    );
    assert!(!run.stderr.contains("sekrit"), "{run:#?}");
    let run = env
        .run(&[
            "--database-url",
            "postgres://u:sekrit@127.0.0.1:1/nowhere",
            "dlq",
            "purge",
            "4",
            "--yes",
            "--json",
        ])
        .await;
    assert_eq!(run.code, 2);
    let v = run.json();
    assert_eq!(v["status"], "error");
    assert!(v["data"]["error"]
        .as_str()
        .unwrap()
        .starts_with("Database unreachable at 127.0.0.1:1"));
    assert!(!run.stdout.contains("sekrit"));

    // Bad configuration: exit 2 for dlq commands (docs/cli.md, "Exit codes"), the key named.
    let bad = env.dir.path().join("bad.toml");
    std::fs::write(&bad, "[worker]\nconsumers = 0\n").unwrap();
    let bad = bad.to_str().unwrap();
    let run = env.run_raw(&["--config", bad, "dlq", "list"]).await;
    assert_eq!((run.code, run.stdout.as_str()), (2, ""), "{run:#?}");
    assert!(run.stderr.contains("worker.consumers"), "{run:#?}");
    let run = env
        .run_raw(&["--config", bad, "dlq", "list", "--json"])
        .await;
    assert_eq!(run.code, 2);
    assert_eq!(run.json()["status"], "error");
    assert!(run.json()["data"]["error"]
        .as_str()
        .unwrap()
        .contains("worker.consumers"));

    // A database that was never migrated: said so, not "relation does not exist".
    let empty = support::fresh_database().await;
    let run = env
        .run(&["--database-url", &empty.url, "dlq", "list"])
        .await;
    assert_eq!((run.code, run.stdout.as_str()), (2, ""), "{run:#?}");
    assert!(run.stderr.contains("vantage migrate"), "{run:#?}");

    // Logs never reach stdout, and nothing was touched.
    assert_eq!(env.status_of("order_summary", 4).await, "exhausted");
}

#[tokio::test]
async fn bulk_requeue_reports_the_ones_it_lost() {
    let env = with_dead_letters().await;
    let waiting = env.start_prompting(&["dlq", "requeue", "--all"]).await;
    env.run(&["dlq", "purge", "4", "--yes"])
        .await
        .expect(0, "Purged position 4.\n", "");
    let run = waiting.answer("y\n").await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert_eq!(
        run.stdout,
        "Requeued position 2 of 'audit'.\n\
         Requeued position 2 of 'order_summary'.\n\
         Position 4 of 'order_summary' is no longer dead-lettered; skipped.\n\
         Requeued 2 of 3 dead-lettered event(s).\n"
    );
    assert!(
        run.stderr.ends_with(
            "[y/N] 1 of 3 dead-lettered event(s) were no longer dead-lettered: another command changed them while this one was waiting. They were skipped.\n"
        ),
        "{run:#?}"
    );
    assert_eq!(env.status_of("audit", 2).await, "requeued");
    assert_eq!(env.status_of("order_summary", 4).await, "purged");
    assert!(work_rows(&env, "order_summary", 4).await.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Already queued, being rebuilt (issue 7, defect 2)

fn already_queued(n: i64, perspective: &str, verb: &str) -> String {
    format!("Position {n} of '{perspective}' is already queued for the daemon (a work row for its event exists), so {verb} it would apply it twice. Nothing was done; purge the dead letter if the queued event should stand.")
}

fn being_rebuilt(perspective: &str) -> String {
    format!("Perspective '{perspective}' is being rebuilt; try again when `vantage perspectives rebuild {perspective}` has finished. Nothing was done.")
}

/// Queues the event of the open dead letter of (`perspective`, `position`) again behind its
/// back, as a rebuild racing a dead-letter move used to.
async fn queue_again(env: &Env, perspective: &str, position: i64) {
    sqlx::query(
        "INSERT INTO wh_perspective_events \
             (stream_id, event_id, global_position, stream_version, perspective_name) \
         SELECT stream_id, event_id, global_position, stream_version, perspective_name \
         FROM wh_dead_letters \
         WHERE perspective_name = $1 AND global_position = $2 AND status = 'exhausted'",
    )
    .bind(perspective)
    .bind(position)
    .execute(env.store.pool())
    .await
    .unwrap();
}

/// A dead letter whose event is queued again (a work row for the same perspective and event)
/// is neither replayed nor requeued: either would apply the event twice. Exit 2 with a message
/// naming the position and the perspective; nothing changes (no read-model write, status still
/// exhausted, no history, the one work row). A bulk requeue skips it, says so, requeues the
/// rest, and exits 2.
#[tokio::test]
async fn replay_and_requeue_refuse_an_event_that_is_already_queued() {
    let env = with_dead_letters().await;
    queue_again(&env, "order_summary", 4).await;
    let model_before = env
        .scalar("SELECT count(*) FROM public.order_summary")
        .await;

    env.run(&[
        "dlq",
        "replay",
        "4",
        "--perspective",
        "order_summary",
        "--yes",
    ])
    .await
    .expect_error(&already_queued(4, "order_summary", "replaying"));
    env.run(&[
        "dlq",
        "requeue",
        "4",
        "--perspective",
        "order_summary",
        "--yes",
    ])
    .await
    .expect_error(&already_queued(4, "order_summary", "requeuing"));
    env.run(&["dlq", "requeue", "4", "--yes", "--json"])
        .await
        .expect_json_error(&already_queued(4, "order_summary", "requeuing"));
    assert_eq!(env.status_of("order_summary", 4).await, "exhausted");
    assert_eq!(
        env.history_of("order_summary", 4).await.len(),
        1,
        "Exhausted only"
    );
    assert_eq!(work_rows(&env, "order_summary", 4).await, vec![(0, None)]);
    assert_eq!(
        env.scalar("SELECT count(*) FROM public.order_summary")
            .await,
        model_before
    );

    let run = env
        .run(&[
            "dlq",
            "requeue",
            "--all",
            "--perspective",
            "order_summary",
            "--yes",
        ])
        .await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert_eq!(
        run.stdout,
        "Requeued position 2 of 'order_summary'.\n\
         Position 4 of 'order_summary' is already queued for the daemon; skipped.\n\
         Requeued 1 of 2 dead-lettered event(s).\n"
    );
    assert_eq!(
        run.stderr,
        "2 dead-lettered event(s) to requeue:\n  \
         position 2 of 'order_summary' (MaxAttemptsExceeded)\n  \
         position 4 of 'order_summary' (PermanentFailure)\n\
         1 of 2 dead-lettered event(s) were already queued for the daemon: requeuing them would apply them twice. They were skipped.\n"
    );
    assert_eq!(env.status_of("order_summary", 2).await, "requeued");
    assert_eq!(env.status_of("order_summary", 4).await, "exhausted");
    assert_eq!(work_rows(&env, "order_summary", 4).await.len(), 1);
}

/// While `vantage perspectives rebuild` holds a perspective's rebuild lock, replay and requeue
/// of its dead letters refuse (exit 2, nothing changed) instead of racing the rebuild's
/// re-queue; other perspectives are not affected.
#[tokio::test]
async fn replay_and_requeue_refuse_while_the_perspective_is_being_rebuilt() {
    let env = with_dead_letters().await;
    let mut rebuild = env.store.pool().acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(wh_perspective_lock_key('order_summary'))")
        .execute(&mut *rebuild)
        .await
        .unwrap();

    env.run(&["dlq", "replay", "4", "--yes"])
        .await
        .expect_error(&being_rebuilt("order_summary"));
    env.run(&["dlq", "requeue", "4", "--yes"])
        .await
        .expect_error(&being_rebuilt("order_summary"));
    assert_eq!(env.status_of("order_summary", 4).await, "exhausted");
    assert_eq!(env.history_of("order_summary", 4).await.len(), 1);
    assert!(work_rows(&env, "order_summary", 4).await.is_empty());
    env.run(&["dlq", "requeue", "2", "--perspective", "audit", "--yes"])
        .await
        .expect(0, "Requeued position 2 of 'audit'.\n", "");

    sqlx::query("SELECT pg_advisory_unlock(wh_perspective_lock_key('order_summary'))")
        .execute(&mut *rebuild)
        .await
        .unwrap();
    env.run(&["dlq", "requeue", "4", "--yes"]).await.expect(
        0,
        "Requeued position 4 of 'order_summary'.\n",
        "",
    );
}

// ---------------------------------------------------------------------------------------------
// Hardening (issue 19, defect 1): a dry run never changes anything, whatever the target form.

#[tokio::test]
async fn purge_position_dry_run_changes_nothing_and_limit_needs_a_group() {
    let env = with_dead_letters().await;

    // A real dry run for a single position: says what it would purge, purges nothing.
    env.run(&["dlq", "purge", "4", "--dry-run", "--yes"])
        .await
        .expect(
            0,
            "Would purge 1 dead-lettered event(s) (dry run; nothing was changed):\n  \
             position 4 of 'order_summary' (PermanentFailure)\n",
            "",
        );
    assert_eq!(env.status_of("order_summary", 4).await, "exhausted");
    let run = env.run(&["dlq", "purge", "4", "--dry-run", "--json"]).await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert_eq!(
        run.json()["data"],
        json!({
            "count": 1, "dry_run": true, "purged": 0,
            "items": [{"outcome": "would_purge", "perspective": "order_summary", "position": 4, "reason": "PermanentFailure"}],
        })
    );
    assert_eq!(env.status_of("order_summary", 4).await, "exhausted");

    // --limit bounds a bulk walk only: with a position it is a usage error, nothing purged.
    let run = env
        .run(&["dlq", "purge", "4", "--limit", "0", "--yes"])
        .await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert!(run.stderr.contains("--limit"), "{run:#?}");
    assert_eq!(env.status_of("order_summary", 4).await, "exhausted");
    // The same rule for requeue (already so): --limit with a position is refused.
    let run = env
        .run(&["dlq", "requeue", "4", "--limit", "0", "--yes"])
        .await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert_eq!(env.status_of("order_summary", 4).await, "exhausted");
    // And a position dry run of requeue and replay writes nothing, no history.
    env.run(&["dlq", "requeue", "4", "--dry-run", "--yes"])
        .await;
    assert_eq!(env.status_of("order_summary", 4).await, "exhausted");
    let kinds = env.history_of("order_summary", 4).await.len();
    assert_eq!(kinds, 1, "only the Exhausted record");
}

/// Issue 19, defects 5 and 17: an event type or error text from a producer cannot drive the
/// terminal: control characters, bidi overrides and zero-width characters are escaped in every
/// human view (JSON escapes them already).
#[tokio::test]
async fn human_views_escape_control_and_invisible_characters() {
    let env = with_dead_letters().await;
    let hostile_type = "Order\u{1b}]0;pwned\u{7}\u{202e}decalP\u{200b}";
    let appended = env
        .append(Uuid::new_v4(), &[(hostile_type, json!({"x": 1}))])
        .await;
    let n = appended[0].global_position;
    env.dead_letter_with_error(
        "audit",
        n,
        "MaxAttemptsExceeded",
        "invalid input \u{1b}[2J\u{8}\u{8}\u{8}ok\r\nINFO forged (SQLSTATE 22P02)",
    )
    .await;
    let p = n.to_string();
    let runs = [
        env.run(&["dlq", "inspect", &p]).await,
        env.run(&["dlq", "groups"]).await,
        env.run(&["dlq", "list"]).await,
        env.run(&["dlq", "replay", &p, "--yes"]).await,
        env.run(&["dlq", "replay", &p, "--dry-run"]).await,
    ];
    for run in &runs {
        let all = format!("{}{}", run.stdout, run.stderr);
        for bad in ['\u{1b}', '\u{7}', '\u{8}', '\r', '\u{202e}', '\u{200b}'] {
            assert!(!all.contains(bad), "{bad:?} reached the terminal: {run:#?}");
        }
    }
    assert!(
        runs[0]
            .stdout
            .contains("Order\\u{1b}]0;pwned\\u{7}\\u{202e}decalP\\u{200b}"),
        "{:#?}",
        runs[0]
    );
    assert!(
        runs[0].stdout.contains("invalid input \\u{1b}[2J\\u{8}"),
        "{:#?}",
        runs[0]
    );
    assert!(runs[1].stdout.contains("Order\\u{1b}"), "{:#?}", runs[1]);
    // JSON keeps the text as it is (escaped by JSON itself).
    let run = env.run(&["dlq", "inspect", &p, "--json"]).await;
    assert_eq!(run.json()["data"]["type"], hostile_type);
}

// ---------------------------------------------------------------------------------------------
// A bulk walk acts on what it counted (finding G of the soak)

/// 501 dead letters of `audit` counted and confirmed (positions 1..=500 and 502, more than one
/// page), then position 501 dead-lettered while the command waits at its prompt: between the
/// first page and the last counted one.
async fn counted_then_one_more() -> Env {
    let env = Env::new().await;
    let events: Vec<(&str, serde_json::Value)> = (0..502)
        .map(|i| {
            (
                "OrderPlaced",
                json!({"order_id": Uuid::new_v4(), "total": i.to_string()}),
            )
        })
        .collect();
    env.append(Uuid::new_v4(), &events).await;
    for position in (1..=500).chain([502]) {
        env.dead_letter("audit", position, "MaxAttemptsExceeded")
            .await;
    }
    env
}

/// Runs the bulk command `args` on [`counted_then_one_more`], dead-letters position 501 while
/// it prompts, confirms, and checks that exactly the counted ones ended `status`.
async fn act_on_what_was_counted(env: &Env, args: &[&str], total: &str, status: &str) {
    let waiting = env.start_prompting(args).await;
    env.dead_letter("audit", 501, "MaxAttemptsExceeded").await;
    let run = waiting.answer("y\n").await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert!(run.stdout.ends_with(total), "{run:#?}");
    assert_eq!(env.status_of("audit", 502).await, status);
    // Dead-lettered after the count the operator confirmed: not part of what they asked for.
    assert_eq!(env.status_of("audit", 501).await, "exhausted");
}

#[tokio::test]
async fn bulk_requeue_requeues_every_dead_letter_it_counted_and_none_it_did_not() {
    let env = counted_then_one_more().await;
    act_on_what_was_counted(
        &env,
        &["dlq", "requeue", "--all", "--perspective", "audit"],
        "Requeued 501 of 501 dead-lettered event(s).\n",
        "requeued",
    )
    .await;
}

#[tokio::test]
async fn bulk_purge_purges_every_dead_letter_it_counted_and_none_it_did_not() {
    let env = counted_then_one_more().await;
    let group: String = sqlx::query_scalar(
        "SELECT DISTINCT error_fingerprint FROM wh_dead_letters WHERE perspective_name = 'audit'",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    act_on_what_was_counted(
        &env,
        &["dlq", "purge", "--group", &group, "--perspective", "audit"],
        "Purged 501 of 501 dead-lettered event(s).\n",
        "purged",
    )
    .await;
}
