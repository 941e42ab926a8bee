//! The claim stage: acquire lanes (`claim_orphaned_perspective_events`), reserve their streams
//! in this process, then claim and fetch their rows (`get_stream_events`), raw.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::inflight::{InFlight, Reservation};
use super::lease::give_back_heads;
use crate::store::{InstanceId, Store, StoreError, WorkRow};
use crate::telemetry::metrics as m;

/// How much one claim takes.
#[derive(Clone, Debug)]
pub struct ClaimLimits {
    /// Lease length.
    pub lease: Duration,
    /// Streams per claim (`worker.max_streams_per_claim`).
    pub max_streams: u32,
    /// Rows per claim (`worker.batch_size`).
    pub batch_size: u32,
}

/// The rows of one claim, with the reservation of their streams.
#[derive(Debug)]
pub struct ClaimedBatch {
    /// Rows leased to us, ordered by stream, perspective, stream_version.
    pub rows: Vec<WorkRow>,
    /// Holds the streams until dropped; the lease handle tracks the rows in it for renewal.
    pub reservation: Reservation,
}

/// Claims one batch. Lane heads acquired for streams another loop of this process holds, or
/// left out of the fetch window, are given back at once with a refund.
pub async fn claim_batch(
    store: &Store,
    instance: InstanceId,
    perspectives: &[String],
    limits: &ClaimLimits,
    inflight: &Arc<InFlight>,
) -> Result<ClaimedBatch, StoreError> {
    let started = Instant::now();
    let claim_guard = inflight.claim_lock().await;
    let heads = store
        .claim_orphaned(
            instance,
            limits.lease,
            limits.max_streams,
            limits.batch_size,
            Some(perspectives),
        )
        .await?;

    let mut streams: Vec<Uuid> = Vec::new();
    for h in &heads {
        if !streams.contains(&h.stream_id) {
            streams.push(h.stream_id);
        }
    }
    let (reservation, taken) = inflight.reserve(&streams);
    drop(claim_guard);

    let rows = if reservation.streams().is_empty() {
        Vec::new()
    } else {
        match store
            .get_stream_events(
                instance,
                reservation.streams(),
                limits.lease,
                Some(perspectives),
                Some(limits.batch_size),
            )
            .await
        {
            Ok(rows) => rows,
            Err(e) => {
                // Give the heads back rather than let them sit leased until expiry.
                let ids: Vec<Uuid> = heads.iter().map(|h| h.event_work_id).collect();
                let _ = give_back_heads(store, instance, &ids).await;
                return Err(e);
            }
        }
    };

    // Heads we hold but will not work on now: another loop has their stream, or the fetch
    // window (batch_size) left them out.
    let fetched: HashSet<Uuid> = rows.iter().map(|r| r.event_work_id).collect();
    // Heads of a stream another loop of ours holds go back at once. Claims are serialised and
    // skip streams where we hold a valid head, so such a head can only be acquired once that
    // loop has finished fetching (it fetches once per batch): it will never pick the head up.
    let giveback: Vec<Uuid> = heads
        .iter()
        .filter(|h| taken.contains(&h.stream_id) || !fetched.contains(&h.event_work_id))
        .map(|h| h.event_work_id)
        .collect();
    give_back_heads(store, instance, &giveback).await?;

    metrics::histogram!(m::CLAIM_DURATION_SECONDS).record(started.elapsed().as_secs_f64());
    let mut claimed: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for r in &rows {
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
    Ok(ClaimedBatch { rows, reservation })
}
