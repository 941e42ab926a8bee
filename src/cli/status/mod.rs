//! `vantage status`: per perspective, its work (pending, leased, parked), its open dead
//! letters and the age of its oldest work row, whether it is paused and how many lanes are
//! blocked; then the live instances. `--blocked`: the blocked lanes themselves
//! (`blocked`).
//!
//! Ages are measured on the database's clock, the one that wrote the timestamps.

use clap::Args;
use serde_json::{json, Value};

use super::output::{self, human_age, timestamp, Failure, Ui};
use super::GlobalArgs;

mod blocked;

/// Options of `vantage status`.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// The lanes whose head is parked or failing, and what waits behind them.
    #[arg(long)]
    pub blocked: bool,
    /// With `--blocked`: only this perspective.
    #[arg(long, value_name = "NAME", requires = "blocked")]
    pub perspective: Option<String>,
    /// With `--blocked`: at most N lanes listed, the most events waiting first (the totals
    /// count them all).
    #[arg(long, value_name = "N", requires = "blocked", default_value_t = 100)]
    pub limit: u32,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Runs `vantage status`. Exit 0; 78 for invalid configuration; 2 when the database cannot be
/// reached or read.
pub async fn run(global: &GlobalArgs, args: StatusArgs) -> i32 {
    let ui = Ui::new(args.json);
    let result = async {
        let settings = global
            .load_settings()
            .map_err(|e| Failure::with_code(super::exit::CONFIG, e.to_string()))?;
        let store = output::connect(&settings).await?;
        if args.blocked {
            let result = blocked::run(&store, &ui, &args).await;
            store.close().await;
            return result;
        }
        let read = async {
            Ok::<_, crate::store::StoreError>((
                store.perspective_status().await?,
                store.live_instances().await?,
                store.database_now().await?,
                store.blocked_totals(None).await?,
            ))
        }
        .await;
        store.close().await;
        let (perspectives, instances, now, blocked) =
            read.map_err(|e| output::store_failure(&e))?;

        if perspectives.is_empty() {
            ui.say("No perspectives are registered.");
        } else {
            let mut t = output::table(&[
                "Perspective",
                "Pending",
                "Leased",
                "Parked",
                "Dead-lettered",
                "Oldest pending",
            ]);
            for p in &perspectives {
                t.add_row(vec![
                    p.perspective_name.clone(),
                    p.pending.to_string(),
                    p.leased.to_string(),
                    p.parked.to_string(),
                    p.dead_lettered.to_string(),
                    p.oldest_pending_age_seconds
                        .map(human_age)
                        .unwrap_or_else(|| "-".to_owned()),
                ]);
            }
            output::align_right(&mut t, &[1, 2, 3, 4, 5]);
            ui.say(t);
            for p in &perspectives {
                if let Some(since) = p.paused_at {
                    ui.say(blocked::paused_line(
                        &p.perspective_name,
                        &since,
                        p.paused_by.as_deref(),
                        p.paused_reason.as_deref(),
                        (now - since).num_milliseconds() as f64 / 1000.0,
                    ));
                }
            }
            let lanes: i64 = blocked.iter().map(|b| b.lanes).sum();
            if lanes > 0 {
                let events: i64 = blocked.iter().map(|b| b.events).sum();
                ui.say(blocked::summary_line(lanes, events));
            }
        }
        ui.say("");
        if instances.is_empty() {
            ui.say("No live instances.");
        } else {
            let mut t = output::table(&["Instance", "Host", "PID", "Version", "Last heartbeat"]);
            for i in &instances {
                let age = (now - i.last_heartbeat_at).num_milliseconds() as f64 / 1000.0;
                t.add_row(vec![
                    i.instance_id.to_string(),
                    i.host_name.clone(),
                    i.process_id.to_string(),
                    i.version.clone(),
                    format!("{} ago", human_age(age)),
                ]);
            }
            output::align_right(&mut t, &[2]);
            ui.say(t);
            ui.say(format!("{} live instance(s).", instances.len()));
        }

        let perspectives: Vec<Value> = perspectives
            .iter()
            .map(|p| {
                let b = blocked
                    .iter()
                    .find(|b| b.perspective_name == p.perspective_name);
                json!({
                    "blocked_events": b.map_or(0, |b| b.events),
                    "blocked_lanes": b.map_or(0, |b| b.lanes),
                    "dead_lettered": p.dead_lettered,
                    "leased": p.leased,
                    "oldest_pending_age_seconds": p.oldest_pending_age_seconds,
                    "parked": p.parked,
                    "paused": p.paused_at.map(|since| json!({
                        "by": p.paused_by,
                        "reason": p.paused_reason,
                        "since": timestamp(&since),
                    })),
                    "pending": p.pending,
                    "perspective": p.perspective_name,
                })
            })
            .collect();
        let instances: Vec<Value> = instances
            .iter()
            .map(|i| {
                json!({
                    "host_name": i.host_name,
                    "instance_id": i.instance_id.to_string(),
                    "last_heartbeat_age_seconds":
                        (now - i.last_heartbeat_at).num_milliseconds() as f64 / 1000.0,
                    "last_heartbeat_at": timestamp(&i.last_heartbeat_at),
                    "process_id": i.process_id,
                    "service_name": i.service_name,
                    "started_at": timestamp(&i.started_at),
                    "version": i.version,
                })
            })
            .collect();
        Ok(json!({"instances": instances, "perspectives": perspectives}))
    }
    .await;
    ui.finish(result)
}
