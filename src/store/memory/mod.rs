//! The in-memory store (docs/cli.md, "In-memory mode"): the drain pipeline's [`WorkStore`]
//! without PostgreSQL, for unit tests of perspectives (see [`testkit`](crate::testkit), which
//! drives it).
//!
//! It keeps what the PostgreSQL store keeps, by the same rules: one work row per event and
//! subscribed perspective (the fan-out), lanes (stream, perspective) claimed as a prefix from
//! their head and never past a row that is parked or validly leased (the head-of-line gate),
//! attempts + 1 on every claim that takes a row over (refunded when it is given back unseen),
//! failures parked for their backoff, every change fenced on the lease holder. What it does
//! not have:
//! - **dead letters**: the DLQ pre-filter passes everything through and a permanent failure is
//!   recorded as a failure, so rows past the maximum stay and are retried (seed 000: "in-memory
//!   hosts with no persistence layer");
//! - **a database transaction**: perspectives get [`ApplyTx::none`](crate::perspective::ApplyTx::none);
//!   a batch's own changes (completions, failures, give-backs) still commit together or not at
//!   all;
//! - **real time**: its clock starts at zero and moves only when told ([`MemoryStore::advance`]),
//!   so backoffs and leases are deterministic.

mod state;
mod store;
mod work;

pub use self::store::{MemoryStore, MemoryWork};

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;
    use uuid::Uuid;

    use super::*;
    use crate::store::{InstanceId, NewEvent, WorkRow, WorkStore, WorkTx};

    const LEASE: Duration = Duration::from_secs(60);

    /// Was `MemoryStore`'s doc example: claiming by hand through `WorkStore`, now crate-private.
    #[tokio::test]
    async fn a_failure_parks_the_row_for_its_backoff_on_the_stores_clock() {
        let store = MemoryStore::new();
        store.subscribe("totals", vec!["*".into()]);
        let me = InstanceId::new();
        store.register_instance(me);
        let stream = uuid::Uuid::new_v4();
        store.append(
            stream,
            vec![NewEvent::new("Added", serde_json::json!({ "n": 1 }))],
        );

        let lease = Duration::from_secs(60);
        let rows = store
            .claim_work(me, lease, 10, 100, &["totals".into()])
            .await
            .unwrap();
        assert_eq!((rows.len(), rows[0].attempts), (1, 1));

        // A failure parks the row for its backoff, on the store's clock.
        let id = rows[0].event_work_id;
        store
            .record_failure(me, id, "boom", Duration::from_secs(5))
            .await
            .unwrap();
        assert!(store
            .claim_work(me, lease, 10, 100, &["totals".into()])
            .await
            .unwrap()
            .is_empty());
        store.advance(Duration::from_secs(5));
        let again = store
            .claim_work(me, lease, 10, 100, &["totals".into()])
            .await
            .unwrap();
        assert_eq!((again[0].attempts, again[0].failures), (2, 1));
    }

    fn store_with(perspectives: &[&str]) -> MemoryStore {
        let store = MemoryStore::new();
        for p in perspectives {
            store.subscribe(p, vec!["*".into()]);
        }
        store
    }

    fn instance(store: &MemoryStore) -> InstanceId {
        let i = InstanceId::new();
        store.register_instance(i);
        i
    }

    fn events(n: usize) -> Vec<NewEvent> {
        (0..n).map(|_| NewEvent::new("E", json!({}))).collect()
    }

    async fn claim(store: &MemoryStore, i: InstanceId, lanes: u32, rows: u32) -> Vec<WorkRow> {
        store
            .claim_work(i, LEASE, lanes, rows, &["p".into(), "q".into()])
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_lapsed_lease_is_taken_over_as_an_attempt_and_refunded_exactly() {
        let store = store_with(&["p"]);
        let (a, b) = (instance(&store), instance(&store));
        store.append(Uuid::new_v4(), events(1));
        assert_eq!(claim(&store, a, 10, 10).await[0].attempts, 1);
        assert!(claim(&store, b, 10, 10).await.is_empty(), "validly leased");
        store.advance(LEASE + Duration::from_secs(1));
        let taken = claim(&store, b, 10, 10).await;
        assert_eq!(taken[0].attempts, 2);
        store
            .release_unstarted(b, &[taken[0].event_work_id])
            .await
            .unwrap();
        assert_eq!(
            store.work()[0].attempts,
            1,
            "the takeover's bump, and only it"
        );
    }

    #[tokio::test]
    async fn the_old_holder_changes_nothing_after_a_takeover() {
        let store = store_with(&["p"]);
        let (a, b) = (instance(&store), instance(&store));
        store.append(Uuid::new_v4(), events(1));
        let id = claim(&store, a, 10, 10).await[0].event_work_id;
        store.advance(LEASE + Duration::from_secs(1));
        claim(&store, b, 10, 10).await;
        let mut tx = store.begin_batch(LEASE).await.unwrap();
        assert_eq!(tx.complete(a, &[id]).await.unwrap(), 0);
        tx.commit().await.unwrap();
        assert!(!store.record_failure(a, id, "late", LEASE).await.unwrap());
        assert_eq!(store.work().len(), 1);
        assert!(store.work()[0].leased);
    }

    #[tokio::test]
    async fn a_transaction_that_does_not_commit_changes_nothing() {
        let store = store_with(&["p"]);
        let a = instance(&store);
        store.append(Uuid::new_v4(), events(2));
        let ids: Vec<Uuid> = claim(&store, a, 10, 10)
            .await
            .iter()
            .map(|r| r.event_work_id)
            .collect();
        let mut tx = store.begin_batch(LEASE).await.unwrap();
        assert_eq!(tx.complete(a, &ids).await.unwrap(), 2);
        drop(tx);
        assert_eq!(store.work().len(), 2);
        let mut tx = store.begin_batch(LEASE).await.unwrap();
        tx.savepoint().await.unwrap();
        tx.complete(a, &ids[..1]).await.unwrap();
        tx.rollback_to_savepoint().await.unwrap();
        tx.complete(a, &ids[1..]).await.unwrap();
        tx.commit().await.unwrap();
        let left: Vec<Uuid> = store.work().iter().map(|w| w.event_work_id).collect();
        assert_eq!(left, ids[..1]);
    }

    #[tokio::test]
    async fn a_claim_stops_at_a_row_leased_to_someone_else() {
        let store = store_with(&["p"]);
        let (a, b) = (instance(&store), instance(&store));
        store.append(Uuid::new_v4(), events(3));
        let rows = claim(&store, a, 10, 10).await;
        assert_eq!(rows.len(), 3);
        // The first and the last go back; the middle one stays leased to `a`.
        store
            .release_unstarted(a, &[rows[0].event_work_id, rows[2].event_work_id])
            .await
            .unwrap();
        let taken = claim(&store, b, 10, 10).await;
        assert_eq!(taken.len(), 1, "only the prefix before a held row");
        assert_eq!(taken[0].stream_version, 1);
    }

    #[tokio::test]
    async fn lanes_are_shared_fairly_between_perspectives() {
        let store = store_with(&["p", "q"]);
        let a = instance(&store);
        for _ in 0..5 {
            store.append(Uuid::new_v4(), events(1));
        }
        let rows = claim(&store, a, 2, 10).await;
        let mut names: Vec<&str> = rows.iter().map(|r| r.perspective_name.as_str()).collect();
        names.sort();
        assert_eq!(names, ["p", "q"]);
    }

    #[tokio::test]
    async fn a_parked_row_waits_for_the_clock_and_holds_its_lane() {
        let store = store_with(&["p"]);
        let a = instance(&store);
        store.append(Uuid::new_v4(), events(2));
        let head = claim(&store, a, 10, 1).await[0].event_work_id;
        assert!(store
            .record_failure(a, head, "boom", Duration::from_secs(5))
            .await
            .unwrap());
        assert!(claim(&store, a, 10, 10).await.is_empty());
        assert_eq!(store.next_due(), Some(Duration::from_secs(5)));
        store.advance(Duration::from_secs(5));
        let rows = claim(&store, a, 10, 10).await;
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].attempts, rows[0].failures), (2, 1));
    }

    #[tokio::test]
    async fn an_unregistered_instance_claims_nothing() {
        let store = store_with(&["p"]);
        store.append(Uuid::new_v4(), events(1));
        assert!(claim(&store, InstanceId::new(), 10, 10).await.is_empty());
    }
}
