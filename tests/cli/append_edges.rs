//! `vantage append` on the inputs a bad-input campaign tried (issue #8): each one → exit code,
//! the message (naming the one line at fault), and nothing written — or, for numbers, stored
//! exactly as written.

use crate::support::{self, Env, STREAM_A};

async fn events(env: &Env) -> i64 {
    env.scalar("SELECT count(*) FROM wh_event_store").await
}

fn line(event_type: &str, data: &str) -> String {
    format!("{{\"stream_id\": \"{STREAM_A}\", \"event_type\": \"{event_type}\", \"data\": {data}}}")
}

/// Writes `bytes` to a file in the test's directory and appends it with `--file`.
async fn append_bytes(env: &Env, bytes: &[u8]) -> support::Run {
    let file = env.dir.path().join("input.jsonl");
    std::fs::write(&file, bytes).unwrap();
    env.run(&["append", "--file", file.to_str().unwrap()]).await
}

#[tokio::test]
async fn numbers_are_stored_exactly_as_written() {
    let env = Env::new().await;
    let input = line(
        "Measured",
        r#"{"price": 123456789012345.678, "big": 18446744073709551616, "tiny": 1e-40, "n": 7}"#,
    );
    env.run_with_input(&["append"], &input, false).await.expect(
        0,
        "Appended 1 event(s) to 1 stream(s).\n",
        "",
    );
    let stored: (String, String, String) = sqlx::query_as(
        "SELECT event_data->>'price', event_data->>'big', event_data->>'tiny' FROM wh_event_store",
    )
    .fetch_one(env.store.pool())
    .await
    .unwrap();
    assert_eq!(
        stored,
        (
            "123456789012345.678".to_owned(),
            "18446744073709551616".to_owned(),
            "0.0000000000000000000000000000000000000001".to_owned()
        )
    );
}

#[tokio::test]
async fn bad_lines_name_the_one_line_at_fault_and_write_nothing() {
    let env = Env::new().await;
    let ok = line("A", "{}");
    let cases: Vec<(Vec<u8>, String)> = vec![
        // A NUL cannot be stored in jsonb: the line that has it, not a range of lines.
        (
            format!("{ok}\n{ok}\n{}\n{ok}\n", line("A", r#"{"s": "a\u0000b"}"#)).into_bytes(),
            "line 3: \"data\" contains \\u0000 (NUL), which PostgreSQL's jsonb cannot store".to_owned(),
        ),
        (
            format!("{ok}\n{}\n", line("A", r#"{"k\u0000": 1}"#)).into_bytes(),
            "line 2: \"data\" contains \\u0000 (NUL), which PostgreSQL's jsonb cannot store".to_owned(),
        ),
        // Invalid UTF-8: which line.
        (
            [
                ok.as_bytes(),
                b"\n",
                line("A", "{\"s\": \"@@\"}").replace("@@", "\u{1}\u{2}").as_bytes(),
                b"\n",
            ]
            .concat()
            .into_iter()
            .map(|b| match b {
                1 => 0xff,
                2 => 0xfe,
                b => b,
            })
            .collect(),
            format!(
                "line 2: not valid UTF-8 (at byte {})",
                line("A", "{\"s\": \"@@\"}").find("@@").unwrap()
            ),
        ),
        // Surrounding white space in an event type would match nothing.
        (
            format!("{ok}\n{}\n", line(" A ", "{}")).into_bytes(),
            "line 2: \"event_type\" \" A \" has leading or trailing white space; event types are matched exactly".to_owned(),
        ),
    ];
    for (input, want) in cases {
        append_bytes(&env, &input).await.expect_error(&want);
        assert_eq!(events(&env).await, 0, "nothing written for {want}");
    }
}

#[tokio::test]
async fn a_utf8_bom_is_not_an_error() {
    let env = Env::new().await;
    let input = [
        b"\xef\xbb\xbf".as_slice(),
        line("A", "{}").as_bytes(),
        b"\n",
    ]
    .concat();
    append_bytes(&env, &input)
        .await
        .expect(0, "Appended 1 event(s) to 1 stream(s).\n", "");
}

#[tokio::test]
async fn an_event_id_already_stored_is_named_with_its_line() {
    let env = Env::new().await;
    let id = "11111111-1111-4111-8111-111111111111";
    let with_id = format!(
        "{{\"stream_id\": \"{STREAM_A}\", \"event_type\": \"A\", \"data\": {{}}, \"event_id\": \"{id}\"}}"
    );
    env.run_with_input(&["append"], &with_id, false)
        .await
        .expect(0, "Appended 1 event(s) to 1 stream(s).\n", "");
    let input = format!("{}\n{with_id}\n", line("A", "{}"));
    let run = env.run_with_input(&["append"], &input, false).await;
    run.expect_error(&format!(
        "line 2: event_id {id} is already in the event store (global position 1). Nothing was written."
    ));
    assert_eq!(events(&env).await, 1);
}
