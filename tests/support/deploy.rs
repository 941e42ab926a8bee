//! The deploy kit: the files under `deploy/`, read with real parsers; the operators' tools (`promtool`,
//! `prometheus`, `systemd-analyze`) found on the PATH or failed with the package to install;
//! child processes that are killed when the test is done, passed or failed.

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use serde_yaml_ng::Value as Yaml;

/// `deploy/<rel>` in this repository.
pub fn deploy_path(rel: &str) -> PathBuf {
    [env!("CARGO_MANIFEST_DIR"), "deploy", rel].iter().collect()
}

/// The text of `deploy/<rel>`.
pub fn read_deploy(rel: &str) -> String {
    let path = deploy_path(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// The one YAML document of `deploy/<rel>`.
pub fn yaml_deploy(rel: &str) -> Yaml {
    serde_yaml_ng::from_str(&read_deploy(rel))
        .unwrap_or_else(|e| panic!("deploy/{rel} is not valid YAML: {e}"))
}

/// `value` at a path of mapping keys and sequence indexes, e.g. `["spec", "template", "spec"]`;
/// panics naming the file and the path when it is missing.
#[track_caller]
pub fn at<'a>(value: &'a Yaml, file: &str, path: &[&str]) -> &'a Yaml {
    let mut here = value;
    for (i, key) in path.iter().enumerate() {
        let next = match key.parse::<usize>() {
            Ok(index) => here.get(index),
            Err(_) => here.get(*key),
        };
        here = next.unwrap_or_else(|| panic!("{file}: no `{}`", path[..=i].join(".")));
    }
    here
}

/// A string at `path` (see [`at`]).
#[track_caller]
pub fn str_at<'a>(value: &'a Yaml, file: &str, path: &[&str]) -> &'a str {
    at(value, file, path)
        .as_str()
        .unwrap_or_else(|| panic!("{file}: `{}` is not a string", path.join(".")))
}

/// The sequence at `path` (see [`at`]).
#[track_caller]
pub fn seq_at<'a>(value: &'a Yaml, file: &str, path: &[&str]) -> &'a [Yaml] {
    at(value, file, path)
        .as_sequence()
        .unwrap_or_else(|| panic!("{file}: `{}` is not a list", path.join(".")))
}

/// Every rule of a Prometheus rule file (`groups[].rules[]`).
pub fn prometheus_rules(rules_file: &Yaml) -> Vec<&Yaml> {
    let groups = seq_at(rules_file, "prometheus rules", &["groups"]);
    groups
        .iter()
        .flat_map(|g| seq_at(g, "prometheus rules", &["rules"]).iter())
        .collect()
}

/// The `expr` of every rule of a Prometheus rule file.
pub fn prometheus_exprs(rules_file: &Yaml) -> Vec<String> {
    prometheus_rules(rules_file)
        .into_iter()
        .map(|r| str_at(r, "prometheus rules", &["expr"]).trim().to_owned())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Tools

/// The path of `program` on the PATH (or in /usr/sbin, /sbin for root-only tools). Panics, never
/// skips, when it is missing, naming the Debian package that ships it (`.ci/run` installs it).
pub fn tool(program: &str, debian_package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!(
                "`{program}` is not installed: it comes with Debian's `{debian_package}` package \
                 (`apt-get install --no-install-recommends {debian_package}`; .ci/run installs it \
                 when missing)"
            )
        })
}

/// Runs `cmd` to completion, killing it (and failing the test) after `limit`.
pub fn run_with_limit(cmd: &mut Command, limit: Duration) -> Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap_or_else(|e| panic!("waiting for {cmd:?} failed: {e}")),
        Err(_) => {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            panic!("{cmd:?} did not finish within {limit:?} (killed)")
        }
    }
}

/// stdout and stderr of a finished tool, for messages.
pub fn output_text(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A child process that is killed (SIGKILL) and reaped when dropped: a failing test never leaves
/// it behind.
pub struct ChildGuard {
    child: Option<Child>,
    /// A name for messages.
    pub name: String,
}

impl ChildGuard {
    pub fn new(child: Child, name: impl Into<String>) -> ChildGuard {
        ChildGuard {
            child: Some(child),
            name: name.into(),
        }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("child present").id()
    }

    /// Its exit status if it has exited.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .expect("child present")
            .try_wait()
            .expect("poll the child")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local address").port()
}

/// `GET path_and_query` as HTTP/1.0 (so the answer is never chunked): (status, body). Errors
/// are returned so callers can poll.
pub fn http_get(addr: SocketAddr, path_and_query: &str) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream
        .write_all(format!("GET {path_and_query} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("no HTTP head: {text:?}"),
        )
    })?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("no status: {head:?}"),
            )
        })?;
    Ok((status, body.to_owned()))
}

/// `s` percent-encoded for a query string.
pub fn urlencode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}
