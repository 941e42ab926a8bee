//! `vantage demo --once`, end to end through the built binary (docs/cli.md, "The two commands"):
//! against a configured database, checking what it left there, and with none configured, as a
//! newcomer runs it.

use std::fmt;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use crate::support;

/// `vantage demo` appends this many poison events (`src/cli/demo/sample.rs`, `POISON_EVENTS`).
const POISON_EVENTS: i64 = 3;
/// The demo's default sample.
const ORDERS: i64 = 2000;
/// Far above the expected few seconds, below the test's budget.
const TIMEOUT: Duration = Duration::from_secs(90);

pub(crate) struct Run {
    pub(crate) code: Option<i32>,
    pid: u32,
    stdout: String,
    stderr: String,
}

impl fmt::Display for Run {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "exit {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// Runs `vantage demo --once` from the crate root (where `config/demo.toml` is), killing it
/// after [`TIMEOUT`].
pub(crate) fn run_demo(configure: impl FnOnce(&mut Command)) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vantage"));
    cmd.args(["demo", "--once"]);
    demo_environment(&mut cmd);
    configure(&mut cmd);
    run_to_completion(cmd)
}

/// Runs `vantage demo --once <extra>` as [`run_demo`] does, but with stdin, stdout and stderr
/// on a pseudo-terminal (util-linux's `script`), so that it believes a person is watching.
/// Both streams end up in [`Run::stdout`], with the terminal's `\r\n` line ends.
fn run_demo_on_a_terminal(extra: &[&str], configure: impl FnOnce(&mut Command)) -> Run {
    let mut line = shell_quote(env!("CARGO_BIN_EXE_vantage"));
    for arg in ["demo", "--once"].iter().chain(extra) {
        line.push(' ');
        line.push_str(&shell_quote(arg));
    }
    let mut cmd = Command::new("script");
    // -q: no "Script started" banner; -e: its exit code is the demo's; -c: the command;
    // /dev/null: no typescript file.
    cmd.args(["-q", "-e", "-c", &line, "/dev/null"]);
    demo_environment(&mut cmd);
    configure(&mut cmd);
    run_to_completion(cmd)
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The crate root as working directory, none of the developer's logging or demo overrides,
/// stdin closed, stdout and stderr captured.
fn demo_environment(cmd: &mut Command) {
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("RUST_LOG")
        .env_remove("NO_COLOR")
        .env_remove("VANTAGE__DATABASE__URL")
        .env_remove("VANTAGE__HTTP__LISTEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
}

/// Spawns `cmd`, collects its output, and kills it after [`TIMEOUT`].
fn run_to_completion(mut cmd: Command) -> Run {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let mut child = cmd.spawn().unwrap_or_else(|e| {
        panic!(
            "cannot start {program}: {e} (the terminal tests need util-linux's `script`: \
             apt-get install bsdutils)"
        )
    });
    let pid = child.id();
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let stdout = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for vantage demo") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "vantage demo --once did not finish within {TIMEOUT:?}; its stderr:\n{}",
                stderr.join().unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    Run {
        code: status.code(),
        pid,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
}

/// The ANSI "select graphic rendition" sequences (colour, bold, dim: `ESC [ … m`) in `text`.
fn colour_codes(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("\x1b[") {
        let after = &rest[at + 2..];
        let params = after
            .find(|c: char| !(c.is_ascii_digit() || c == ';'))
            .unwrap_or(after.len());
        if after[params..].starts_with('m') {
            found.push(format!("ESC[{}m", &after[..params]));
        }
        rest = after;
    }
    found
}

fn assert_mentions_dead_letters_and_commands(run: &Run) {
    assert!(
        run.stdout
            .contains(&format!("Dead letters: {POISON_EVENTS} event(s)")),
        "{run}"
    );
    assert!(run.stdout.contains("MaxAttemptsExceeded"), "{run}");
    assert!(run.stderr.contains("dead-lettered"), "{run}");
    for command in [
        " status",
        " dlq list",
        " dlq inspect ",
        " dlq replay ",
        " dlq requeue --all --dry-run",
        // Issue 11: the triage commands, and the group fix.
        " status --blocked",
        " dlq groups",
        " --dry-run",
        " dlq requeue --group ",
        "ALTER TABLE demo.revenue_by_day ALTER COLUMN revenue TYPE numeric(20,2);",
        " dlq purge ",
        "/metrics",
        // Issue 10: the demo serves the console too and says where.
        "Console: http://",
    ] {
        assert!(run.stdout.contains(command), "missing {command:?}:\n{run}");
    }
}

/// perspective, reason, attempts, event type, status, error text.
type DeadLetterRow = (String, String, i32, Option<String>, String, Option<String>);

async fn count(conn: &mut PgConnection, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(conn)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn demo_once_drains_the_sample_and_dead_letters_the_poison_events() {
    let db = support::fresh_database().await;
    let url = db.url.clone();
    let run = tokio::task::spawn_blocking(move || {
        run_demo(|cmd| {
            cmd.env("DATABASE_URL", &url)
                .env("VANTAGE__HTTP__LISTEN", "127.0.0.1:0");
        })
    })
    .await
    .expect("the demo runner");
    assert_eq!(run.code, Some(0), "{run}");
    assert_mentions_dead_letters_and_commands(&run);
    assert!(run.stderr.contains("Migrated schema"), "{run}");
    assert!(!run.stderr.contains("throwaway"), "{run}");

    let mut conn = PgConnection::connect(&db.url).await.expect("connect");
    let c = &mut conn;

    // The poison events, and only they, are dead-lettered, after max + 1 = 4 claims.
    let dead: Vec<DeadLetterRow> = sqlx::query_as(
        "SELECT perspective_name, failure_reason, attempts_when_dlq, event_type, status, \
                    error_text \
             FROM vantage.wh_dead_letters ORDER BY global_position",
    )
    .fetch_all(&mut *c)
    .await
    .expect("dead letters");
    assert_eq!(dead.len() as i64, POISON_EVENTS, "{dead:?}");
    for (perspective, reason, attempts, event_type, status, error) in &dead {
        assert_eq!(perspective, "revenue_by_day");
        assert_eq!(reason, "MaxAttemptsExceeded");
        assert_eq!(*attempts, 4);
        assert_eq!(event_type.as_deref(), Some("OrderPaid"));
        assert_eq!(status, "exhausted");
        let error = error.as_deref().unwrap_or("");
        assert!(
            error.contains("numeric") || error.contains("violates not-null constraint"),
            "{error}"
        );
    }
    // Issue 11: three producer bugs, three error groups (SQLSTATEs as the daemon records them).
    let groups: Vec<(Option<String>, i64)> = sqlx::query_as(
        "SELECT vantage.wh_error_sqlstate(error_text), count(*) FROM vantage.wh_dead_letters \
         GROUP BY error_fingerprint, 1 ORDER BY 1",
    )
    .fetch_all(&mut *c)
    .await
    .expect("groups");
    assert_eq!(
        groups,
        vec![
            (Some("22003".to_owned()), 1),
            (Some("22P02".to_owned()), 1),
            (Some("23502".to_owned()), 1)
        ]
    );
    let poison_sql = "FROM vantage.wh_event_store \
                      WHERE event_type = 'OrderPaid' AND (event_data->>'amount' IS NULL \
                        OR event_data->>'amount' LIKE '%,%' OR length(event_data->>'amount') > 12)";
    assert_eq!(
        count(c, &format!("SELECT count(*) {poison_sql}")).await,
        POISON_EVENTS
    );
    assert_eq!(
        count(
            c,
            &format!(
                "SELECT count(*) FROM vantage.wh_dead_letters \
                 WHERE global_position IN (SELECT global_position {poison_sql})"
            )
        )
        .await,
        POISON_EVENTS
    );

    // Nothing is left to do.
    assert_eq!(
        count(c, "SELECT count(*) FROM vantage.wh_perspective_events").await,
        0
    );

    // order_summary: one row per order, in the state of the order's last event.
    assert_eq!(
        count(
            c,
            "SELECT count(*) FROM vantage.wh_event_store WHERE event_type = 'OrderPlaced'"
        )
        .await,
        ORDERS
    );
    assert_eq!(
        count(c, "SELECT count(*) FROM demo.order_summary").await,
        ORDERS
    );
    assert_eq!(
        count(
            c,
            "SELECT count(*) FROM demo.order_summary o \
             JOIN (SELECT DISTINCT ON (stream_id) stream_id, stream_version, event_type \
                   FROM vantage.wh_event_store ORDER BY stream_id, stream_version DESC) last \
               ON last.stream_id = o.order_id \
             WHERE o.last_version = last.stream_version \
               AND o.status = CASE last.event_type \
                   WHEN 'OrderPlaced' THEN 'placed' WHEN 'OrderPaid' THEN 'paid' \
                   WHEN 'OrderShipped' THEN 'shipped' WHEN 'OrderDelivered' THEN 'delivered' \
                   WHEN 'OrderCancelled' THEN 'cancelled' END"
        )
        .await,
        ORDERS
    );

    // revenue_by_day: every payment but the poison ones, every refund.
    let (orders, revenue_ok, refunds_ok): (i64, bool, bool) = sqlx::query_as(
        "SELECT (SELECT sum(orders) FROM demo.revenue_by_day)::int8, \
                (SELECT sum(revenue) FROM demo.revenue_by_day) = \
                    (SELECT sum((event_data->>'amount')::numeric) FROM vantage.wh_event_store \
                     WHERE event_type = 'OrderPaid' AND event_data->>'amount' NOT LIKE '%,%' \
                       AND length(event_data->>'amount') <= 12), \
                (SELECT sum(refunds) FROM demo.revenue_by_day) = \
                    (SELECT coalesce(sum((event_data->>'refund_amount')::numeric), 0) \
                     FROM vantage.wh_event_store WHERE event_type = 'OrderCancelled')",
    )
    .fetch_one(&mut *c)
    .await
    .expect("revenue");
    let paid = count(
        c,
        "SELECT count(*) FROM vantage.wh_event_store WHERE event_type = 'OrderPaid'",
    )
    .await;
    assert_eq!(orders, paid - POISON_EVENTS);
    assert!(revenue_ok && refunds_ok);

    // customer_orders: every order, once, under its customer.
    assert_eq!(
        count(c, "SELECT sum(orders)::int8 FROM demo.customer_orders").await,
        ORDERS
    );
    assert_eq!(
        count(c, "SELECT count(*) FROM demo.customer_orders").await,
        count(
            c,
            "SELECT count(DISTINCT event_data->>'customer_id') FROM vantage.wh_event_store \
             WHERE event_type = 'OrderPlaced'"
        )
        .await
    );
    assert_eq!(
        count(c, "SELECT sum(cancelled)::int8 FROM demo.customer_orders").await,
        count(
            c,
            "SELECT count(*) FROM vantage.wh_event_store WHERE event_type = 'OrderCancelled'"
        )
        .await
    );
    let _ = conn.close().await;
}

#[test]
fn demo_once_without_a_database_starts_and_removes_a_throwaway_server() {
    let run = run_demo(|cmd| {
        cmd.env_remove("DATABASE_URL");
    });
    assert_eq!(run.code, Some(0), "{run}");
    assert!(
        run.stderr.contains("starting a throwaway PostgreSQL")
            && run.stderr.contains("ready on 127.0.0.1:"),
        "{run}"
    );
    assert_mentions_dead_letters_and_commands(&run);
    // The commands reach the throwaway server.
    assert!(run.stdout.contains("--database-url postgres://"), "{run}");

    let prefix = format!("vantage-pg-{}-", run.pid);
    let leftovers: Vec<String> = std::fs::read_dir(std::env::temp_dir())
        .expect("read the temporary directory")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(&prefix))
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
}

/// Log lines and progress written to a pipe or a file (the journal, `2> demo.log`) are plain
/// text: no colour, no cursor movement.
#[tokio::test(flavor = "multi_thread")]
async fn demo_output_to_a_non_terminal_has_no_ansi_escape_codes() {
    let db = support::fresh_database().await;
    let url = db.url.clone();
    let run = tokio::task::spawn_blocking(move || {
        run_demo(|cmd| {
            // INFO: the daemon's own log lines too, not only the dead-letter warnings.
            cmd.args(["--orders", "50"])
                .env("DATABASE_URL", &url)
                .env("VANTAGE__HTTP__LISTEN", "127.0.0.1:0")
                .env("RUST_LOG", "info");
        })
    })
    .await
    .expect("the demo runner");
    assert_eq!(run.code, Some(0), "{run}");
    assert!(run.stderr.contains(" INFO "), "no INFO log line:\n{run}");
    assert!(run.stderr.contains(" WARN "), "no WARN log line:\n{run}");
    assert!(run.stderr.contains("dead-lettered"), "{run}");
    for (stream, text) in [("stdout", &run.stdout), ("stderr", &run.stderr)] {
        let escapes: Vec<&str> = text.lines().filter(|l| l.contains('\x1b')).collect();
        assert!(
            escapes.is_empty(),
            "{stream} is not a terminal, yet these lines carry escape codes: {escapes:#?}"
        );
    }
}

/// On a terminal the log lines are coloured, unless `NO_COLOR` is set (https://no-color.org):
/// then they are plain, while the progress line is still refreshed in place (that is cursor
/// movement, not colour, and shows the demo did see a terminal).
#[tokio::test(flavor = "multi_thread")]
async fn demo_on_a_terminal_is_coloured_unless_no_color_is_set() {
    for no_color in [None, Some("1")] {
        let db = support::fresh_database().await;
        let url = db.url.clone();
        let run = tokio::task::spawn_blocking(move || {
            run_demo_on_a_terminal(&["--orders", "50"], |cmd| {
                cmd.env("DATABASE_URL", &url)
                    .env("VANTAGE__HTTP__LISTEN", "127.0.0.1:0");
                if let Some(value) = no_color {
                    cmd.env("NO_COLOR", value);
                }
            })
        })
        .await
        .expect("the demo runner");
        assert_eq!(run.code, Some(0), "NO_COLOR={no_color:?}: {run}");
        assert!(run.stdout.contains("dead-lettered"), "{run}");
        assert!(
            run.stdout.contains("\r\x1b[2K"),
            "NO_COLOR={no_color:?}: the progress line was not refreshed in place, so the \
             demo did not see a terminal:\n{run}"
        );
        let colours = colour_codes(&run.stdout);
        match no_color {
            None => assert!(
                !colours.is_empty(),
                "a terminal without NO_COLOR: the log lines should be coloured:\n{run}"
            ),
            Some(_) => assert!(
                colours.is_empty(),
                "NO_COLOR is set, yet the output carries colour codes {colours:?}:\n{run}"
            ),
        }
    }
}
