//! `vantage perspectives versions | cutover | rollback | retire`: versioned perspectives
//! (docs/versions.md). Each transition is one transaction in the database
//! (`switch_perspective_version`, `retire_perspective_version`); refusals are exit 2 with what
//! to do, a declined confirmation exit 1.

use std::time::{Duration, Instant};

use clap::Args;
use serde_json::{json, Value};

use crate::cli::output::{self, confirm, Failure, Ui};
use crate::store::{Store, Switch, SwitchOutcome, VersionStatus};

/// Options of `vantage perspectives versions`.
#[derive(Debug, Clone, Args)]
pub struct VersionsArgs {
    /// The perspective (its configured name, without `@vN`).
    #[arg(value_name = "NAME")]
    pub name: String,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Options of `vantage perspectives cutover`.
#[derive(Debug, Clone, Args)]
pub struct CutoverArgs {
    /// The perspective.
    #[arg(value_name = "NAME")]
    pub name: String,
    /// How long to wait for the version to have applied every event the live one has (both
    /// keep applying new events; the check is made again until it holds).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub wait: Duration,
    /// The version to make live (default: the newest not retired).
    #[arg(long, value_name = "N")]
    pub to: Option<i32>,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Options of `vantage perspectives rollback`.
#[derive(Debug, Clone, Args)]
pub struct RollbackArgs {
    /// The perspective.
    #[arg(value_name = "NAME")]
    pub name: String,
    /// How long to wait for the version to have applied every event the live one has (both
    /// keep applying new events; the check is made again until it holds).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub wait: Duration,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Options of `vantage perspectives retire`.
#[derive(Debug, Clone, Args)]
pub struct RetireArgs {
    /// The perspective.
    #[arg(value_name = "NAME")]
    pub name: String,
    /// The version to retire (never the live one).
    #[arg(long, value_name = "N")]
    pub version: i32,
    /// Do not ask for confirmation.
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

async fn statuses(store: &Store, name: &str) -> Result<Vec<VersionStatus>, Failure> {
    let versions = store
        .version_status(name)
        .await
        .map_err(|e| output::store_failure(&e))?;
    if versions.is_empty() {
        return Err(Failure::usage(format!(
            "perspective '{}' has no versions: only a perspective with read_schema is versioned (see docs/versions.md)",
            crate::text::one_line(name)
        )));
    }
    Ok(versions)
}

fn version_json(v: &VersionStatus) -> Value {
    json!({
        "version": v.version,
        "state": v.state,
        "behind": v.behind,
        "live": v.state == "live",
        "registry_name": v.registry_name,
        "schema": v.version_schema,
        "backfill_position": v.backfill_position,
        "backfill_target": v.backfill_target,
        "backfill_applied": v.backfill_applied,
        "backfill_started_at": v.backfill_started_at.as_ref().map(output::timestamp),
        "backfill_done_at": v.backfill_done_at.as_ref().map(output::timestamp),
        "created_at": output::timestamp(&v.created_at),
        "live_since": v.live_since.as_ref().map(output::timestamp),
    })
}

/// `vantage perspectives versions NAME`: every version, its state and how far behind it is.
pub(super) async fn versions(ui: &Ui, store: &Store, args: VersionsArgs) -> Result<Value, Failure> {
    let versions = statuses(store, &args.name).await?;
    let mut t = output::table(&["Version", "State", "Behind", "Backfill", "Schema"]);
    for v in &versions {
        let backfill = v.backfill_summary();
        t.add_row(vec![
            v.version.to_string(),
            v.state.clone(),
            v.behind.to_string(),
            backfill,
            v.version_schema.clone(),
        ]);
    }
    ui.say(t);
    let name = crate::text::one_line(&args.name);
    Ok(json!({
        "perspective": name,
        "versions": versions.iter().map(version_json).collect::<Vec<_>>(),
    }))
}

/// `vantage perspectives cutover NAME [--to N]`.
pub(super) async fn cutover(ui: &Ui, store: &Store, args: CutoverArgs) -> Result<Value, Failure> {
    switch(
        ui,
        store,
        &args.name,
        Switch::Cutover,
        args.to,
        args.yes,
        args.wait,
    )
    .await
}

/// `vantage perspectives rollback NAME`.
pub(super) async fn rollback(ui: &Ui, store: &Store, args: RollbackArgs) -> Result<Value, Failure> {
    switch(
        ui,
        store,
        &args.name,
        Switch::Rollback,
        None,
        args.yes,
        args.wait,
    )
    .await
}

async fn switch(
    ui: &Ui,
    store: &Store,
    name: &str,
    kind: Switch,
    to: Option<i32>,
    yes: bool,
    wait: Duration,
) -> Result<Value, Failure> {
    let shown = crate::text::one_line(name);
    let versions = statuses(store, name).await?;
    let live = versions
        .iter()
        .find(|v| v.state == "live")
        .map(|v| v.version);
    let question = match (kind, to) {
        (Switch::Cutover, Some(n)) => format!("Make version {n} of '{shown}' live? [y/N]"),
        (Switch::Cutover, None) => {
            format!("Make the newest version of '{shown}' live? [y/N]")
        }
        (Switch::Rollback, _) => {
            format!("Roll '{shown}' back to the version live before the current one? [y/N]")
        }
    };
    confirm(&question, yes).await?;
    let actor = output::operator_actor();
    let started = Instant::now();
    let outcome = loop {
        let o = store
            .switch_version(name, kind, to, &actor)
            .await
            .map_err(|e| output::store_failure(&e))?;
        if o.outcome == "behind_live" && started.elapsed() < wait {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        break o;
    };
    let SwitchOutcome {
        outcome,
        from_version,
        to_version,
        behind,
    } = outcome;
    let to_shown = to_version.map_or("?".to_owned(), |v| v.to_string());
    let behind = behind.unwrap_or(0);
    match outcome.as_str() {
        "done" => {}
        "unknown" => {
            return Err(Failure::usage(format!(
                "perspective '{shown}' has no version {to_shown}"
            )))
        }
        "retired" => {
            return Err(Failure::usage(format!(
                "version {to_shown} of '{shown}' is retired; it cannot be made live again"
            )))
        }
        "live" => {
            return Err(Failure::usage(format!(
                "version {to_shown} of '{shown}' is already live; nothing was changed"
            )))
        }
        "building" => {
            return Err(Failure::usage(format!(
                "version {to_shown} of '{shown}' is not caught up: {behind} event(s) behind; see `vantage perspectives versions {shown}` and try again when it is ready"
            )))
        }
        "no_previous" => {
            return Err(Failure::usage(format!(
                "'{shown}' has no previous live version to roll back to"
            )))
        }
        "behind_live" => {
            return Err(Failure::usage(format!(
                "version {to_shown} of '{shown}' is {behind} event(s) behind the live version {}; is a daemon running it? try again in a moment",
                live.map_or("?".to_owned(), |v| v.to_string())
            )))
        }
        other => {
            return Err(Failure::usage(format!(
                "unexpected outcome '{other}' from the database"
            )))
        }
    }
    let from_shown = from_version.map_or("none".to_owned(), |v| v.to_string());
    let what = match kind {
        Switch::Cutover => "cutover",
        Switch::Rollback => "rollback",
    };
    tracing::warn!(perspective = %shown, from = %from_shown, to = %to_shown, by = %actor,
        "perspective {what}: version {to_shown} of {shown} is live (was {from_shown})");
    ui.say(format!(
        "Version {to_shown} of '{shown}' is live (was {from_shown}); readers of its read_schema see it now. Back: vantage perspectives {}",
        match kind {
            Switch::Cutover => format!("rollback {shown}"),
            Switch::Rollback => format!("cutover {shown} --to {from_shown}"),
        }
    ));
    Ok(json!({
        "perspective": shown,
        "from_version": from_version,
        "to_version": to_version,
        "by": actor,
    }))
}

/// `vantage perspectives retire NAME --version N`.
pub(super) async fn retire(ui: &Ui, store: &Store, args: RetireArgs) -> Result<Value, Failure> {
    let shown = crate::text::one_line(&args.name);
    statuses(store, &args.name).await?;
    let n = args.version;
    confirm(
        &format!("Retire version {n} of '{shown}'? It stops being applied and its schema is dropped. [y/N]"),
        args.yes,
    )
    .await?;
    let actor = output::operator_actor();
    let (outcome, dropped) = store
        .retire_version(&args.name, n, &actor)
        .await
        .map_err(|e| output::store_failure(&e))?;
    match outcome.as_str() {
        "done" => {}
        "unknown" => {
            return Err(Failure::usage(format!(
                "perspective '{shown}' has no version {n}"
            )))
        }
        "live" => {
            return Err(Failure::usage(format!(
                "version {n} of '{shown}' is live and cannot be retired; cut over to another version first"
            )))
        }
        "retired" => {
            return Err(Failure::usage(format!(
                "version {n} of '{shown}' is already retired"
            )))
        }
        other => {
            return Err(Failure::usage(format!(
                "unexpected outcome '{other}' from the database"
            )))
        }
    }
    tracing::warn!(perspective = %shown, version = n, by = %actor, dropped_rows = dropped,
        "perspective version retired: version {n} of {shown} is no longer applied; its schema was dropped");
    ui.say(format!(
        "Retired version {n} of '{shown}': no longer applied, its schema dropped ({dropped} pending work row(s) removed)."
    ));
    Ok(json!({"perspective": shown, "version": n, "dropped_rows": dropped, "by": actor}))
}
