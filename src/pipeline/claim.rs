//! The claim stage: one call of `get_stream_events` (with no stream list) folds the lane
//! wake-ups into the lane index, takes due lanes from it (orphaned ones included: expired
//! leases, dead holders) and leases the claimable prefix of each, returning the rows raw; the
//! lanes are then reserved in this process. No other claim function is on the daemon's path.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::inflight::InFlight;
use super::lease::LeasedBatch;
use crate::store::{InstanceId, StoreError, WorkStore};
use crate::telemetry::metrics as m;

/// How much one claim takes.
#[derive(Clone, Debug)]
pub struct ClaimLimits {
    /// Lease length.
    pub lease: Duration,
    /// Lanes per claim (`worker.max_streams_per_claim`).
    pub max_streams: u32,
    /// Rows per claim (`worker.batch_size`).
    pub batch_size: u32,
}

/// Whether a claim that returned `rows` took all it was allowed (`limits`' rows or lanes): more
/// work is then likely due than one claim could take.
pub fn is_full(rows: &[crate::store::WorkRow], limits: &ClaimLimits) -> bool {
    if rows.len() >= limits.batch_size as usize {
        return true;
    }
    // Rows come ordered by lane: count where the lane changes.
    let lanes = 1 + rows
        .windows(2)
        .filter(|w| {
            (w[0].stream_id, &w[0].perspective_name) != (w[1].stream_id, &w[1].perspective_name)
        })
        .count();
    !rows.is_empty() && lanes >= limits.max_streams as usize
}

/// Claims one batch and returns its lease handle. Loops of one process claim concurrently: the
/// database hands each lane to one claimer at a time and never re-leases a row validly leased
/// to us. A lane another loop of ours still holds can come back here only with rows that loop
/// is done with (a row it failed that is due again) or whose lease lapsed under it: the handle
/// gives the first back at once, with a refund, and leaves the second to that loop.
/// `max_attempts` is for the handle's log lines.
pub async fn claim_batch<S: WorkStore>(
    store: &S,
    instance: InstanceId,
    perspectives: &[String],
    limits: &ClaimLimits,
    inflight: &Arc<InFlight>,
    max_attempts: Option<u32>,
) -> Result<LeasedBatch<S>, StoreError> {
    claim_batch_reading(
        store,
        instance,
        perspectives,
        limits,
        inflight,
        max_attempts,
        true,
    )
    .await
}

/// [`claim_batch`], with the rows' payloads fetched only when `data` (some perspective of
/// `perspectives` reads them: [`Perspective::reads_data`](crate::perspective::Perspective::reads_data)).
pub(crate) async fn claim_batch_reading<S: WorkStore>(
    store: &S,
    instance: InstanceId,
    perspectives: &[String],
    limits: &ClaimLimits,
    inflight: &Arc<InFlight>,
    max_attempts: Option<u32>,
    data: bool,
) -> Result<LeasedBatch<S>, StoreError> {
    let started = Instant::now();
    // From the statement until its rows are recorded: a sweep of lost claims waits for it.
    let in_flight = inflight.claiming().await;
    let rows = store
        .claim_work_reading(
            instance,
            limits.lease,
            limits.max_streams,
            limits.batch_size,
            perspectives,
            data,
        )
        .await
        .inspect_err(|_| inflight.claim_failed())?;
    let lease = LeasedBatch::take(store.clone(), instance, max_attempts, inflight, rows).await?;
    drop(in_flight);

    metrics::histogram!(m::CLAIM_DURATION_SECONDS).record(started.elapsed().as_secs_f64());
    let mut claimed: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for r in lease.rows() {
        let entry = claimed.entry(r.perspective_name.as_str()).or_default();
        entry.0 += 1;
        // A claim beyond first delivery and recorded failures: a lapsed or dead holder's
        // lease was taken over.
        if r.attempts > r.failures + 1 {
            entry.1 += 1;
        }
    }
    for (perspective, (n, takeovers)) in claimed {
        metrics::counter!(m::EVENTS_CLAIMED_TOTAL, m::LABEL_PERSPECTIVE => perspective.to_string())
            .increment(n);
        if takeovers > 0 {
            metrics::counter!(m::LEASE_TAKEOVERS_TOTAL, m::LABEL_PERSPECTIVE => perspective.to_string())
                .increment(takeovers);
        }
    }
    Ok(lease)
}

#[cfg(test)]
mod tests {
    use uuid::Uuid;

    use super::*;
    use crate::store::WorkRow;

    fn row(perspective: &str, stream_id: Uuid) -> WorkRow {
        WorkRow::sample(perspective, stream_id)
    }

    fn limits(max_streams: u32, batch_size: u32) -> ClaimLimits {
        ClaimLimits {
            lease: Duration::from_secs(60),
            max_streams,
            batch_size,
        }
    }

    #[test]
    fn a_claim_is_full_when_it_took_as_many_rows_or_lanes_as_allowed() {
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let two_lanes_of_one_stream = [row("P", a), row("P", a), row("Q", a)];
        assert!(!is_full(&[], &limits(1, 1)));
        assert!(is_full(&two_lanes_of_one_stream, &limits(2, 10)));
        assert!(!is_full(&two_lanes_of_one_stream, &limits(3, 10)));
        assert!(is_full(&two_lanes_of_one_stream, &limits(3, 3)));
        assert!(!is_full(&[row("P", a), row("P", b)], &limits(3, 3)));
        assert!(is_full(&[row("P", a), row("P", b)], &limits(2, 3)));
    }
}
