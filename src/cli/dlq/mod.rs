//! `vantage dlq`: the operator's view of dead-lettered events (docs/cli.md, "vantage dlq").
//!
//! A dead letter is addressed by its event's global position; `--perspective` picks one when
//! the same position is dead-lettered in several perspectives. Every action changes status
//! with a compare-and-set in SQL, so of two operators acting on one dead letter exactly one
//! wins and the other is told so. Destructive actions take an [`output::Confirmed`] token,
//! which only [`output::confirm`] creates.
//!
//! Exit codes: 0 success (including nothing to list), 1 declined or a replay that failed
//! again, 2 usage or environment error (including bad configuration, per docs/cli.md, "vantage
//! dlq").

mod bulk;
mod groups;
mod inspect;
mod list;
mod purge;
mod replay;
mod requeue;

use clap::{Args, Subcommand};
use serde_json::Value;

use super::exit;
use super::output::{self, Failure, Ui};
use super::GlobalArgs;
use crate::config::Settings;
use crate::store::{DeadLetter, Store};

/// `vantage dlq` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum DlqCommand {
    /// List open dead letters, grouped by perspective.
    List(ListArgs),
    /// Open dead letters grouped by error fingerprint, biggest first.
    Groups(GroupsArgs),
    /// Show a dead letter and re-read its event live from the event store.
    Inspect(InspectArgs),
    /// Dispatch a dead-lettered event once more through its perspective's handler.
    Replay(ReplayArgs),
    /// Close a dead letter without running anything (a terminal record stays in the history).
    Purge(PurgeArgs),
    /// Hand dead letters back to the running daemon, attempts reset.
    Requeue(RequeueArgs),
}

/// Options of `vantage dlq list`.
#[derive(Debug, Clone, Args)]
pub struct ListArgs {
    /// Only this perspective.
    #[arg(long, value_name = "NAME")]
    pub perspective: Option<String>,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Options of `vantage dlq groups`.
#[derive(Debug, Clone, Args)]
pub struct GroupsArgs {
    /// Only this perspective.
    #[arg(long, value_name = "NAME")]
    pub perspective: Option<String>,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Which dead letter: a global position, and the perspective when several gave up on it.
#[derive(Debug, Clone, Args)]
pub struct Target {
    /// The dead-lettered event's global position.
    #[arg(value_name = "POSITION")]
    pub position: i64,
    /// The perspective, when the position is dead-lettered in several.
    #[arg(long, value_name = "NAME")]
    pub perspective: Option<String>,
}

/// Options of `vantage dlq inspect`.
#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    /// Which dead letter.
    #[command(flatten)]
    pub target: Target,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Options of `vantage dlq replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// Which dead letter.
    #[command(flatten)]
    pub target: Target,
    /// Run the handler in a transaction that is rolled back and show what it would change (or
    /// the error it would fail with); nothing is written, no history.
    #[arg(long)]
    pub dry_run: bool,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// One JSON object on stdout (prompts and warnings go to stderr).
    #[arg(long)]
    pub json: bool,
}

/// Options of `vantage dlq purge`. One position or `--group` is required.
#[derive(Debug, Clone, Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["position", "group"])))]
pub struct PurgeArgs {
    /// The dead-lettered event's global position (or `--group`).
    #[arg(value_name = "POSITION")]
    pub position: Option<i64>,
    /// Every open dead letter of this error group (a fingerprint of `vantage dlq groups`).
    #[arg(long, value_name = "FINGERPRINT")]
    pub group: Option<String>,
    /// The perspective (of a position dead-lettered in several; or a filter with `--group`).
    #[arg(long, value_name = "NAME")]
    pub perspective: Option<String>,
    /// With `--group`: at most N dead letters (the lowest positions); not with a position.
    // `conflicts_with`, not `requires = "group"`: clap let a position satisfy the latter, and
    // the position path never read the flag.
    #[arg(long, value_name = "N", conflicts_with = "position")]
    pub limit: Option<u64>,
    /// Print what would be purged and change nothing (a position or `--group`).
    #[arg(long)]
    pub dry_run: bool,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// One JSON object on stdout (prompts go to stderr).
    #[arg(long)]
    pub json: bool,
}

/// Options of `vantage dlq requeue`. One position, `--all` or `--group` is required; a usage
/// error names them.
#[derive(Debug, Clone, Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["position", "all", "group"])))]
pub struct RequeueArgs {
    /// The dead-lettered event's global position (or `--all`).
    #[arg(value_name = "POSITION")]
    pub position: Option<i64>,
    /// Every open dead letter that matches the filters.
    #[arg(long)]
    pub all: bool,
    /// Every open dead letter of this error group (a fingerprint of `vantage dlq groups`).
    #[arg(long, value_name = "FINGERPRINT")]
    pub group: Option<String>,
    /// At most N dead letters (by perspective, then lowest position); not with a position.
    #[arg(long, value_name = "N", conflicts_with = "position")]
    pub limit: Option<u64>,
    /// Only this perspective.
    #[arg(long, value_name = "NAME")]
    pub perspective: Option<String>,
    /// Only dead letters with this failure reason (e.g. `MaxAttemptsExceeded`).
    #[arg(long, value_name = "R")]
    pub reason: Option<String>,
    /// Print what would be requeued and change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// One JSON object on stdout (prompts go to stderr).
    #[arg(long)]
    pub json: bool,
}

impl DlqCommand {
    fn json(&self) -> bool {
        match self {
            DlqCommand::List(a) => a.json,
            DlqCommand::Groups(a) => a.json,
            DlqCommand::Inspect(a) => a.json,
            DlqCommand::Replay(a) => a.json,
            DlqCommand::Purge(a) => a.json,
            DlqCommand::Requeue(a) => a.json,
        }
    }
}

/// Runs `vantage dlq`.
pub async fn run(global: &GlobalArgs, cmd: DlqCommand) -> i32 {
    let ui = Ui::new(cmd.json());
    let result = async {
        // (docs/cli.md, "vantage dlq"): bad configuration is a usage error (2) for dlq commands
        // (exit.rs).
        let settings = global
            .load_settings()
            .map_err(|e| Failure::with_code(exit::DLQ_BAD_CONFIG, e.to_string()))?;
        let store = output::connect(&settings).await?;
        let ctx = Ctx {
            settings: &settings,
            store: &store,
            ui,
        };
        let result = match cmd {
            DlqCommand::List(args) => list::run(&ctx, args).await,
            DlqCommand::Groups(args) => groups::run(&ctx, args).await,
            DlqCommand::Inspect(args) => inspect::run(&ctx, args).await,
            DlqCommand::Replay(args) => replay::run(&ctx, args).await,
            DlqCommand::Purge(args) => purge::run(&ctx, args).await,
            DlqCommand::Requeue(args) => requeue::run(&ctx, args).await,
        };
        store.close().await;
        result
    }
    .await;
    ui.finish(result)
}

/// What every subcommand works with.
struct Ctx<'a> {
    settings: &'a Settings,
    store: &'a Store,
    ui: Ui,
}

// ---------------------------------------------------------------------------------------------
// The shared operations (crate::dlq) and their messages

use crate::dlq::{msg, DlqError};

/// Every refusal of the shared operations is a usage or environment error (exit 2) with its
/// message of docs/cli.md ("vantage dlq"); a database failure says what it says everywhere in the CLI.
impl From<DlqError> for Failure {
    fn from(e: DlqError) -> Self {
        match e {
            DlqError::Store(e) => output::store_failure(&e),
            other => Failure::usage(other.to_string()),
        }
    }
}

/// The envelope data naming one dead letter.
fn target_json(dead_letter: &DeadLetter) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("position".into(), dead_letter.global_position.into());
    m.insert(
        "perspective".into(),
        dead_letter.perspective_name.clone().into(),
    );
    m
}
