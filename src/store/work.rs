//! The storage seam of the drain pipeline: what the pipeline (claim → DLQ filter → envelope →
//! cooldown → apply → complete) needs from a store, as two traits, [`WorkStore`] and its batch
//! transaction [`WorkTx`]. Two stores implement them: [`Store`] (PostgreSQL, the daemon's) and
//! [`MemoryStore`](super::MemoryStore) (in-process, for unit tests of perspectives). The
//! pipeline code is the same over both; only what the store itself does differs.
//!
//! Every change is fenced on the lease holder: a row no longer leased to `instance` is left
//! alone, and the call says how many rows it changed.

use std::time::Duration;

use async_trait::async_trait;
use sqlx::PgConnection;
use uuid::Uuid;

use super::apply::StatementBatch;
use super::claims::WorkRow;
use super::dead_letters::MoveOutcome;
use super::error::StoreError;
use super::handle::Store;
use super::instances::InstanceId;
use super::leases;

/// What the pipeline needs from a store of work rows. Cheap to clone (a handle).
#[async_trait]
pub trait WorkStore: Clone + Send + Sync + std::fmt::Debug + 'static {
    /// A batch transaction of this store.
    type Tx: WorkTx;

    /// Takes up to `max_lanes` due lanes of `perspectives` and leases the claimable prefix of
    /// each (`max_rows` rows in all) to `instance` for `lease`: attempts + 1 on a takeover,
    /// never a row validly leased to anyone (us included). Rows ordered by stream,
    /// perspective, stream_version.
    async fn claim_work(
        &self,
        instance: InstanceId,
        lease: Duration,
        max_lanes: u32,
        max_rows: u32,
        perspectives: &[String],
    ) -> Result<Vec<WorkRow>, StoreError>;

    /// [`claim_work`](Self::claim_work); without `data` the store may leave the rows' payloads
    /// out (`event_data` `None`): no perspective of the caller reads them.
    async fn claim_work_reading(
        &self,
        instance: InstanceId,
        lease: Duration,
        max_lanes: u32,
        max_rows: u32,
        perspectives: &[String],
        _data: bool,
    ) -> Result<Vec<WorkRow>, StoreError> {
        self.claim_work(instance, lease, max_lanes, max_rows, perspectives)
            .await
    }

    /// Gives back rows no handler saw, refunding exactly the bump their claim made.
    async fn release_unstarted(
        &self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError>;

    /// Gives back rows a handler saw, without a refund.
    async fn release_started(&self, instance: InstanceId, ids: &[Uuid]) -> Result<u64, StoreError>;

    /// Records an apply failure (failures + 1, lease cleared, parked for `retry_after`).
    async fn record_failure(
        &self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
        retry_after: Duration,
    ) -> Result<bool, StoreError>;

    /// Keeps `error` as the row's last error without charging it.
    async fn note_error(
        &self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
    ) -> Result<bool, StoreError>;

    /// Whether this store has dead letters. Without (the memory store), the DLQ pre-filter is
    /// a pass-through and a permanent failure is recorded as a failure: the row stays and is
    /// retried, as seed 000 says of in-memory hosts.
    fn has_dead_letters(&self) -> bool;

    /// Moves a leased row to the dead letters (atomic, idempotent).
    async fn move_to_dead_letters(
        &self,
        instance: InstanceId,
        id: Uuid,
        reason: &str,
        error: &str,
    ) -> Result<MoveOutcome, StoreError>;

    /// Moves many leased rows with one reason, all or nothing; the (row, dead letter) pairs of
    /// the rows moved.
    async fn move_many_to_dead_letters(
        &self,
        instance: InstanceId,
        moves: &[(Uuid, String)],
        reason: &str,
    ) -> Result<Vec<(Uuid, Uuid)>, StoreError>;

    /// Begins a batch transaction whose statements may each run `statement_timeout` at most.
    async fn begin_batch(&self, statement_timeout: Duration) -> Result<Self::Tx, StoreError>;

    /// Cancels what the server process `backend` of a batch transaction is running.
    async fn cancel_backend(&self, backend: i32) -> Result<bool, StoreError>;

    /// Whether the store answers (a cheap round trip).
    async fn ping(&self) -> Result<(), StoreError>;
}

/// One batch transaction: its changes commit together, or none does (rolled back on drop).
#[async_trait]
pub trait WorkTx: Send {
    /// The database connection a perspective's statements run on, when there is one.
    fn connection(&mut self) -> Option<&mut PgConnection>;

    /// The server process running the transaction, when there is one (cancelled on shutdown).
    fn backend(&self) -> Option<i32>;

    /// Whether this is a database transaction: perspectives' statements run in it (and roll back
    /// with it), and [`WorkTx::apply_statements_and_complete`] can run SQL statements.
    fn has_database(&self) -> bool;

    /// Opens a savepoint (one at a time).
    async fn savepoint(&mut self) -> Result<(), StoreError>;

    /// Keeps what was done since the savepoint.
    async fn release_savepoint(&mut self) -> Result<(), StoreError>;

    /// Undoes what was done since the savepoint.
    async fn rollback_to_savepoint(&mut self) -> Result<(), StoreError>;

    /// Completes (deletes) rows; how many were still ours.
    async fn complete(&mut self, instance: InstanceId, ids: &[Uuid]) -> Result<u64, StoreError>;

    /// Runs a batch of SQL statements, then completes `ids`; how many were still ours.
    async fn apply_statements_and_complete(
        &mut self,
        batch: &StatementBatch<'_>,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError>;

    /// Records an apply failure in the transaction.
    async fn record_failure(
        &mut self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
        retry_after: Duration,
    ) -> Result<bool, StoreError>;

    /// Gives back unstarted rows (refunded) in the transaction.
    async fn release_unstarted(
        &mut self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError>;

    /// Gives back started rows (not refunded) in the transaction.
    async fn release_started(
        &mut self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError>;

    /// Moves a row to the dead letters in the transaction.
    async fn move_to_dead_letters(
        &mut self,
        instance: InstanceId,
        id: Uuid,
        reason: &str,
        error: &str,
    ) -> Result<MoveOutcome, StoreError>;

    /// Commits.
    async fn commit(self) -> Result<(), StoreError>;
}

#[async_trait]
impl WorkStore for Store {
    type Tx = PgWorkTx;

    async fn claim_work(
        &self,
        instance: InstanceId,
        lease: Duration,
        max_lanes: u32,
        max_rows: u32,
        perspectives: &[String],
    ) -> Result<Vec<WorkRow>, StoreError> {
        self.claim_work_reading(instance, lease, max_lanes, max_rows, perspectives, true)
            .await
    }

    async fn claim_work_reading(
        &self,
        instance: InstanceId,
        lease: Duration,
        max_lanes: u32,
        max_rows: u32,
        perspectives: &[String],
        data: bool,
    ) -> Result<Vec<WorkRow>, StoreError> {
        Store::claim_work(
            self,
            instance,
            lease,
            max_lanes,
            max_rows,
            Some(perspectives),
            data,
        )
        .await
    }

    async fn release_unstarted(
        &self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        leases::release_unstarted(self.pool(), instance, ids).await
    }

    async fn release_started(&self, instance: InstanceId, ids: &[Uuid]) -> Result<u64, StoreError> {
        leases::release_started(self.pool(), instance, ids).await
    }

    async fn record_failure(
        &self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
        retry_after: Duration,
    ) -> Result<bool, StoreError> {
        leases::record_failure(self.pool(), instance, id, error, retry_after).await
    }

    async fn note_error(
        &self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
    ) -> Result<bool, StoreError> {
        leases::note_error(self.pool(), instance, id, error).await
    }

    fn has_dead_letters(&self) -> bool {
        true
    }

    async fn move_to_dead_letters(
        &self,
        instance: InstanceId,
        id: Uuid,
        reason: &str,
        error: &str,
    ) -> Result<MoveOutcome, StoreError> {
        leases::move_to_dead_letters(self.pool(), instance, id, reason, error).await
    }

    async fn move_many_to_dead_letters(
        &self,
        instance: InstanceId,
        moves: &[(Uuid, String)],
        reason: &str,
    ) -> Result<Vec<(Uuid, Uuid)>, StoreError> {
        leases::move_many_to_dead_letters(self.pool(), instance, moves, reason).await
    }

    async fn begin_batch(&self, statement_timeout: Duration) -> Result<PgWorkTx, StoreError> {
        let (tx, pid) = leases::begin_batch(self.pool(), statement_timeout).await?;
        Ok(PgWorkTx { tx, pid })
    }

    async fn cancel_backend(&self, backend: i32) -> Result<bool, StoreError> {
        leases::cancel_backend(self.pool(), backend).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Store::ping(self).await
    }
}

/// A batch transaction on PostgreSQL.
#[derive(Debug)]
pub struct PgWorkTx {
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
    pid: i32,
}

// Savepoints by name, not sqlx's nested transactions: the transaction stays one value that the
// pipeline owns, whatever depth it is at. One at a time, so one name.
const SAVEPOINT: &str = "SAVEPOINT vantage_event";
const RELEASE_SAVEPOINT: &str = "RELEASE SAVEPOINT vantage_event";
const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT vantage_event";

impl PgWorkTx {
    async fn run(&mut self, statement: &'static str) -> Result<(), StoreError> {
        sqlx::query(statement)
            .execute(&mut *self.tx)
            .await
            .map_err(StoreError::Database)?;
        Ok(())
    }
}

#[async_trait]
impl WorkTx for PgWorkTx {
    fn connection(&mut self) -> Option<&mut PgConnection> {
        Some(&mut self.tx)
    }

    fn backend(&self) -> Option<i32> {
        Some(self.pid)
    }

    fn has_database(&self) -> bool {
        true
    }

    async fn savepoint(&mut self) -> Result<(), StoreError> {
        self.run(SAVEPOINT).await
    }

    async fn release_savepoint(&mut self) -> Result<(), StoreError> {
        self.run(RELEASE_SAVEPOINT).await
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), StoreError> {
        self.run(ROLLBACK_TO_SAVEPOINT).await
    }

    async fn complete(&mut self, instance: InstanceId, ids: &[Uuid]) -> Result<u64, StoreError> {
        leases::complete(&mut *self.tx, instance, ids).await
    }

    async fn apply_statements_and_complete(
        &mut self,
        batch: &StatementBatch<'_>,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        leases::apply_statements_and_complete(&mut self.tx, batch, instance, ids).await
    }

    async fn record_failure(
        &mut self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
        retry_after: Duration,
    ) -> Result<bool, StoreError> {
        leases::record_failure(&mut *self.tx, instance, id, error, retry_after).await
    }

    async fn release_unstarted(
        &mut self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        leases::release_unstarted(&mut *self.tx, instance, ids).await
    }

    async fn release_started(
        &mut self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        leases::release_started(&mut *self.tx, instance, ids).await
    }

    async fn move_to_dead_letters(
        &mut self,
        instance: InstanceId,
        id: Uuid,
        reason: &str,
        error: &str,
    ) -> Result<MoveOutcome, StoreError> {
        leases::move_to_dead_letters(&mut *self.tx, instance, id, reason, error).await
    }

    async fn commit(self) -> Result<(), StoreError> {
        self.tx.commit().await.map_err(StoreError::Database)
    }
}
