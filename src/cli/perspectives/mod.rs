//! `vantage perspectives`: the registry (list, pause, resume), rebuilding a perspective's
//! read model (`rebuild`, in a file of its own: the procedure that keeps a rebuild safe on a
//! running daemon), and the versions of a versioned perspective (`versions`, `cutover`,
//! `rollback`, `retire`).

mod rebuild;
mod versions;

use clap::{Args, Subcommand};
use serde_json::{json, Value};

use super::output::{self, Failure, Ui};
use super::{exit, GlobalArgs};
use crate::config::{PerspectiveSettings, Settings};
use crate::store::Store;
use rebuild::rebuild;
pub use versions::{CutoverArgs, RetireArgs, RollbackArgs, VersionsArgs};

/// `vantage perspectives` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum PerspectivesCommand {
    /// List registered perspectives, their event types, and whether this configuration has a
    /// handler for each.
    List(ListArgs),
    /// Reset a perspective's read model (its `reset` statement) and re-queue every historical
    /// event of its types for the daemon to apply.
    Rebuild(RebuildArgs),
    /// Pause a perspective: every daemon's claims skip it from its next claim on; batches in
    /// flight finish and nothing is charged.
    Pause(PauseArgs),
    /// Resume a paused perspective.
    Resume(ResumeArgs),
    /// The versions of a versioned perspective: state, events behind, backfill progress.
    Versions(VersionsArgs),
    /// Make a version of a versioned perspective live, in one transaction (readers of its
    /// read_schema see the old version or the new one, never a mix).
    Cutover(CutoverArgs),
    /// Make the version that was live before the current one live again.
    Rollback(RollbackArgs),
    /// Stop applying a version that is not live and drop its schema.
    #[command(disable_version_flag = true)]
    Retire(RetireArgs),
}

/// Options of `vantage perspectives pause`.
#[derive(Debug, Clone, Args)]
pub struct PauseArgs {
    /// The perspective.
    #[arg(value_name = "NAME")]
    pub name: String,
    /// Why (shown by `status`, the console and the history of who paused it).
    #[arg(long, value_name = "R")]
    pub reason: Option<String>,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Options of `vantage perspectives resume`.
#[derive(Debug, Clone, Args)]
pub struct ResumeArgs {
    /// The perspective.
    #[arg(value_name = "NAME")]
    pub name: String,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Options of `vantage perspectives list`.
#[derive(Debug, Clone, Args)]
pub struct ListArgs {
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Options of `vantage perspectives rebuild`.
#[derive(Debug, Clone, Args)]
pub struct RebuildArgs {
    /// The perspective.
    #[arg(value_name = "NAME")]
    pub name: String,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    pub yes: bool,
}

/// Runs `vantage perspectives`. Exit 0; 1 declined; 2 unknown perspective, no `reset`
/// statement, or a database error; 78 invalid configuration.
pub async fn run(global: &GlobalArgs, cmd: PerspectivesCommand) -> i32 {
    let ui = Ui::new(match &cmd {
        PerspectivesCommand::List(a) => a.json,
        PerspectivesCommand::Pause(a) => a.json,
        PerspectivesCommand::Resume(a) => a.json,
        PerspectivesCommand::Rebuild(_) => false,
        PerspectivesCommand::Versions(a) => a.json,
        PerspectivesCommand::Cutover(a) => a.json,
        PerspectivesCommand::Rollback(a) => a.json,
        PerspectivesCommand::Retire(a) => a.json,
    });
    let result = async {
        let settings = global
            .load_settings()
            .map_err(|e| Failure::with_code(exit::CONFIG, e.to_string()))?;
        if matches!(
            cmd,
            PerspectivesCommand::Cutover(_)
                | PerspectivesCommand::Rollback(_)
                | PerspectivesCommand::Retire(_)
        ) {
            // Each transition is logged (WARN, who did it) where the operator's logs are
            // collected, besides its row in wh_perspective_version_history.
            let _ = crate::telemetry::logging::init(&settings.log);
        }
        let store = output::connect(&settings).await?;
        let result = match cmd {
            PerspectivesCommand::List(_) => list(&ui, &settings, &store).await,
            PerspectivesCommand::Rebuild(args) => rebuild(&ui, &settings, &store, args).await,
            PerspectivesCommand::Pause(args) => pause(&ui, &store, args).await,
            PerspectivesCommand::Resume(args) => resume(&ui, &store, args).await,
            PerspectivesCommand::Versions(args) => versions::versions(&ui, &store, args).await,
            PerspectivesCommand::Cutover(args) => versions::cutover(&ui, &store, args).await,
            PerspectivesCommand::Rollback(args) => versions::rollback(&ui, &store, args).await,
            PerspectivesCommand::Retire(args) => versions::retire(&ui, &store, args).await,
        };
        store.close().await;
        result
    }
    .await;
    ui.finish(result)
}

async fn list(ui: &Ui, settings: &Settings, store: &Store) -> Result<Value, Failure> {
    let registered = store
        .perspectives()
        .await
        .map_err(|e| output::store_failure(&e))?;
    let configured = |name: &str| settings.perspectives.iter().any(|p| p.name == name);
    // Configured but not yet registered (no daemon with this configuration has started): shown
    // too, so the operator sees the whole picture, and marked as such.
    let unregistered: Vec<&PerspectiveSettings> = settings
        .perspectives
        .iter()
        .filter(|p| !registered.iter().any(|r| r.perspective_name == p.name))
        .collect();

    let mut rows: Vec<Value> = Vec::new();
    for r in &registered {
        rows.push(json!({
            "event_types": r.event_types,
            "handler": configured(&r.perspective_name),
            "perspective": r.perspective_name,
            "registered": true,
        }));
    }
    for p in &unregistered {
        rows.push(json!({
            "event_types": p.events,
            "handler": true,
            "perspective": p.name,
            "registered": false,
        }));
    }
    rows.sort_by(|a, b| a["perspective"].as_str().cmp(&b["perspective"].as_str()));

    if rows.is_empty() {
        ui.say("No perspectives are registered or configured.");
    } else {
        let mut t = output::table(&["Perspective", "Event types", "Registered", "Handler here"]);
        for row in &rows {
            let types: Vec<&str> = row["event_types"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            t.add_row(vec![
                row["perspective"].as_str().unwrap_or("").to_owned(),
                types.join(", "),
                yes_no(row["registered"].as_bool()),
                yes_no(row["handler"].as_bool()),
            ]);
        }
        ui.say(t);
        ui.say(format!(
            "{} registered perspective(s); {} configured here.",
            registered.len(),
            settings.perspectives.len()
        ));
    }
    Ok(json!({ "perspectives": rows }))
}

/// `vantage perspectives pause NAME [--reason R]`: sets `paused_at` (claims ask
/// `wh_claimable_perspectives`, which leaves paused perspectives out, so every daemon stops
/// claiming it at its next claim, within one poll interval). Leased work finishes; nothing is
/// released early or charged. Pausing a paused perspective changes nothing (exit 0).
async fn pause(ui: &Ui, store: &Store, args: PauseArgs) -> Result<Value, Failure> {
    let name = args.name.as_str();
    let by = output::operator_actor();
    let changed = store
        .pause_perspective(name, args.reason.as_deref(), &by)
        .await
        .map_err(|e| output::store_failure(&e))?;
    let Some(changed) = changed else {
        return Err(Failure::usage(crate::dlq::msg::unknown_perspective(name)));
    };
    let state = pause_state(store, name).await?;
    if changed {
        ui.say(format!(
            "Paused perspective '{name}': every daemon stops claiming it at its next claim; batches in flight finish, nothing is charged. Resume with: vantage perspectives resume {name}"
        ));
    } else {
        ui.say(format!(
            "Perspective '{name}' was already paused (since {}). Nothing was changed.",
            state["paused_at"].as_str().unwrap_or("?")
        ));
    }
    let mut data = state;
    data["changed"] = changed.into();
    Ok(data)
}

/// `vantage perspectives resume NAME`: clears the pause and wakes the daemons.
async fn resume(ui: &Ui, store: &Store, args: ResumeArgs) -> Result<Value, Failure> {
    let name = args.name.as_str();
    let changed = store
        .resume_perspective(name)
        .await
        .map_err(|e| output::store_failure(&e))?;
    let Some(changed) = changed else {
        return Err(Failure::usage(crate::dlq::msg::unknown_perspective(name)));
    };
    if changed {
        ui.say(format!(
            "Resumed perspective '{name}': daemons claim its work again."
        ));
    } else {
        ui.say(format!(
            "Perspective '{name}' is not paused. Nothing was changed."
        ));
    }
    let mut data = pause_state(store, name).await?;
    data["changed"] = changed.into();
    Ok(data)
}

/// `{perspective, paused, paused_at, paused_by, paused_reason}` as stored now.
async fn pause_state(store: &Store, name: &str) -> Result<Value, Failure> {
    let states = store
        .pause_states()
        .await
        .map_err(|e| output::store_failure(&e))?;
    let s = states.into_iter().find(|s| s.perspective_name == name);
    Ok(json!({
        "paused": s.as_ref().is_some_and(|s| s.paused_at.is_some()),
        "paused_at": s.as_ref().and_then(|s| s.paused_at.as_ref()).map(output::timestamp),
        "paused_by": s.as_ref().and_then(|s| s.paused_by.clone()),
        "paused_reason": s.as_ref().and_then(|s| s.paused_reason.clone()),
        "perspective": name,
    }))
}

fn yes_no(b: Option<bool>) -> String {
    if b == Some(true) { "yes" } else { "no" }.to_owned()
}
