//! `vantage perspectives rebuild`: runs the perspective's `reset` statement and re-queues
//! every historical event of its (registered) types, safe on a running daemon; how, and what
//! is guaranteed, is [`crate::perspective::rebuild`]'s (docs/pipeline.md, "Replays"). This
//! command checks its arguments, asks, and says what the rebuild does.

use serde_json::{json, Value};

use super::RebuildArgs;
use crate::cli::output::{self, confirm, Failure, Ui};
use crate::config::Settings;
use crate::perspective::rebuild::{self, RebuildError, RebuildProgress};
use crate::perspective::SqlPerspective;
use crate::store::Store;

pub(super) async fn rebuild(
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

    let _confirmed = confirmed;
    let handler = SqlPerspective::from_settings(config);
    let rebuilt = rebuild::rebuild(store, &handler, settings.worker.lease, |p| {
        ui.note(progress_note(name, p));
    })
    .await
    .map_err(|e| failure(name, e))?;
    ui.say(format!(
        "Rebuilt '{name}': read model reset; {} event(s) queued again for the daemon to apply.",
        rebuilt.queued
    ));
    Ok(json!({"expected": rebuilt.expected, "perspective": name, "queued": rebuilt.queued}))
}

/// What the operator reads of a rebuild's progress.
fn progress_note(name: &str, progress: RebuildProgress) -> String {
    match progress {
        RebuildProgress::WaitingForLock => format!(
            "Waiting for claims, dead-letter moves and replays of '{name}' in progress to finish..."
        ),
        RebuildProgress::WaitingForInFlight { in_flight, bound } => format!(
            "Claims of '{name}' are paused; waiting for {in_flight} event(s) in flight in the daemon to finish (at most {})...",
            humantime::format_duration(bound)
        ),
        RebuildProgress::TakingBackInFlight { in_flight, after } => format!(
            "{in_flight} event(s) of '{name}' are still leased after {}: taking them back; their applies in flight will be rolled back.",
            humantime::format_duration(after)
        ),
        RebuildProgress::TookBackLapsed(n) => format!("Took back {n} lapsed lease(s) of '{name}'."),
        RebuildProgress::RedoingInterrupted(earlier) => format!(
            "An earlier rebuild of '{name}' was interrupted (it had marked history up to position {earlier}); redoing it."
        ),
        RebuildProgress::Reset => format!("Reset the read model of '{name}'."),
        RebuildProgress::Queued { queued, expected } => format!("queued {queued} of ~{expected}"),
    }
}

/// Every stop of a rebuild is a usage failure (exit 2) saying whether anything changed.
fn failure(name: &str, e: RebuildError) -> Failure {
    Failure::usage(match e {
        RebuildError::AlreadyRunning => format!(
            "Perspective '{name}' is already being rebuilt by another command. Nothing was changed."
        ),
        RebuildError::Busy(_) => format!("Rebuild of '{name}' failed: {e}. Nothing was changed."),
        RebuildError::Failed(e) => {
            format!("Rebuild of '{name}' failed: {e}. Nothing was changed.")
        }
        RebuildError::Unfinished(e) => format!(
            "Rebuild of '{name}' failed while re-queueing its history: {e}. Its read model was reset and the daemons do not apply it until it is rebuilt: run `vantage perspectives rebuild {name}` again."
        ),
    })
}
