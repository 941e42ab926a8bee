//! Shared by the CLI end-to-end tests: a migrated database with SQL perspectives, a
//! configuration file pointing at it, helpers that create dead letters the way the daemon
//! does, a runner for the real `vantage` binary, and golden files.
//!
//! Use with `mod common; mod cli_support;`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use uuid::Uuid;
use vantage::store::{
    AppendedEvent, InstanceId, InstanceInfo, MoveOutcome, NewEvent, Store, StoreOptions,
};

use crate::common;

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

/// A test's world: its database, a store on it, its configuration file, one registered
/// instance that plays the daemon.
pub struct Env {
    pub db: common::TestDatabase,
    pub store: Store,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub instance: InstanceId,
}

/// What one run of the binary did.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// stdout parsed as the one JSON object it must be.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {self:?}"))
    }

    /// Asserts exit code, stdout and stderr exactly.
    #[track_caller]
    pub fn expect(&self, code: i32, stdout: &str, stderr: &str) {
        assert_eq!(
            (self.code, self.stdout.as_str(), self.stderr.as_str()),
            (code, stdout, stderr),
            "{self:#?}"
        );
    }

    /// Asserts exit code 2 and exactly `message` on stderr, nothing on stdout.
    #[track_caller]
    pub fn expect_error(&self, message: &str) {
        self.expect(2, "", &format!("{message}\n"));
    }

    /// Asserts a `--json` error envelope: exit 2, `status: "error"`, `data.error = message`.
    #[track_caller]
    pub fn expect_json_error(&self, message: &str) {
        assert_eq!(self.code, 2, "{self:#?}");
        assert_eq!(
            self.json(),
            serde_json::json!({
                "data": {"error": message},
                "diagnostics": [],
                "status": "error",
                "version": "1",
            }),
            "{self:#?}"
        );
    }
}

impl Env {
    /// A migrated database with the read-model tables, the perspectives registered
    /// (`order_summary`, `audit`, and `legacy`, which this configuration has no handler for),
    /// one live instance, and the configuration file.
    pub async fn new() -> Env {
        Self::with_extra_config("").await
    }

    /// Like [`new`](Self::new), with `extra` appended to the configuration file.
    pub async fn with_extra_config(extra: &str) -> Env {
        let db = common::fresh_database().await;
        let store = Store::connect(&StoreOptions::for_url(&db.url))
            .await
            .expect("connect");
        store.migrate().await.expect("migrate");
        sqlx::raw_sql(READ_MODELS_SQL)
            .execute(store.pool())
            .await
            .expect("read models");
        for (name, types) in [
            ("order_summary", vec!["OrderPlaced", "OrderShipped"]),
            ("audit", vec!["*"]),
            ("legacy", vec!["OrderPlaced"]),
        ] {
            let types: Vec<String> = types.into_iter().map(String::from).collect();
            store.register_perspective(name, &types).await.unwrap();
        }
        let instance = InstanceId::new();
        store
            .heartbeat(instance, &InstanceInfo::current("vantage"))
            .await
            .unwrap();

        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("vantage.toml");
        std::fs::write(
            &config,
            format!(
                "[database]\nurl = \"{}\"\n{PERSPECTIVES_TOML}{extra}",
                db.url
            ),
        )
        .unwrap();
        Env {
            db,
            store,
            dir,
            config,
            instance,
        }
    }

    /// `vantage --config <ours> args…`, with a clean environment (no DATABASE_URL or
    /// VANTAGE__* from the caller), stdin closed unless the caller pipes it.
    pub fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut cmd = base_command();
        cmd.arg("--config").arg(&self.config).args(args);
        cmd.current_dir(self.dir.path());
        cmd
    }

    /// Runs with stdin closed.
    pub async fn run(&self, args: &[&str]) -> Run {
        finish(self.command(args)).await
    }

    /// Runs without our `--config` (the caller passes its own, or none), stdin closed.
    pub async fn run_raw(&self, args: &[&str]) -> Run {
        let mut cmd = base_command();
        cmd.args(args).current_dir(self.dir.path());
        finish(cmd).await
    }

    /// Runs with `input` on a stdin pipe; `tty` sets the test-only VANTAGE_ASSUME_TTY=1 so
    /// prompts are asked.
    pub async fn run_with_input(&self, args: &[&str], input: &str, tty: bool) -> Run {
        let mut cmd = self.command(args);
        if tty {
            cmd.env("VANTAGE_ASSUME_TTY", "1");
        }
        cmd.stdin(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn vantage");
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input.as_bytes()).await.unwrap();
        drop(stdin);
        collect(child).await
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

    /// One number from the database.
    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql)
            .fetch_one(self.store.pool())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

/// The binary with a clean environment.
pub fn base_command() -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_vantage"));
    for (name, _) in std::env::vars_os() {
        let upper = name.to_string_lossy().to_ascii_uppercase();
        if upper == "DATABASE_URL" || upper.starts_with("VANTAGE") || upper.starts_with("PG") {
            cmd.env_remove(&name);
        }
    }
    cmd.env("USER", "tester")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// Runs to completion (at most a minute: a hang is a failure, not a stuck suite).
pub async fn finish(mut cmd: tokio::process::Command) -> Run {
    let child = cmd.spawn().expect("spawn vantage");
    collect(child).await
}

async fn collect(child: tokio::process::Child) -> Run {
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("vantage did not finish within 60 s")
        .expect("wait for vantage");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

/// A running command that is holding a confirmation prompt open.
pub struct Prompting {
    child: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    stderr_so_far: String,
}

impl Env {
    /// Starts `args` with an interactive (assumed) stdin and waits until it asks its question.
    pub async fn start_prompting(&self, args: &[&str]) -> Prompting {
        let mut cmd = self.command(args);
        cmd.env("VANTAGE_ASSUME_TTY", "1").stdin(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn vantage");
        let stdin = child.stdin.take().unwrap();
        let mut stderr = child.stderr.take().unwrap();
        let mut seen = Vec::new();
        let waited = tokio::time::timeout(Duration::from_secs(30), async {
            let mut buf = [0u8; 1024];
            while !String::from_utf8_lossy(&seen).contains("[y/N]") {
                let n = stderr.read(&mut buf).await.unwrap();
                assert!(
                    n > 0,
                    "exited before prompting: {}",
                    String::from_utf8_lossy(&seen)
                );
                seen.extend_from_slice(&buf[..n]);
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "no prompt within 30 s: {}",
            String::from_utf8_lossy(&seen)
        );
        child.stderr = Some(stderr);
        Prompting {
            child,
            stdin,
            stderr_so_far: String::from_utf8(seen).unwrap(),
        }
    }
}

impl Prompting {
    /// Answers the prompt and waits for the command to finish.
    pub async fn answer(mut self, answer: &str) -> Run {
        self.stdin.write_all(answer.as_bytes()).await.unwrap();
        drop(self.stdin);
        let mut run = collect(self.child).await;
        run.stderr = format!("{}{}", self.stderr_so_far, run.stderr);
        run
    }
}

// ---------------------------------------------------------------------------------------------
// Golden files

/// Replaces what changes from run to run: UUIDs, RFC 3339 timestamps, this host's name.
pub fn normalise(text: &str) -> String {
    let host = nix_hostname();
    let mut out = replace_uuids(text);
    out = replace_timestamps(&out);
    if !host.is_empty() {
        out = out.replace(&format!("@{host}"), "@<host>");
    }
    out
}

fn nix_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

fn replace_uuids(text: &str) -> String {
    let shape = [8, 4, 4, 4, 12];
    let bytes = text.as_bytes();
    let len = 36;
    let mut out = String::new();
    let mut i = 0;
    while i < bytes.len() {
        if i + len <= bytes.len() && is_uuid(&bytes[i..i + len], &shape) {
            out.push_str("<uuid>");
            i += len;
        } else {
            let ch = text[i..].chars().next().unwrap();
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn is_uuid(b: &[u8], shape: &[usize]) -> bool {
    let mut pos = 0;
    for (n, &group) in shape.iter().enumerate() {
        if n > 0 {
            if b[pos] != b'-' {
                return false;
            }
            pos += 1;
        }
        if !b[pos..pos + group].iter().all(u8::is_ascii_hexdigit) {
            return false;
        }
        pos += group;
    }
    true
}

/// `YYYY-MM-DDTHH:MM:SS(.fff)Z` → `<timestamp>`.
fn replace_timestamps(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::new();
    let mut i = 0;
    while i < b.len() {
        if let Some(end) = timestamp_at(b, i) {
            out.push_str("<timestamp>");
            i = end;
        } else {
            let ch = text[i..].chars().next().unwrap();
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn timestamp_at(b: &[u8], i: usize) -> Option<usize> {
    let pattern = b"dddd-dd-ddTdd:dd:dd";
    if i + pattern.len() > b.len() {
        return None;
    }
    for (k, p) in pattern.iter().enumerate() {
        let c = b[i + k];
        let ok = match p {
            b'd' => c.is_ascii_digit(),
            other => c == *other,
        };
        if !ok {
            return None;
        }
    }
    let mut end = i + pattern.len();
    if end < b.len() && b[end] == b'.' {
        end += 1;
        while end < b.len() && b[end].is_ascii_digit() {
            end += 1;
        }
    }
    if end < b.len() && b[end] == b'Z' {
        end += 1;
    }
    Some(end)
}

/// Compares `actual` (normalised) with `tests/golden/<name>`; `UPDATE_GOLDEN=1` rewrites it.
#[track_caller]
pub fn assert_golden(name: &str, actual: &str) {
    let path: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    let actual = normalise(actual);
    if std::env::var("UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read golden file {} ({e}); run with UPDATE_GOLDEN=1 to create it",
            path.display()
        )
    });
    assert_eq!(
        actual,
        expected,
        "output differs from {} (UPDATE_GOLDEN=1 rewrites it after review)",
        path.display()
    );
}

#[test]
fn normalise_replaces_uuids_timestamps() {
    assert_eq!(
        normalise("id 6f1c1a8e-5f4e-4c59-9d59-0d3b8f1c2a01 at 2024-05-01T10:11:12.345Z, 2024-05-01T10:11:12Z."),
        "id <uuid> at <timestamp>, <timestamp>."
    );
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
