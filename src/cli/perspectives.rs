//! `vantage perspectives`: the registry, and rebuilding a perspective's read model.
//!
//! A rebuild runs the perspective's `reset` statement and then re-queues every historical event
//! of its types, all in ONE transaction: an interrupted rebuild changes nothing, and the daemon
//! never sees the read model reset without its events queued again. With a `TRUNCATE` reset the
//! daemon's concurrent applies wait for the rebuild to commit, so each event lands exactly once
//! (a `DELETE`-based reset does not take that lock: stop the daemon first, or use TRUNCATE).
//! Re-queueing skips events already queued for the perspective (`ON CONFLICT DO NOTHING`) and
//! events with an open dead letter (the operator decides those).

use clap::{Args, Subcommand};
use serde_json::{json, Value};

use super::output::{self, confirm, Confirmed, Failure, Ui};
use super::{exit, GlobalArgs};
use crate::config::{PerspectiveSettings, Settings};
use crate::perspective::{Perspective, SqlPerspective};
use crate::store::{requeue_history_batch_in, Store};

/// Events re-queued per round trip of a rebuild.
const REBUILD_BATCH: i64 = 10_000;

/// `vantage perspectives` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum PerspectivesCommand {
    /// List registered perspectives, their event types, and whether this configuration has a
    /// handler for each.
    List(ListArgs),
    /// Reset a perspective's read model (its `reset` statement) and re-queue every historical
    /// event of its types for the daemon to apply.
    Rebuild(RebuildArgs),
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
    let ui = Ui::new(matches!(&cmd, PerspectivesCommand::List(a) if a.json));
    let result = async {
        let settings = global
            .load_settings()
            .map_err(|e| Failure::with_code(exit::CONFIG, e.to_string()))?;
        let store = output::connect(&settings).await?;
        let result = match cmd {
            PerspectivesCommand::List(_) => list(&ui, &settings, &store).await,
            PerspectivesCommand::Rebuild(args) => rebuild(&ui, &settings, &store, args).await,
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

fn yes_no(b: Option<bool>) -> String {
    if b == Some(true) { "yes" } else { "no" }.to_owned()
}

async fn rebuild(
    ui: &Ui,
    settings: &Settings,
    store: &Store,
    args: RebuildArgs,
) -> Result<Value, Failure> {
    let name = args.name.as_str();
    let record = store
        .perspective(name)
        .await
        .map_err(|e| output::store_failure(&e))?;
    let Some(record) = record else {
        return Err(Failure::usage(format!(
            "No perspective named '{name}' is registered."
        )));
    };
    let Some(config) = settings.perspectives.iter().find(|p| p.name == name) else {
        return Err(Failure::usage(format!(
            "Perspective '{name}' has no handler in this configuration; cannot rebuild it."
        )));
    };
    if config.reset.is_none() {
        return Err(Failure::usage(format!(
            "Perspective '{name}' has no reset statement in this configuration; cannot rebuild it (add `reset` to its [[perspectives]] entry)."
        )));
    }
    if record.event_types != config.events {
        // Re-queueing follows the registry (the same subscription the fan-out uses).
        ui.note(format!(
            "Note: '{name}' is registered for [{}] but configured for [{}]; events are re-queued by the registered types.",
            record.event_types.join(", "),
            config.events.join(", ")
        ));
    }

    let confirmed = confirm(
        &format!(
            "Rebuild perspective '{name}'? Its read model is reset now and every historical event of its types is queued again. [y/N]"
        ),
        args.yes,
    )
    .await?;

    let handler = SqlPerspective::from_settings(config);
    let (queued, expected) = rebuild_in_one_transaction(ui, store, &handler, &confirmed)
        .await
        .map_err(|e| {
            Failure::usage(format!(
                "Rebuild of '{name}' failed: {e}. Nothing was changed."
            ))
        })?;
    ui.say(format!(
        "Rebuilt '{name}': read model reset; {queued} event(s) queued again for the daemon to apply."
    ));
    Ok(json!({"expected": expected, "perspective": name, "queued": queued}))
}

/// Runs the `reset` statement, then re-queues every event of the perspective's types up to the
/// current end of the store in batches (progress on stderr), and commits once. Events appended
/// later are queued by the fan-out itself. Returns (queued, the approximate total).
async fn rebuild_in_one_transaction(
    ui: &Ui,
    store: &Store,
    handler: &SqlPerspective,
    _confirmed: &Confirmed,
) -> Result<(u64, i64), String> {
    let name = handler.name().to_string();
    let up_to = store
        .max_global_position()
        .await
        .map_err(|e| e.to_string())?;
    let expected = store
        .history_event_count(&name, up_to)
        .await
        .map_err(|e| e.to_string())?;
    let mut tx = store.pool().begin().await.map_err(|e| e.to_string())?;
    handler
        .reset(&mut tx)
        .await
        .map_err(|e| format!("the reset statement failed: {}", e.message()))?;
    ui.note(format!("Reset the read model of '{name}'."));
    let mut queued = 0u64;
    let mut after = 0i64;
    loop {
        let (n, last) = requeue_history_batch_in(&mut tx, &name, after, up_to, REBUILD_BATCH)
            .await
            .map_err(|e| e.to_string())?;
        queued += n;
        let Some(last) = last else { break };
        after = last;
        ui.note(format!("queued {queued} of ~{expected}"));
    }
    tx.commit().await.map_err(|e| e.to_string())?;
    Ok((queued, expected))
}
