//! What the demo shows on stderr while it drains: the work queue of its perspectives, and a
//! progress line refreshed in place on a terminal (one line per second otherwise); log lines
//! clear that line first.

use std::collections::VecDeque;
use std::io::Write;
use std::time::{Duration, Instant};

use super::report::thousands;
use crate::config::LogSettings;
use crate::store::{Store, StoreError};
use crate::telemetry::traces::TraceSettings;

/// How often a progress line is printed when stderr is not a terminal.
const PLAIN_PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// Logs on stderr, at `log.level` unless `RUST_LOG` is set, coloured only on a terminal and
/// without `NO_COLOR` (the daemon's own setup, [`crate::telemetry::logging`]). On a terminal
/// every log line first clears the progress line, which is redrawn at the next tick.
pub(super) fn init_logging(
    log: &LogSettings,
    traces: Option<&TraceSettings>,
    tty: bool,
) -> Result<(), String> {
    crate::telemetry::logging::init_with_writer(log, traces, LogWriter { clear_line: tty }, tty)
        .map_err(|e| e.to_string())
}

/// Makes a [`LogLine`] for each log line.
#[derive(Clone, Copy)]
struct LogWriter {
    /// stderr is a terminal, where a progress line may be on screen.
    clear_line: bool,
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogLine;
    fn make_writer(&'a self) -> LogLine {
        LogLine {
            clear_line: self.clear_line,
        }
    }
}

/// One log line on stderr, first clearing the progress line on a terminal.
struct LogLine {
    clear_line: bool,
}

impl std::io::Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut err = std::io::stderr().lock();
        if std::mem::take(&mut self.clear_line) {
            err.write_all(CLEAR_LINE.as_bytes())?;
        }
        err.write_all(buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// Carriage return and "erase the line".
pub(super) const CLEAR_LINE: &str = "\r\x1b[2K";

/// Work rows and open dead letters of the demo's perspectives.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Snapshot {
    pub(super) pending: i64,
    pub(super) leased: i64,
    pub(super) parked: i64,
    pub(super) dead: i64,
}

impl Snapshot {
    pub(super) async fn take(store: &Store, names: &[String]) -> Result<Snapshot, StoreError> {
        let mut s = Snapshot::default();
        for p in store.perspective_status().await? {
            if names.contains(&p.perspective_name) {
                s.pending += p.pending;
                s.leased += p.leased;
                s.parked += p.parked;
                s.dead += p.dead_lettered;
            }
        }
        Ok(s)
    }

    /// Work rows not yet applied nor dead-lettered.
    pub(super) fn remaining(&self) -> i64 {
        self.pending + self.leased + self.parked
    }
}

/// The progress line: refreshed in place on a terminal, one line per second otherwise.
pub(super) struct Progress {
    tty: bool,
    last_print: Option<Instant>,
    /// Recent (time, applied) samples, for the rate.
    samples: VecDeque<(Instant, u64)>,
    /// A refreshed line is on screen without its newline.
    line_open: bool,
}

impl Progress {
    pub(super) fn new(tty: bool) -> Self {
        Progress {
            tty,
            last_print: None,
            samples: VecDeque::new(),
            line_open: false,
        }
    }

    pub(super) fn update(
        &mut self,
        elapsed: Duration,
        appending: Option<(u64, u64)>,
        applied: u64,
        total: u64,
        snap: &Snapshot,
        dead: i64,
    ) {
        let now = Instant::now();
        self.samples.push_back((now, applied));
        while self
            .samples
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > Duration::from_secs(1))
        {
            self.samples.pop_front();
        }
        let rate = match self.samples.front() {
            Some((at, before)) if now > *at => {
                applied.saturating_sub(*before) as f64 / now.duration_since(*at).as_secs_f64()
            }
            _ => 0.0,
        };
        if !self.tty
            && self
                .last_print
                .is_some_and(|at| now.duration_since(at) < PLAIN_PROGRESS_EVERY)
        {
            return;
        }
        self.last_print = Some(now);

        let mut line = format!("[{:>5.1}s] ", elapsed.as_secs_f64());
        if let Some((done, of)) = appending {
            line.push_str(&format!(
                "appended {}/{} events | ",
                thousands(done),
                thousands(of)
            ));
        }
        line.push_str(&format!(
            "applied {}/{} | pending {}",
            thousands(applied),
            thousands(total),
            thousands(snap.remaining().max(0) as u64)
        ));
        if snap.parked > 0 {
            line.push_str(&format!(" ({} awaiting retry)", snap.parked));
        }
        line.push_str(&format!(
            " | dead-lettered {dead} | {}/s",
            thousands(rate as u64)
        ));
        if self.tty {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "{CLEAR_LINE}{line}");
            let _ = err.flush();
            self.line_open = true;
        } else {
            eprintln!("{line}");
        }
    }

    pub(super) fn note(&mut self, message: &str) {
        self.finish();
        eprintln!("  ({message})");
    }

    /// Ends a refreshed line, so what follows starts on its own line.
    pub(super) fn finish(&mut self) {
        if self.line_open {
            eprintln!();
            self.line_open = false;
        }
    }
}
