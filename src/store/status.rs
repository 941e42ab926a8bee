//! Read-only views for `vantage status` and the metrics sampler.

use super::error::{map_db_error, StoreError};
use super::handle::Store;

/// Work and dead letters of one perspective.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct PerspectiveStatus {
    /// The perspective.
    pub perspective_name: String,
    /// Work rows not leased and due now.
    pub pending: i64,
    /// Work rows leased to an instance.
    pub leased: i64,
    /// Work rows parked after a failure until their backoff passes.
    pub parked: i64,
    /// Open (`exhausted`) dead letters.
    pub dead_lettered: i64,
    /// Age in seconds of the oldest work row (None when there is none).
    pub oldest_pending_age_seconds: Option<f64>,
    /// Since when it is paused (`vantage perspectives pause`); None when it runs.
    pub paused_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Why, as the operator said when pausing it.
    pub paused_reason: Option<String>,
    /// Who paused it.
    pub paused_by: Option<String>,
}

/// Totals the metrics sampler publishes as gauges.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoreGauges {
    /// Per perspective status.
    pub perspectives: Vec<PerspectiveStatus>,
    /// Registered instances.
    pub instances_live: i64,
    /// Per perspective with blocked lanes: how many, and the events waiting behind them.
    pub blocked: Vec<super::BlockedTotals>,
}

impl Store {
    /// Per registered perspective: pending, leased, parked, dead-lettered, oldest pending age.
    /// Counts the work table: meant for an operator's command and a sampler tick, not a hot path.
    pub(crate) async fn perspective_status(&self) -> Result<Vec<PerspectiveStatus>, StoreError> {
        sqlx::query_as(
            "WITH w AS ( \
                 SELECT perspective_name, \
                        count(*) FILTER (WHERE instance_id IS NULL AND scheduled_for <= now()) AS pending, \
                        count(*) FILTER (WHERE instance_id IS NOT NULL) AS leased, \
                        count(*) FILTER (WHERE instance_id IS NULL AND scheduled_for > now()) AS parked, \
                        extract(epoch FROM now() - min(created_at))::float8 AS oldest \
                 FROM wh_perspective_events GROUP BY perspective_name), \
             d AS ( \
                 SELECT perspective_name, count(*) AS dead \
                 FROM wh_dead_letters WHERE status = 'exhausted' GROUP BY perspective_name) \
             SELECT p.perspective_name, \
                    coalesce(w.pending, 0) AS pending, coalesce(w.leased, 0) AS leased, \
                    coalesce(w.parked, 0) AS parked, coalesce(d.dead, 0) AS dead_lettered, \
                    w.oldest AS oldest_pending_age_seconds, \
                    r.paused_at, r.paused_reason, r.paused_by \
             FROM (SELECT perspective_name FROM wh_perspectives \
                   UNION SELECT perspective_name FROM w \
                   UNION SELECT perspective_name FROM d) p \
             LEFT JOIN w USING (perspective_name) LEFT JOIN d USING (perspective_name) \
             LEFT JOIN wh_perspectives r USING (perspective_name) \
             ORDER BY p.perspective_name",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Everything the metrics sampler needs, in one call.
    pub(crate) async fn gauges(&self) -> Result<StoreGauges, StoreError> {
        let perspectives = self.perspective_status().await?;
        let instances_live: i64 = sqlx::query_scalar("SELECT count(*) FROM wh_service_instances")
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)?;
        let blocked = self.blocked_totals(None).await?;
        Ok(StoreGauges {
            perspectives,
            instances_live,
            blocked,
        })
    }
}
