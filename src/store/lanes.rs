//! The lane index's safety net: finding lanes that have work but that the index has lost.
//!
//! Producers never write the lane index: their work rows come with wake-ups that claims fold
//! in (migrations/0003_lanes.sql states the invariants). A data-only restore with triggers
//! disabled, or a mistake in a future migration, can still leave a lane with work rows and
//! neither a lane row nor a wake-up; no claim would ever find it. The reconciliation walks the
//! work table's lanes in key order, a bounded number per call, and gives such a lane a row.

use uuid::Uuid;

use super::error::{map_db_error, StoreError};
use super::handle::Store;

/// Where a reconciliation walk stands: after this (perspective, stream) key.
pub type LaneCursor = Option<(String, Uuid)>;

/// One row of `wh_reconcile_lanes`: a repaired lane (stream, perspective) and the cursor.
type ReconcileRow = (Option<Uuid>, Option<String>, Option<String>, Option<Uuid>);

/// What one step of the walk found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LaneRepairs {
    /// Lanes (perspective, stream) that had work but no lane row nor wake-up, now repaired.
    pub repaired: Vec<(String, Uuid)>,
    /// Where the next step starts; `None` when this one reached the end of the work table.
    pub next: LaneCursor,
}

impl Store {
    /// Walks up to `max_lanes` lanes of the work table after `after` (from the start when
    /// `None`) and repairs the lanes the index has lost (`wh_reconcile_lanes`). One index probe
    /// per lane; never waits on a producer.
    pub(crate) async fn reconcile_lanes(
        &self,
        after: &LaneCursor,
        max_lanes: u32,
    ) -> Result<LaneRepairs, StoreError> {
        let (after_p, after_s) = match after {
            Some((p, s)) => (Some(p.as_str()), Some(*s)),
            None => (None, None),
        };
        let rows: Vec<ReconcileRow> = sqlx::query_as(
            "SELECT repaired_stream, repaired_perspective, next_perspective, next_stream \
                 FROM wh_reconcile_lanes($1, $2, $3)",
        )
        .bind(after_p)
        .bind(after_s)
        .bind(max_lanes.clamp(1, i32::MAX as u32) as i32)
        .fetch_all(self.pool())
        .await
        .map_err(map_db_error)?;
        let mut out = LaneRepairs::default();
        for (stream, perspective, next_p, next_s) in rows {
            if let (Some(s), Some(p)) = (stream, perspective) {
                out.repaired.push((p, s));
            }
            if let (Some(p), Some(s)) = (next_p, next_s) {
                out.next = Some((p, s));
            }
        }
        Ok(out)
    }
}
