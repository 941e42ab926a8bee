//! The lane reconciliation task: the daemon's safety net for the lane index.
//!
//! At start-up it walks every lane of the work table once; afterwards a bounded step of the
//! walk every [`LaneReconciliation::PERIOD`], starting again from the top when it reaches the
//! end. A lane that has work but neither a lane-index row nor a wake-up (a data-only restore
//! with triggers disabled, a migration mistake) is given a row, counted in
//! `vantage_lanes_repaired_total` and reported in one WARN line per step that found any.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};

use super::BackgroundTask;
use crate::store::{LaneCursor, Store};
use crate::telemetry::metrics as m;

/// Walks the lanes of the work table, repairing those the lane index lost.
pub struct LaneReconciliation {
    /// The database.
    pub store: Store,
    /// Where the walk stands.
    pub cursor: LaneCursor,
    /// Whether the start-up pass (the whole table) is done.
    pub started: bool,
}

impl LaneReconciliation {
    /// How often a periodic step runs.
    pub const PERIOD: Duration = Duration::from_secs(10);
    /// Lanes one call walks (one index probe each).
    pub const STEP: u32 = 1_000;

    /// A walk from the start, the start-up pass first.
    pub fn new(store: Store) -> Self {
        LaneReconciliation {
            store,
            cursor: None,
            started: false,
        }
    }

    /// One call of the walk; returns (lanes repaired, whether it reached the end), having logged
    /// and counted what it repaired.
    async fn step(&mut self) -> Result<(usize, bool), crate::store::StoreError> {
        let found = self.store.reconcile_lanes(&self.cursor, Self::STEP).await?;
        self.cursor = found.next.clone();
        let n = found.repaired.len();
        if n > 0 {
            let mut by_perspective: BTreeMap<&str, u64> = BTreeMap::new();
            for (p, _) in &found.repaired {
                *by_perspective.entry(p.as_str()).or_default() += 1;
            }
            for (p, k) in &by_perspective {
                metrics::counter!(m::LANES_REPAIRED_TOTAL, m::LABEL_PERSPECTIVE => p.to_string())
                    .increment(*k);
            }
            let perspectives: Vec<&str> = by_perspective.keys().copied().collect();
            tracing::warn!(
                lanes = n,
                perspectives = ?perspectives,
                "lane index repaired: lanes had work but no lane row nor wake-up (a restore with triggers disabled, or a migration mistake); they are claimable again"
            );
        }
        Ok((n, found.next.is_none()))
    }
}

impl BackgroundTask for LaneReconciliation {
    async fn activate(&mut self) -> Value {
        let mut repaired = 0usize;
        loop {
            match self.step().await {
                Ok((n, end)) => {
                    repaired += n;
                    if end {
                        self.started = true;
                        break;
                    }
                    // After the start-up pass, one step per activation.
                    if self.started {
                        break;
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "lane reconciliation failed; trying again later");
                    return json!({"error": error.to_string(), "repaired": repaired});
                }
            }
        }
        json!({"repaired": repaired, "startup_pass_done": self.started})
    }
}
