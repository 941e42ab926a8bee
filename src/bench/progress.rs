//! The progress bar: one bar (or spinner) per phase on stderr, drawn only when stderr is a
//! terminal (indicatif), so logs, pipes and CI see nothing but the report.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Where phases are drawn.
#[derive(Clone, Debug)]
pub struct Progress {
    visible: bool,
}

impl Progress {
    /// Drawn when stderr is a terminal.
    pub fn for_stderr() -> Progress {
        Progress {
            visible: std::io::stderr().is_terminal(),
        }
    }

    /// Never drawn (tests, `--quiet`).
    pub fn hidden() -> Progress {
        Progress { visible: false }
    }

    fn target(&self) -> ProgressDrawTarget {
        if self.visible {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        }
    }

    /// A bar for a phase of `len` rows.
    pub fn bar(&self, what: &str, len: u64) -> ProgressBar {
        let bar = ProgressBar::with_draw_target(Some(len), self.target());
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix:>28} [{bar:30}] {pos:>9}/{len:9} {per_sec:>12} {elapsed_precise}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_prefix(what.to_string());
        bar
    }

    /// A spinner for a phase of unknown length (seeding).
    pub fn spinner(&self, what: &str) -> ProgressBar {
        let bar = ProgressBar::with_draw_target(None, self.target());
        bar.set_style(
            ProgressStyle::with_template("{spinner} {msg} {elapsed_precise}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_message(what.to_string());
        bar.enable_steady_tick(Duration::from_millis(120));
        bar
    }

    /// A line above the bars (on a terminal only).
    pub fn note(&self, line: &str) {
        if self.visible {
            eprintln!("{line}");
        }
    }

    /// Nothing left to draw.
    pub fn finish(&self) {}
}
