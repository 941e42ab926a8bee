//! `vantage dlq`: the operator's view of dead-lettered events (SPEC §4.2, after seed 004).
//!
//! A dead letter is addressed by its event's global position; `--perspective` picks one when
//! the same position is dead-lettered in several perspectives. Every action changes status
//! with a compare-and-set in SQL, so of two operators acting on one dead letter exactly one
//! wins and the other is told so. Destructive actions take an [`output::Confirmed`] token,
//! which only [`output::confirm`] creates.
//!
//! Exit codes: 0 success (including nothing to list), 1 declined or a replay that failed
//! again, 2 usage or environment error (including bad configuration, per SPEC §4.2).

mod inspect;
mod list;
mod purge;
mod replay;
mod requeue;

use clap::{Args, Subcommand};
use serde_json::Value;

use super::output::{self, Failure, Ui};
use super::GlobalArgs;
use crate::config::Settings;
use crate::store::{DeadLetter, Store, StoredEvent};

/// `vantage dlq` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum DlqCommand {
    /// List open dead letters, grouped by perspective.
    List(ListArgs),
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
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// One JSON object on stdout (prompts and warnings go to stderr).
    #[arg(long)]
    pub json: bool,
}

/// Options of `vantage dlq purge`.
#[derive(Debug, Clone, Args)]
pub struct PurgeArgs {
    /// Which dead letter.
    #[command(flatten)]
    pub target: Target,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// One JSON object on stdout (prompts go to stderr).
    #[arg(long)]
    pub json: bool,
}

/// Options of `vantage dlq requeue`. One position or `--all` is required; a usage error names
/// both.
#[derive(Debug, Clone, Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["position", "all"])))]
pub struct RequeueArgs {
    /// The dead-lettered event's global position (or `--all`).
    #[arg(value_name = "POSITION")]
    pub position: Option<i64>,
    /// Every open dead letter that matches the filters.
    #[arg(long)]
    pub all: bool,
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
        // SPEC §4.2: bad configuration is a usage error (2) for dlq commands.
        let settings = global
            .load_settings()
            .map_err(|e| Failure::usage(e.to_string()))?;
        let store = output::connect(&settings).await?;
        let ctx = Ctx {
            settings: &settings,
            store: &store,
            ui,
        };
        let result = match cmd {
            DlqCommand::List(args) => list::run(&ctx, args).await,
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
// Messages (SPEC §4.2 wording, defined once)

mod msg {
    pub fn unknown_perspective(name: &str) -> String {
        format!("No perspective named '{name}' is registered.")
    }
    pub fn no_dead_letter(position: i64) -> String {
        format!("No dead-lettered event at position {position}.")
    }
    pub fn cannot_reread(position: i64) -> String {
        format!("Could not re-read the event at position {position}.")
    }
    pub fn ambiguous(position: i64, perspectives: &[&str]) -> String {
        format!(
            "Position {position} is dead-lettered in several perspectives ({}). Pass --perspective to choose one.",
            perspectives.join(", ")
        )
    }
    pub fn race(position: i64) -> String {
        format!("Position {position} is no longer dead-lettered: another command changed it while this one was waiting. Nothing was done.")
    }
    pub fn no_handler(perspective: &str, position: i64) -> String {
        format!("Perspective '{perspective}' has no handler in this configuration; cannot replay position {position}.")
    }
    pub fn no_statement(perspective: &str, event_type: &str, position: i64) -> String {
        format!("Perspective '{perspective}' has no statement for event type '{event_type}' in this configuration; cannot replay position {position}.")
    }
    pub fn replay_warning(perspective: &str, position: i64) -> String {
        format!("Warning: replay re-runs the handler's side effects out of order: '{perspective}' applies position {position} now, after later events of its stream may already have been applied.")
    }
    pub fn replay_prompt(position: i64, perspective: &str) -> String {
        format!("Replay dead-lettered position {position} through '{perspective}'? [y/N]")
    }
    pub fn replayed(position: i64, perspective: &str) -> String {
        format!("Replayed position {position} through '{perspective}': resolved.")
    }
    pub fn replay_failed(position: i64, error: &str) -> String {
        format!("Replay of position {position} failed again: {error}. It stays dead-lettered.")
    }
    pub fn purge_prompt(position: i64) -> String {
        format!("Purge dead-lettered position {position}? A terminal record is kept in the history. [y/N]")
    }
    pub fn purged(position: i64) -> String {
        format!("Purged position {position}.")
    }
    pub fn none_listed() -> &'static str {
        "No dead-lettered events."
    }
    pub fn listed(events: usize, perspectives: usize) -> String {
        format!("{events} dead-lettered event(s) across {perspectives} perspective(s).")
    }
    pub fn requeue_prompt_one(position: i64, perspective: &str) -> String {
        format!("Requeue dead-lettered position {position} of '{perspective}'? [y/N]")
    }
    pub fn requeue_prompt_many(count: usize) -> String {
        format!("Requeue {count} dead-lettered event(s)? [y/N]")
    }
    pub fn none_to_requeue() -> &'static str {
        "No dead-lettered events match; nothing to requeue."
    }
    pub fn would_requeue(count: usize) -> String {
        format!("Would requeue {count} dead-lettered event(s) (dry run; nothing was changed):")
    }
    pub fn will_requeue(count: usize) -> String {
        format!("{count} dead-lettered event(s) to requeue:")
    }
    pub fn requeued_one(position: i64, perspective: &str) -> String {
        format!("Requeued position {position} of '{perspective}'.")
    }
    pub fn skipped_one(position: i64, perspective: &str) -> String {
        format!("Position {position} of '{perspective}' is no longer dead-lettered; skipped.")
    }
    pub fn requeued_total(requeued: usize, count: usize) -> String {
        format!("Requeued {requeued} of {count} dead-lettered event(s).")
    }
    pub fn already_queued(position: i64, perspective: &str, verb: &str) -> String {
        format!("Position {position} of '{perspective}' is already queued for the daemon (a work row for its event exists), so {verb} it would apply it twice. Nothing was done; purge the dead letter if the queued event should stand.")
    }
    pub fn being_rebuilt(perspective: &str) -> String {
        format!("Perspective '{perspective}' is being rebuilt; try again when `vantage perspectives rebuild {perspective}` has finished. Nothing was done.")
    }
    pub fn skipped_queued(position: i64, perspective: &str) -> String {
        format!("Position {position} of '{perspective}' is already queued for the daemon; skipped.")
    }
    pub fn requeue_partial_queued(skipped: usize, count: usize) -> String {
        format!("{skipped} of {count} dead-lettered event(s) were already queued for the daemon: requeuing them would apply them twice. They were skipped.")
    }
    pub fn requeue_partial(skipped: usize, count: usize) -> String {
        format!("{skipped} of {count} dead-lettered event(s) were no longer dead-lettered: another command changed them while this one was waiting. They were skipped.")
    }
}

// ---------------------------------------------------------------------------------------------
// Shared lookups

/// `--perspective NAME` must name a registered perspective.
async fn check_perspective(store: &Store, name: Option<&str>) -> Result<(), Failure> {
    if let Some(name) = name {
        let found = store
            .perspective(name)
            .await
            .map_err(|e| output::store_failure(&e))?;
        if found.is_none() {
            return Err(Failure::usage(msg::unknown_perspective(name)));
        }
    }
    Ok(())
}

/// The one open dead letter at `position` (of `perspective`, with `reason`, when given).
async fn resolve(
    store: &Store,
    position: i64,
    perspective: Option<&str>,
    reason: Option<&str>,
) -> Result<DeadLetter, Failure> {
    check_perspective(store, perspective).await?;
    let mut found = store
        .open_dead_letters_at(position, perspective)
        .await
        .map_err(|e| output::store_failure(&e))?;
    if let Some(reason) = reason {
        found.retain(|d| d.failure_reason == reason);
    }
    match found.len() {
        0 => Err(Failure::usage(msg::no_dead_letter(position))),
        1 => Ok(found.remove(0)),
        _ => {
            let names: Vec<&str> = found.iter().map(|d| d.perspective_name.as_str()).collect();
            Err(Failure::usage(msg::ambiguous(position, &names)))
        }
    }
}

/// Refuses to replay or requeue a dead letter whose perspective is being rebuilt, or whose event
/// is queued for the daemon again (either would apply it twice): checked before asking, and
/// again atomically by the action itself.
async fn check_not_queued(store: &Store, dl: &DeadLetter, verb: &str) -> Result<(), Failure> {
    let p = dl.perspective_name.as_str();
    if store
        .perspective_is_rebuilding(p)
        .await
        .map_err(|e| output::store_failure(&e))?
    {
        return Err(Failure::usage(msg::being_rebuilt(p)));
    }
    if store
        .is_queued(p, dl.event_id)
        .await
        .map_err(|e| output::store_failure(&e))?
    {
        return Err(Failure::usage(msg::already_queued(
            dl.global_position,
            p,
            verb,
        )));
    }
    Ok(())
}

/// Re-reads the dead letter's event live and checks that the row read really is that event:
/// the same global position and the same event id. Anything else is not that event.
async fn reread(store: &Store, dead_letter: &DeadLetter) -> Result<StoredEvent, Failure> {
    let event = store
        .event_at(dead_letter.global_position)
        .await
        .map_err(|e| output::store_failure(&e))?;
    match event {
        Some(e)
            if e.global_position == dead_letter.global_position
                && e.event_id == dead_letter.event_id =>
        {
            Ok(e)
        }
        _ => Err(Failure::usage(msg::cannot_reread(
            dead_letter.global_position,
        ))),
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
