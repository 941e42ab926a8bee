//! Running the real `vantage` binary as an operator does: a hard timeout on every run, a daemon
//! process kept in the background with its log in a file, raw HTTP probes of its endpoints, and
//! small SQL helpers on a store.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use vantage::store::Store;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_vantage");

/// A `vantage` command with a clean environment: nothing leaks in from the developer's shell
/// or CI (`DATABASE_URL`, `PG*`, `VANTAGE__*`, `RUST_LOG`), stdin is null, the working
/// directory is `dir` (so no `config/vantage.toml` is picked up by accident), and the child is
/// killed if the test drops it (a failing test never leaves a daemon behind).
pub fn vantage(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .current_dir(dir)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("NO_COLOR", "1")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    cmd
}

/// What one run of the binary did.
#[derive(Debug)]
pub struct Output {
    /// Exit code (`None`: killed by a signal).
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    /// Wall time from spawn to exit.
    pub elapsed: Duration,
}

impl Output {
    /// Asserts that nothing panicked (exit 101 or a panic message).
    #[track_caller]
    pub fn assert_no_panic(&self) {
        assert_ne!(self.code, Some(101), "vantage panicked: {self:#?}");
        for text in [&self.stdout, &self.stderr] {
            assert!(
                !text.contains("panicked at") && !text.contains("RUST_BACKTRACE"),
                "vantage panicked: {self:#?}"
            );
        }
    }
}

/// Runs `cmd` to completion, failing the test (instead of hanging CI) if it takes longer
/// than `limit`; the child is killed then.
pub async fn run(mut cmd: Command, limit: Duration) -> Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let started = Instant::now();
    let child = cmd.spawn().expect("spawn the vantage binary");
    match tokio::time::timeout(limit, child.wait_with_output()).await {
        Ok(Ok(out)) => Output {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            elapsed: started.elapsed(),
        },
        Ok(Err(e)) => panic!("waiting for vantage failed: {e}"),
        // Dropping the future drops the child, which kill_on_drop kills.
        Err(_) => panic!("vantage did not exit within {limit:?}: {cmd:?} hangs"),
    }
}

/// A `vantage` process running in the background, its stdout and stderr in files.
pub struct Daemon {
    child: Child,
    /// Its process id.
    pub pid: i32,
    /// Where its stderr (the log) goes.
    pub log: PathBuf,
    /// A name for messages.
    pub name: String,
    spawned: Instant,
}

impl Daemon {
    /// Spawns `cmd` with stdout and stderr appended to `<dir>/<name>.log`.
    pub fn spawn(mut cmd: Command, dir: &Path, name: &str) -> Daemon {
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .expect("open the daemon log");
        let file2 = file.try_clone().expect("clone the log handle");
        cmd.stdout(Stdio::from(file)).stderr(Stdio::from(file2));
        let child = cmd.spawn().expect("spawn the vantage binary");
        let pid = child.id().expect("a running child has a pid") as i32;
        Daemon {
            child,
            pid,
            log,
            name: name.to_owned(),
            spawned: Instant::now(),
        }
    }

    /// Everything it has logged so far (ANSI escapes stripped).
    pub fn log_text(&self) -> String {
        strip_ansi(&std::fs::read_to_string(&self.log).unwrap_or_default())
    }

    /// The last lines of its log, for failure messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = self.log_text();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Its exit code if it has exited (`Some(None)`: killed by a signal).
    pub fn try_exit(&mut self) -> Option<Option<i32>> {
        self.child
            .try_wait()
            .expect("poll the child")
            .map(|s| s.code())
    }

    /// Sends `signal`.
    pub fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.pid), signal).expect("signal the daemon");
    }

    /// Waits for it to exit, failing the test after `limit` (it is killed then).
    pub async fn wait(&mut self, limit: Duration) -> Option<i32> {
        match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(status) => status.expect("wait for the daemon").code(),
            Err(_) => {
                let _ = self.child.start_kill();
                panic!(
                    "{} (pid {}) did not exit within {limit:?}; log:\n{}",
                    self.name,
                    self.pid,
                    self.log_tail(40)
                )
            }
        }
    }

    /// SIGKILL and reap.
    pub async fn kill9(&mut self) {
        self.signal(Signal::SIGKILL);
        let _ = self.wait(Duration::from_secs(10)).await;
    }

    /// Waits for the "vantage is running" log line and returns the HTTP address it names
    /// (`http=Some(127.0.0.1:PORT)`). Fails if the process exits first or after `limit`.
    pub async fn wait_running(&mut self, limit: Duration) -> Option<SocketAddr> {
        loop {
            let text = self.log_text();
            if let Some(line) = text.lines().find(|l| l.contains("vantage is running")) {
                return parse_http_addr(line);
            }
            if let Some(code) = self.try_exit() {
                panic!(
                    "{} exited ({code:?}) before it was running; log:\n{}",
                    self.name,
                    self.log_tail(40)
                );
            }
            assert!(
                self.spawned.elapsed() < limit,
                "{} was not running after {limit:?}; log:\n{}",
                self.name,
                self.log_tail(40)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `http=Some(127.0.0.1:PORT)` (text log) or `"http":"Some(127.0.0.1:PORT)"` (JSON log).
pub fn parse_http_addr(line: &str) -> Option<SocketAddr> {
    let at = line.find("http")?;
    let rest = &line[at..];
    let open = rest.find("Some(")? + "Some(".len();
    let close = rest[open..].find(')')?;
    rest[open..open + close].parse().ok()
}

/// Removes ANSI escape sequences (`ESC [ ... letter`).
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `GET path` over a plain TCP connection: (status code, body). Errors (refused, timed out)
/// are returned, not panicked, so callers can poll.
pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&raw).into_owned())
    };
    let raw = tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no HTTP answer in 5s"))??;
    let status = raw
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("not an HTTP response: {raw:?}"),
            )
        })?;
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// Polls `GET path` until it answers `want`, failing after `limit`.
pub async fn wait_http_status(addr: SocketAddr, path: &str, want: u16, limit: Duration) {
    let started = Instant::now();
    loop {
        let got = http_get(addr, path).await;
        if matches!(&got, Ok((status, _)) if *status == want) {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "GET {path} did not answer {want} within {limit:?}; last answer: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sum of the samples of `name` whose labels include every `(key, value)` of `labels`.
pub fn metric_value(rendered: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    rendered
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A port on 127.0.0.1 that nothing listens on (it was free a moment ago).
pub fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local address").port()
}

pub async fn exec(store: &Store, sql: &str) {
    sqlx::raw_sql(sql)
        .execute(store.pool())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

pub async fn scalar(store: &Store, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(store.pool())
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// A random number in `0..n` (no `rand` dependency: a v4 UUID is 122 random bits).
pub fn random_below(n: u64) -> u64 {
    (uuid::Uuid::new_v4().as_u128() % u128::from(n.max(1))) as u64
}
