//! The storage seam of the drain pipeline: what the pipeline (claim → DLQ filter → envelope →
//! cooldown → apply → complete) needs from a store, as two traits, [`WorkStore`] and its batch
//! transaction [`WorkTx`]. Two stores implement them: [`Store`] (PostgreSQL, the daemon's) and
//! [`MemoryStore`](super::MemoryStore) (in-process, for unit tests of perspectives). The
//! pipeline code is the same over both; only what the store itself does differs.
//!
//! Every change is fenced on the lease holder: a row no longer leased to `instance` is left
//! alone, and the call says how many rows it changed.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, Postgres};
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

    /// Every row leased to `instance` now: after a claim whose answer may have been lost, the
    /// owner compares them with what it knows it holds.
    async fn leased_to(&self, instance: InstanceId) -> Result<Vec<Uuid>, StoreError>;

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

    /// [`begin_batch`](Self::begin_batch) for a pass that may be one call of
    /// [`WorkTx::apply_statements_and_complete`] and nothing else: the transaction begins with
    /// its first statement, and when that is the statements' call, the call runs as a
    /// transaction of its own, all or nothing, and ends the batch transaction (its commit has
    /// nothing left to do). Until a statement ran, [`WorkTx::connection`] may be `None`: a pass
    /// that calls handlers itself begins with [`begin_batch`](Self::begin_batch).
    async fn begin_batch_deferred(
        &self,
        statement_timeout: Duration,
    ) -> Result<Self::Tx, StoreError> {
        self.begin_batch(statement_timeout).await
    }

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

    async fn leased_to(&self, instance: InstanceId) -> Result<Vec<Uuid>, StoreError> {
        leases::leased_to(self.pool(), instance).await
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
        let mut tx = self.batch_tx(statement_timeout).await?;
        tx.begin().await?;
        Ok(tx)
    }

    async fn begin_batch_deferred(
        &self,
        statement_timeout: Duration,
    ) -> Result<PgWorkTx, StoreError> {
        self.batch_tx(statement_timeout).await
    }

    async fn cancel_backend(&self, backend: i32) -> Result<bool, StoreError> {
        leases::cancel_backend(self.pool(), backend).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Store::ping(self).await
    }
}

impl Store {
    /// A batch transaction not begun yet, on a batch session of this store's.
    async fn batch_tx(&self, statement_timeout: Duration) -> Result<PgWorkTx, StoreError> {
        let session = match self.batch_sessions.take(statement_timeout) {
            Some(session) => session,
            None => {
                let (conn, pid) =
                    leases::open_batch_session(self.pool(), statement_timeout).await?;
                BatchSession {
                    conn,
                    pid,
                    statement_timeout,
                }
            }
        };
        Ok(PgWorkTx {
            session: Some(session),
            sessions: Arc::clone(&self.batch_sessions),
            state: TxState::NotBegun,
            unclean: false,
        })
    }
}

/// A connection of the pool kept for batch transactions: its statement and lock timeouts were
/// set and its server process id read once, so a batch costs no round trip for either (before,
/// each batch took a connection from the pool, which sqlx pings on acquire, then set both
/// timeouts and read the pid in a statement of their own). It counts in the pool's size, so
/// `database.max_connections` still bounds the daemon's sessions.
#[derive(Debug)]
struct BatchSession {
    conn: PoolConnection<Postgres>,
    pid: i32,
    statement_timeout: Duration,
}

/// The batch sessions of a [`Store`] not in use: one per consumer loop in practice (each runs
/// one batch at a time and takes one back). A session is kept only after a batch left it clean
/// (committed, or ended by its one statement, with every statement of ours answered); otherwise
/// its transaction is rolled back first in a task of its own, or it is closed.
///
/// A kept session is a connection taken from the pool, and the pool's close waits for every
/// connection to come back: [`BatchSessions::close`] lets the kept ones go first, and a session
/// given back after it is closed, not kept.
#[derive(Default)]
pub(crate) struct BatchSessions {
    idle: Mutex<Idle>,
}

/// The kept sessions, and whether their store is closing.
#[derive(Default)]
struct Idle {
    sessions: Vec<BatchSession>,
    closed: bool,
}

impl std::fmt::Debug for BatchSessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let idle = self.idle.lock().map_or(0, |idle| idle.sessions.len());
        f.debug_struct("BatchSessions")
            .field("idle", &idle)
            .finish()
    }
}

/// Idle batch sessions kept at most (as many as consumer loops there may be).
const IDLE_SESSIONS: usize = crate::config::MAX_CONSUMERS;

/// How long a session left inside a transaction (or with a statement unanswered) may take to
/// roll back before it is closed instead.
const ROLLBACK_WAIT: Duration = Duration::from_secs(5);

impl BatchSessions {
    /// An idle session with these timeouts, if there is one.
    fn take(&self, statement_timeout: Duration) -> Option<BatchSession> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let at = idle
            .sessions
            .iter()
            .rposition(|s| s.statement_timeout == statement_timeout)?;
        Some(idle.sessions.swap_remove(at))
    }

    /// Keeps a clean session for the next batch (drops it, which closes its connection, when
    /// there are enough or the store is closing).
    fn put(&self, mut session: BatchSession) {
        // A batch's statement carries every row of the batch, and the connection's buffers keep
        // the largest size they ever grew to: a catch-up's full batches would leave each session
        // that much larger for good (a soak's resident memory stepped up after every outage).
        sqlx::Connection::shrink_buffers(&mut *session.conn);
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if !idle.closed && idle.sessions.len() < IDLE_SESSIONS {
            idle.sessions.push(session);
        }
    }

    /// Closes the kept sessions and keeps none from now on (the store is closing).
    pub(crate) fn close(&self) {
        let sessions = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            idle.closed = true;
            std::mem::take(&mut idle.sessions)
        };
        // Dropped outside the lock: each closes its connection and gives its place in the pool
        // back.
        drop(sessions);
    }
}

/// Where a batch transaction is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TxState {
    /// Nothing sent yet (a deferred begin).
    NotBegun,
    /// BEGIN sent.
    Open,
    /// Ended: by its one statement (a transaction of its own), or committed.
    Ended,
}

/// A batch transaction on PostgreSQL, on a batch session of its store.
#[derive(Debug)]
pub struct PgWorkTx {
    /// `None` once given back.
    session: Option<BatchSession>,
    sessions: Arc<BatchSessions>,
    state: TxState,
    /// A statement was sent and its answer not read yet (its future may have been dropped), or
    /// the connection failed: the session is not kept as it is.
    unclean: bool,
}

// Savepoints by name, not sqlx's nested transactions: the transaction stays one value that the
// pipeline owns, whatever depth it is at. One at a time, so one name.
const SAVEPOINT: &str = "SAVEPOINT vantage_event";
const RELEASE_SAVEPOINT: &str = "RELEASE SAVEPOINT vantage_event";
const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT vantage_event";

impl PgWorkTx {
    /// The session's connection, for one statement: unclean until [`PgWorkTx::answered`].
    fn conn(&mut self) -> Result<&mut PgConnection, StoreError> {
        match self.session.as_mut() {
            Some(session) => {
                self.unclean = true;
                Ok(&mut *session.conn)
            }
            None => Err(StoreError::Database(sqlx::Error::PoolClosed)),
        }
    }

    /// What a statement returned: the session is clean again unless its connection failed.
    fn answered<T>(&mut self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        self.unclean = matches!(&result, Err(e) if e.is_connection_error());
        result
    }

    /// Sends one fixed statement (BEGIN, COMMIT, a savepoint's) and reads its answer.
    async fn send(&mut self, statement: &'static str) -> Result<(), StoreError> {
        let result = sqlx::query(statement)
            .execute(self.conn()?)
            .await
            .map(drop)
            .map_err(StoreError::Database);
        self.answered(result)
    }

    /// Sends BEGIN.
    async fn begin(&mut self) -> Result<(), StoreError> {
        self.send("BEGIN").await?;
        self.state = TxState::Open;
        Ok(())
    }

    /// Begins the transaction if it has not begun; refuses once it has ended (nothing may run
    /// after the statement that was a transaction of its own).
    async fn open(&mut self) -> Result<(), StoreError> {
        match self.state {
            TxState::Open => Ok(()),
            TxState::NotBegun => self.begin().await,
            TxState::Ended => Err(StoreError::Unsupported(
                "a statement after its batch transaction ended".into(),
            )),
        }
    }

    async fn run(&mut self, statement: &'static str) -> Result<(), StoreError> {
        self.open().await?;
        self.send(statement).await
    }

    /// Gives the session back to its store when it is clean; otherwise rolls it back first, in
    /// a task of its own (as sqlx's pool does with a dropped transaction's connection), and
    /// closes it if that fails or takes longer than [`ROLLBACK_WAIT`].
    fn release_session(&mut self) {
        let Some(mut session) = self.session.take() else {
            return;
        };
        if !self.unclean && self.state != TxState::Open {
            self.sessions.put(session);
            return;
        }
        let sessions = Arc::clone(&self.sessions);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                // sqlx first reads whatever answer is still due, then rolls back (outside a
                // transaction, a no-op).
                let rollback = sqlx::query("ROLLBACK").execute(&mut *session.conn);
                if let Ok(Ok(_)) = tokio::time::timeout(ROLLBACK_WAIT, rollback).await {
                    sessions.put(session);
                }
            });
        }
    }
}

impl Drop for PgWorkTx {
    /// Not committed: rolled back, as a dropped sqlx transaction is (the session is kept once
    /// it has).
    fn drop(&mut self) {
        self.release_session();
    }
}

#[async_trait]
impl WorkTx for PgWorkTx {
    fn connection(&mut self) -> Option<&mut PgConnection> {
        // (a handler's statement is answered before the pass goes on, or the pass gives the
        // transaction up; a deferred transaction that has not begun has none to offer)
        match self.state {
            TxState::Open => self.session.as_mut().map(|s| &mut *s.conn),
            TxState::NotBegun | TxState::Ended => None,
        }
    }

    fn backend(&self) -> Option<i32> {
        self.session.as_ref().map(|s| s.pid)
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
        self.open().await?;
        let result = leases::complete(self.conn()?, instance, ids).await;
        self.answered(result)
    }

    async fn apply_statements_and_complete(
        &mut self,
        batch: &StatementBatch<'_>,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        if self.state == TxState::NotBegun {
            // The pass's only statement: a transaction of its own, all or nothing.
            self.state = TxState::Ended;
            let result =
                leases::apply_statements_and_complete_alone(self.conn()?, batch, instance, ids)
                    .await;
            let all_ours = self.answered(result)?;
            return Ok(if all_ours { ids.len() as u64 } else { 0 });
        }
        self.open().await?;
        let result =
            leases::apply_statements_and_complete(self.conn()?, batch, instance, ids).await;
        self.answered(result)
    }

    async fn record_failure(
        &mut self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
        retry_after: Duration,
    ) -> Result<bool, StoreError> {
        self.open().await?;
        let result = leases::record_failure(self.conn()?, instance, id, error, retry_after).await;
        self.answered(result)
    }

    async fn release_unstarted(
        &mut self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        self.open().await?;
        let result = leases::release_unstarted(self.conn()?, instance, ids).await;
        self.answered(result)
    }

    async fn release_started(
        &mut self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        self.open().await?;
        let result = leases::release_started(self.conn()?, instance, ids).await;
        self.answered(result)
    }

    async fn move_to_dead_letters(
        &mut self,
        instance: InstanceId,
        id: Uuid,
        reason: &str,
        error: &str,
    ) -> Result<MoveOutcome, StoreError> {
        self.open().await?;
        let result = leases::move_to_dead_letters(self.conn()?, instance, id, reason, error).await;
        self.answered(result)
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        if self.state == TxState::Open {
            self.send("COMMIT").await?;
        }
        // (a transaction that never began has nothing to commit; one that ended with its
        // statement committed then)
        self.state = TxState::Ended;
        self.release_session();
        Ok(())
    }
}
