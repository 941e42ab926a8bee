//! Running the real `vantage` binary the way the CLI tests do: a clean environment, the test's
//! configuration file, stdin closed or piped, a minute at most; what it printed, and a command
//! held at its confirmation prompt.

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::Env;

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
