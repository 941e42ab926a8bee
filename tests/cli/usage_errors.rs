//! Every command's usage errors, pinned as one golden transcript (stdout, stderr and exit code
//! of each command line), like omdb's: a change to any of them shows up in review. No database
//! is needed: the command line is refused before configuration is read.

use crate::support::{assert_golden, base_command, finish};

/// Command lines clap must refuse, each with and without `--json` where the command has it.
const LINES: &[&str] = &[
    "",
    "nope",
    "run --bogus",
    "migrate extra",
    "demo --bogus",
    "append --file",
    "append --bogus --json",
    "status --bogus",
    "status --bogus --json",
    "perspectives",
    "perspectives rebuild",
    "perspectives list --bogus --json",
    "perspectives retire orders",
    "perspectives cutover orders --to x",
    "perspectives versions --json",
    "dlq",
    "dlq list --perspective",
    "dlq inspect",
    "dlq inspect --json",
    "dlq inspect x",
    "dlq inspect x --json",
    "dlq replay",
    "dlq replay --json",
    "dlq purge",
    "dlq purge 1 2",
    "dlq requeue",
    "dlq requeue --json",
    "dlq requeue 5 --all",
    "dlq requeue 5 --all --json",
    "config",
    "config check extra",
    "alerts",
    "alerts render extra",
    "soak --bogus",
    "soak --profile nope",
    "soak --phases steady,nope",
];

#[tokio::test]
async fn usage_errors_are_pinned() {
    let mut transcript = String::new();
    for line in LINES {
        let mut cmd = base_command();
        cmd.args(line.split_whitespace());
        let run = finish(cmd).await;
        assert_ne!(run.code, 0, "`vantage {line}` was accepted");
        transcript.push_str(&format!(
            "$ vantage {line}\nexit {}\n--- stdout\n{}--- stderr\n{}\n",
            run.code, run.stdout, run.stderr
        ));
    }
    assert_golden("usage_errors.txt", &transcript);
}
