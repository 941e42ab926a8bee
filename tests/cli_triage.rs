//! End to end: triage at scale (SPEC §4.1, §4.2, issue 11) through the built binary against a
//! real PostgreSQL: `dlq groups`, `requeue | purge --group`, `--limit`, `status --blocked`,
//! `perspectives pause | resume`, `dlq replay --dry-run`.

mod cli_support;
mod common;

use cli_support::{assert_golden, seeded, Env};
use serde_json::{json, Value};
use uuid::Uuid;

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

fn groups_of(run: &cli_support::Run) -> Vec<Value> {
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
        env.count(
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
