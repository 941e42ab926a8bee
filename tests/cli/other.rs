//! End to end: `vantage status`, `perspectives list | rebuild`, `append`, `config check`,
//! through the built binary against a real PostgreSQL.

use serde_json::json;
use uuid::Uuid;
use vantage::config::Settings;
use vantage::internals::perspective::SqlPerspective;
use vantage::internals::store::StoreInternals as _;
use vantage::perspective::{EventEnvelope, Perspective};

use crate::support::{
    assert_golden, base_command, finish, seeded, Env, ORDER_1, ORDER_3, STREAM_A, STREAM_B,
};

const NO_TERMINAL: &str =
    "Cannot ask for confirmation: stdin is not a terminal. Pass --yes to proceed without asking.";

/// A daemon-free drain of one perspective, in position order: apply and complete in one
/// transaction; a failing event keeps its work row.
async fn drain(env: &Env, perspective: &str) {
    let text = std::fs::read_to_string(&env.config).unwrap();
    let settings = Settings::from_toml_str(&text).unwrap();
    let config = settings
        .perspectives
        .iter()
        .find(|p| p.name == perspective)
        .unwrap();
    let handler = SqlPerspective::from_settings(config);
    let rows: Vec<(Uuid, i64)> = sqlx::query_as(
        "SELECT event_work_id, global_position FROM wh_perspective_events \
         WHERE perspective_name = $1 ORDER BY global_position",
    )
    .bind(perspective)
    .fetch_all(env.store.pool())
    .await
    .unwrap();
    for (work_id, position) in rows {
        let e = env.store.event_at(position).await.unwrap().unwrap();
        let envelope = EventEnvelope {
            event_work_id: work_id,
            perspective_name: perspective.to_owned(),
            event_id: e.event_id,
            stream_id: e.stream_id,
            stream_version: e.stream_version,
            global_position: e.global_position,
            event_type: e.event_type,
            data: e.event_data,
            metadata: e.metadata,
            attempts: 1,
            failures: 0,
            replay: false,
        };
        let mut tx = env.store.pool().begin().await.unwrap();
        if handler
            .apply(
                &envelope,
                &mut vantage::perspective::ApplyTx::postgres(&mut tx),
            )
            .await
            .is_err()
        {
            tx.rollback().await.unwrap();
            continue;
        }
        sqlx::query("DELETE FROM wh_perspective_events WHERE event_work_id = $1")
            .bind(work_id)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
}

async fn queued_positions(env: &Env, perspective: &str) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT global_position FROM wh_perspective_events \
         WHERE perspective_name = $1 ORDER BY global_position",
    )
    .bind(perspective)
    .fetch_all(env.store.pool())
    .await
    .unwrap()
}

async fn read_model(env: &Env) -> Vec<(String, String)> {
    sqlx::query_as("SELECT order_id::text, status FROM public.order_summary ORDER BY order_id")
        .fetch_all(env.store.pool())
        .await
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// status

#[tokio::test]
async fn status_counts_work_dead_letters_and_instances() {
    let env = seeded().await;
    env.dead_letter("order_summary", 2, "MaxAttemptsExceeded")
        .await;
    // One audit row leased to our instance, one parked after a failure.
    sqlx::query(
        "UPDATE wh_perspective_events SET instance_id = $1, lease_expiry = now() + interval '1 minute' \
         WHERE perspective_name = 'audit' AND global_position = 1",
    )
    .bind(env.instance.0)
    .execute(env.store.pool())
    .await
    .unwrap();
    sqlx::query(
        "UPDATE wh_perspective_events SET scheduled_for = now() + interval '1 hour', failures = 1 \
         WHERE perspective_name = 'audit' AND global_position = 3",
    )
    .execute(env.store.pool())
    .await
    .unwrap();

    let run = env.run(&["status", "--json"]).await;
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{run:#?}");
    let v = run.json();
    assert_eq!(v["status"], "pass");
    assert_eq!(v["version"], "1");
    let rows: Vec<_> = v["data"]["perspectives"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["perspective"].as_str().unwrap().to_owned(),
                p["pending"].as_i64().unwrap(),
                p["leased"].as_i64().unwrap(),
                p["parked"].as_i64().unwrap(),
                p["dead_lettered"].as_i64().unwrap(),
                p["oldest_pending_age_seconds"].is_number(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            ("audit".to_owned(), 2, 1, 1, 0, true),
            ("legacy".to_owned(), 3, 0, 0, 0, true),
            ("order_summary".to_owned(), 3, 0, 0, 1, true),
        ]
    );
    let instances = v["data"]["instances"].as_array().unwrap();
    assert_eq!(instances.len(), 1);
    assert_eq!(instances[0]["instance_id"], env.instance.to_string());
    assert!(instances[0]["last_heartbeat_age_seconds"].as_f64().unwrap() < 60.0);

    let run = env.run(&["status"]).await;
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{run:#?}");
    let out = &run.stdout;
    assert!(
        out.contains(
            "| Perspective   | Pending | Leased | Parked | Dead-lettered | Oldest pending |"
        ),
        "{out}"
    );
    assert!(
        out.contains("| order_summary |       3 |      0 |      0 |             1 |"),
        "{out}"
    );
    assert!(out.contains(&env.instance.to_string()), "{out}");
    assert!(out.contains("s ago "), "{out}");
    assert!(out.ends_with("1 live instance(s).\n"), "{out}");

    // Without instances.
    env.store.deregister(env.instance).await.unwrap();
    let run = env.run(&["status"]).await;
    assert_eq!(run.code, 0);
    assert!(run.stdout.ends_with("\nNo live instances.\n"), "{run:#?}");
}

#[tokio::test]
async fn status_environment_errors() {
    let env = Env::new().await;
    let run = env
        .run(&[
            "--database-url",
            "postgres://u:sekrit@127.0.0.1:1/x",
            "status",
        ])
        .await;
    assert_eq!((run.code, run.stdout.as_str()), (2, ""), "{run:#?}");
    assert!(run
        .stderr
        .starts_with("Database unreachable at 127.0.0.1:1: "));
    assert!(!run.stderr.contains("sekrit"));

    let bad = env.dir.path().join("bad.toml");
    std::fs::write(&bad, "[worker]\nlease = \"soon\"\n").unwrap();
    let run = env
        .run_raw(&["--config", bad.to_str().unwrap(), "status"])
        .await;
    assert_eq!((run.code, run.stdout.as_str()), (78, ""), "{run:#?}");
    assert!(run.stderr.contains("worker.lease"), "{run:#?}");
}

// ---------------------------------------------------------------------------------------------
// perspectives

#[tokio::test]
async fn perspectives_list_shows_registry_and_handlers() {
    let env = Env::with_extra_config(
        "\n[[perspectives]]\nname = \"fresh\"\nevents = [\"X\"]\n[perspectives.sql]\nX = \"SELECT 1\"\n",
    )
    .await;
    let run = env.run(&["perspectives", "list"]).await;
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{run:#?}");
    assert_golden("perspectives_list.txt", &run.stdout);

    let run = env.run(&["perspectives", "list", "--json"]).await;
    assert_eq!(run.code, 0);
    assert_eq!(
        run.json(),
        json!({
            "data": {"perspectives": [
                {"event_types": ["*"], "handler": true, "perspective": "audit", "registered": true},
                {"event_types": ["X"], "handler": true, "perspective": "fresh", "registered": false},
                {"event_types": ["OrderPlaced"], "handler": false, "perspective": "legacy", "registered": true},
                {"event_types": ["OrderPlaced", "OrderShipped"], "handler": true, "perspective": "order_summary", "registered": true},
            ]},
            "diagnostics": [], "status": "pass", "version": "1",
        })
    );
}

#[tokio::test]
async fn rebuild_resets_then_requeues_history() {
    let env = seeded().await;
    env.dead_letter("order_summary", 2, "MaxAttemptsExceeded")
        .await;
    drain(&env, "order_summary").await;
    let built = vec![
        (ORDER_1.to_owned(), "placed".to_owned()),
        (ORDER_3.to_owned(), "shipped".to_owned()),
    ];
    assert_eq!(read_model(&env).await, built);
    assert!(queued_positions(&env, "order_summary").await.is_empty());

    let prompt = "Rebuild perspective 'order_summary'? Its read model is reset now and every historical event of its types is queued again. [y/N]";
    env.run(&["perspectives", "rebuild", "order_summary"])
        .await
        .expect(1, "", &format!("{NO_TERMINAL}\n"));
    env.run_with_input(&["perspectives", "rebuild", "order_summary"], "n\n", true)
        .await
        .expect(1, "", &format!("{prompt} Aborted.\n"));
    assert_eq!(read_model(&env).await, built);

    let run = env
        .run(&["perspectives", "rebuild", "order_summary", "--yes"])
        .await;
    assert_eq!(run.code, 0, "{run:#?}");
    // Reset first, then the history re-queued.
    assert!(read_model(&env).await.is_empty());
    let queued = queued_positions(&env, "order_summary").await;
    for p in [1, 3, 4] {
        assert!(queued.contains(&p), "{queued:?}");
    }
    // Position 2 has an open dead letter: the operator decides it, a rebuild does not re-queue it.
    assert!(!queued.contains(&2), "{queued:?}");
    assert_eq!(
        run.stdout,
        format!(
            "Rebuilt 'order_summary': read model reset; {} event(s) queued again for the daemon to apply.\n",
            queued.len()
        )
    );
    assert!(
        run.stderr
            .starts_with("Reset the read model of 'order_summary'.\nqueued "),
        "{run:#?}"
    );
    assert!(run.stderr.contains(" of ~4\n"), "{run:#?}");
    // Other perspectives' work is untouched.
    assert_eq!(queued_positions(&env, "audit").await, vec![1, 2, 3, 4]);

    // Safe to re-run: what is still queued is not queued twice.
    let run = env
        .run(&["perspectives", "rebuild", "order_summary", "--yes"])
        .await;
    assert_eq!(run.code, 0, "{run:#?}");
    assert_eq!(
        run.stdout,
        "Rebuilt 'order_summary': read model reset; 0 event(s) queued again for the daemon to apply.\n"
    );
    assert_eq!(queued_positions(&env, "order_summary").await, queued);

    // The daemon (here a stand-in) fills the read model again.
    drain(&env, "order_summary").await;
    assert_eq!(read_model(&env).await, built);
}

#[tokio::test]
async fn rebuild_refusals() {
    let env = seeded().await;
    env.run(&["perspectives", "rebuild", "nope", "--yes"])
        .await
        .expect_error("No perspective named 'nope' is registered.");
    env.run(&["perspectives", "rebuild", "legacy", "--yes"])
        .await
        .expect_error(
            "Perspective 'legacy' has no handler in this configuration; cannot rebuild it.",
        );
    env.run(&["perspectives", "rebuild", "audit", "--yes"])
        .await
        .expect_error(
            "Perspective 'audit' has no reset statement in this configuration; cannot rebuild it (add `reset` to its [[perspectives]] entry).",
        );
    assert_eq!(queued_positions(&env, "audit").await, vec![1, 2, 3, 4]);
}

// ---------------------------------------------------------------------------------------------
// append

fn line(stream: &str, event_type: &str, extra: &str) -> String {
    format!("{{\"stream_id\": \"{stream}\", \"event_type\": \"{event_type}\", \"data\": {{\"order_id\": \"{ORDER_1}\", \"total\": \"1\"}}{extra}}}")
}

async fn events(env: &Env) -> Vec<(i64, String, i32, String)> {
    sqlx::query_as(
        "SELECT global_position, stream_id::text, stream_version, event_type \
         FROM wh_event_store ORDER BY global_position",
    )
    .fetch_all(env.store.pool())
    .await
    .unwrap()
}

#[tokio::test]
async fn append_writes_all_lines_in_order() {
    let env = Env::new().await;
    let (a, b) = (STREAM_A.to_string(), STREAM_B.to_string());
    let input = [
        line(&a, "OrderPlaced", ", \"expected_version\": 0"),
        String::new(),
        line(&a, "OrderShipped", ", \"metadata\": {\"by\": \"test\"}"),
        "   ".to_owned(),
        line(&b, "OrderPlaced", ""),
        line(&a, "Note", ", \"expected_version\": 2"),
    ]
    .join("\n");
    env.run_with_input(&["append"], &input, false).await.expect(
        0,
        "Appended 4 event(s) to 2 stream(s).\n",
        "",
    );
    assert_eq!(
        events(&env).await,
        vec![
            (1, a.clone(), 1, "OrderPlaced".to_owned()),
            (2, a.clone(), 2, "OrderShipped".to_owned()),
            (3, b.clone(), 1, "OrderPlaced".to_owned()),
            (4, a.clone(), 3, "Note".to_owned()),
        ]
    );
    // The fan-out ran for them.
    assert_eq!(queued_positions(&env, "order_summary").await, vec![1, 2, 3]);

    // --file and --json: the envelope carries every event's position.
    let file = env.dir.path().join("events.jsonl");
    let id = "11111111-1111-4111-8111-111111111111";
    std::fs::write(
        &file,
        format!(
            "{}\n{}\n",
            line(&b, "OrderShipped", &format!(", \"event_id\": \"{id}\"")),
            line(&b, "Note", ", \"expected_version\": 2")
        ),
    )
    .unwrap();
    let run = env
        .run(&["append", "--file", file.to_str().unwrap(), "--json"])
        .await;
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{run:#?}");
    let v = run.json();
    assert_eq!(v["status"], "pass");
    assert_eq!(v["data"]["appended"], 2);
    assert_eq!(v["data"]["streams"], 1);
    let evs = v["data"]["events"].as_array().unwrap();
    assert_eq!(evs[0]["line"], 1);
    assert_eq!(evs[0]["event_id"], id);
    assert_eq!(evs[0]["global_position"], 5);
    assert_eq!(evs[0]["stream_version"], 2);
    assert_eq!(evs[1]["line"], 2);
    assert_eq!(evs[1]["global_position"], 6);
    assert_eq!(evs[1]["stream_version"], 3);

    // Empty input is fine.
    env.run_with_input(&["append"], "\n\n", false).await.expect(
        0,
        "Appended 0 event(s) to 0 stream(s).\n",
        "",
    );
}

#[tokio::test]
async fn append_is_all_or_nothing() {
    let env = Env::new().await;
    let a = STREAM_A.to_string();

    // A malformed line: nothing written, not even the lines before it.
    let input = format!(
        "{}\n{}\n{{\"stream_id\": \"{a}\", \"event_type\": \"X\"}}\n",
        line(&a, "OrderPlaced", ""),
        line(&a, "OrderPlaced", "")
    );
    env.run_with_input(&["append"], &input, false).await.expect(
        2,
        "",
        "line 3: missing \"data\"\n",
    );
    let run = env
        .run_with_input(
            &["append"],
            &format!("{}\nnot json\n", line(&a, "A", "")),
            false,
        )
        .await;
    assert_eq!((run.code, run.stdout.as_str()), (2, ""), "{run:#?}");
    assert!(
        run.stderr.starts_with("line 2: not valid JSON: "),
        "{run:#?}"
    );
    let run = env
        .run_with_input(&["append", "--json"], "{\"stream_id\": 5}\n", false)
        .await;
    assert_eq!(run.code, 2);
    assert_eq!(
        run.json(),
        json!({
            "data": {"error": "line 1: \"stream_id\" must be a UUID string, not a number"},
            "diagnostics": [], "status": "error", "version": "1",
        })
    );
    assert!(events(&env).await.is_empty());

    // A version conflict on line 3 rolls back lines 1-2 (another stream) too.
    let b = STREAM_B.to_string();
    let input = [
        line(&b, "OrderPlaced", ""),
        line(&a, "OrderPlaced", ", \"expected_version\": 0"),
        line(&a, "OrderPlaced", ", \"expected_version\": 5"),
    ]
    .join("\n");
    env.run_with_input(&["append"], &input, false).await.expect(
        2,
        "",
        &format!(
            "line 3: version conflict: stream {a} is at version 1, expected version 5. Nothing was written.\n"
        ),
    );
    assert!(events(&env).await.is_empty());
    assert!(queued_positions(&env, "order_summary").await.is_empty());

    let run = env
        .run(&["append", "--file", "/nonexistent/events.jsonl"])
        .await;
    assert_eq!((run.code, run.stdout.as_str()), (2, ""), "{run:#?}");
    assert!(run
        .stderr
        .starts_with("cannot read /nonexistent/events.jsonl: "));
}

// ---------------------------------------------------------------------------------------------
// config check

#[tokio::test]
async fn config_check_redacts_and_validates() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vantage.toml");
    std::fs::write(
        &path,
        "[database]\nurl = \"postgres://app:hunter2@db.internal:6543/events\"\n\
         [worker]\nconsumers = 2\n\
         [[perspectives]]\nname = \"p\"\nevents = [\"A\"]\nreset = \"TRUNCATE t\"\n[perspectives.sql]\nA = \"SELECT 1\"\n",
    )
    .unwrap();
    let mut cmd = base_command();
    cmd.arg("--config")
        .arg(&path)
        .args(["config", "check"])
        .env("VANTAGE__WORKER__BATCH_SIZE", "42");
    let run = finish(cmd).await;
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{run:#?}");
    assert!(!run.stdout.contains("hunter2"), "{}", run.stdout);
    assert!(
        run.stdout
            .contains("url = \"postgres://app:***@db.internal:6543/events\""),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains("consumers = 2\n"));
    assert!(run.stdout.contains("batch_size = 42\n"));
    assert!(run.stdout.contains("[[perspectives]]\nname = \"p\"\n"));
    // What it prints is a valid configuration again.
    Settings::from_toml_str(&run.stdout).unwrap();

    // The password given on the command line is hidden as well.
    let mut cmd = base_command();
    cmd.arg("--config").arg(&path).args([
        "--database-url",
        "postgres://app:s3cr3t@elsewhere/db",
        "config",
        "check",
    ]);
    let run = finish(cmd).await;
    assert_eq!(run.code, 0);
    assert!(!run.stdout.contains("s3cr3t") && run.stdout.contains("app:***@elsewhere"));

    // Invalid: exit 78, the key named, the password still hidden.
    std::fs::write(
        &path,
        "[database]\nurl = \"postgres://app:hunter2@db/events\"\n[worker]\nconsumers = 0\n",
    )
    .unwrap();
    let mut cmd = base_command();
    cmd.arg("--config").arg(&path).args(["config", "check"]);
    let run = finish(cmd).await;
    assert_eq!((run.code, run.stdout.as_str()), (78, ""), "{run:#?}");
    assert!(run.stderr.contains("worker.consumers"), "{run:#?}");
    assert!(!run.stderr.contains("hunter2"));

    let mut cmd = base_command();
    cmd.args(["--config", "/nonexistent/vantage.toml", "config", "check"]);
    let run = finish(cmd).await;
    assert_eq!(run.code, 78, "{run:#?}");
    assert!(run.stderr.contains("/nonexistent/vantage.toml"));
}

/// A command line clap rejects is still one JSON envelope on stdout under `--json`, exit 2.
#[test]
fn usage_errors_under_json_are_an_envelope() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vantage"))
        .args(["dlq", "inspect", "not-a-position", "--json"])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["status"], "error");
    assert_eq!(v["version"], "1");
    let error = v["data"]["error"].as_str().unwrap();
    assert!(error.contains("not-a-position"), "{error}");
    // Without --json, clap's own message on stderr, nothing on stdout.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vantage"))
        .args(["dlq", "inspect", "not-a-position"])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not-a-position"));
}

// ---------------------------------------------------------------------------------------------
// alerts render

/// Three lines of configuration become recording rules and burn-rate alerts for one
/// perspective; the file is valid YAML with every SLO's group. Bad SLOs exit 78 naming the key.
#[tokio::test]
async fn alerts_render_turns_two_lines_into_rules() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vantage.toml");
    std::fs::write(&path, "[[slo]]\nperspective = \"orders\"\nlag = \"5s\"\n").unwrap();
    let mut cmd = base_command();
    cmd.arg("--config").arg(&path).args(["alerts", "render"]);
    let run = finish(cmd).await;
    assert_eq!((run.code, run.stderr.as_str()), (0, ""), "{run:#?}");
    let rules: serde_json::Value = serde_yaml_ng::from_str(&run.stdout).expect("YAML");
    let groups = rules["groups"].as_array().expect("groups");
    assert_eq!(groups.len(), 1, "{}", run.stdout);
    assert_eq!(groups[0]["name"], "vantage-slo/orders/lag-5s");
    let rules = groups[0]["rules"].as_array().unwrap();
    let records: Vec<&str> = rules.iter().filter_map(|r| r["record"].as_str()).collect();
    assert_eq!(
        records,
        ["5m", "30m", "1h", "6h", "3d"].map(|w| format!("vantage:slo_error_ratio:rate{w}"))
    );
    let alerts: Vec<(&str, &str)> = rules
        .iter()
        .filter_map(|r| Some((r["alert"].as_str()?, r["labels"]["severity"].as_str()?)))
        .collect();
    assert_eq!(
        alerts,
        [
            ("VantageLagSLOFastBurn", "critical"),
            ("VantageLagSLOSlowBurn", "critical"),
            ("VantageLagSLOSteadyBurn", "warning"),
        ]
    );
    assert!(
        run.stdout.contains(
            "vantage:slo_error_ratio:rate1h{slo=\"lag-5s\",perspective=\"orders\"} > (14.4 * 0.001)"
        ),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains(
        "vantage_append_to_applied_seconds_bucket{perspective=\"orders\",le=~\"5|5\\\\.0\"}[5m]"
    ));
    // The same input, the same output.
    let mut again = base_command();
    again.arg("--config").arg(&path).args(["alerts", "render"]);
    assert_eq!(finish(again).await.stdout, run.stdout);

    std::fs::write(&path, "[[slo]]\nperspective = \"orders\"\nlag = \"7s\"\n").unwrap();
    let mut cmd = base_command();
    cmd.arg("--config").arg(&path).args(["alerts", "render"]);
    let run = finish(cmd).await;
    assert_eq!((run.code, run.stdout.as_str()), (78, ""), "{run:#?}");
    assert!(
        run.stderr.contains("slo[0].lag = \"7s\"") && run.stderr.contains("one of 25ms"),
        "{run:#?}"
    );
}
