//! The memory store as the pipeline's [`WorkStore`], and its batch transaction.

use std::collections::HashSet;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::store::apply::StatementBatch;
use crate::store::claims::WorkRow;
use crate::store::dead_letters::MoveOutcome;
use crate::store::error::StoreError;
use crate::store::instances::InstanceId;
use crate::store::work::{WorkStore, WorkTx};

use super::state::Op;
use super::store::MemoryStore;

/// The store has no dead letters: the pipeline never asks it to move one (its DLQ filter is
/// a pass-through), so a call is a programming error, reported as such.
pub(super) fn no_dead_letters() -> StoreError {
    StoreError::Unsupported("the memory store has no dead letters".into())
}

#[async_trait]
impl WorkStore for MemoryStore {
    type Tx = MemoryTx;

    async fn claim_work(
        &self,
        instance: InstanceId,
        lease: Duration,
        max_lanes: u32,
        max_rows: u32,
        perspectives: &[String],
    ) -> Result<Vec<WorkRow>, StoreError> {
        let now = self.now();
        Ok(self
            .lock()
            .claim(instance, lease, max_lanes, max_rows, perspectives, now))
    }

    async fn release_unstarted(
        &self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        let now = self.now();
        Ok(self
            .lock()
            .apply(Op::ReleaseUnstarted(instance, ids.to_vec()), now))
    }

    async fn release_started(&self, instance: InstanceId, ids: &[Uuid]) -> Result<u64, StoreError> {
        let now = self.now();
        Ok(self
            .lock()
            .apply(Op::ReleaseStarted(instance, ids.to_vec()), now))
    }

    async fn leased_to(&self, instance: InstanceId) -> Result<Vec<Uuid>, StoreError> {
        let state = self.lock();
        Ok(state
            .rows
            .iter()
            .filter(|(_, r)| r.holder == Some(instance.0))
            .map(|(id, _)| *id)
            .collect())
    }

    async fn record_failure(
        &self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
        retry_after: Duration,
    ) -> Result<bool, StoreError> {
        let now = self.now();
        Ok(self
            .lock()
            .apply(Op::Fail(instance, id, error.to_string(), retry_after), now)
            == 1)
    }

    async fn note_error(
        &self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
    ) -> Result<bool, StoreError> {
        let mut state = self.lock();
        if !state.ours(instance, &id) {
            return Ok(false);
        }
        if let Some(r) = state.rows.get_mut(&id) {
            r.last_error = Some(error.to_string());
        }
        Ok(true)
    }

    fn has_dead_letters(&self) -> bool {
        false
    }

    async fn move_to_dead_letters(
        &self,
        _instance: InstanceId,
        _id: Uuid,
        _reason: &str,
        _error: &str,
    ) -> Result<MoveOutcome, StoreError> {
        Err(no_dead_letters())
    }

    async fn move_many_to_dead_letters(
        &self,
        _instance: InstanceId,
        _moves: &[(Uuid, String)],
        _reason: &str,
    ) -> Result<Vec<(Uuid, Uuid)>, StoreError> {
        Err(no_dead_letters())
    }

    async fn begin_batch(&self, _statement_timeout: Duration) -> Result<MemoryTx, StoreError> {
        Ok(MemoryTx {
            store: self.clone(),
            ops: Vec::new(),
            savepoint: None,
        })
    }

    async fn cancel_backend(&self, _backend: i32) -> Result<bool, StoreError> {
        Ok(false)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// A batch transaction of the memory store: its changes are staged and applied together, each
/// fenced on the lease holder again, when it commits; dropped, it changes nothing. It has no
/// database: perspectives' own effects are theirs to keep.
#[derive(Debug)]
pub struct MemoryTx {
    pub(super) store: MemoryStore,
    pub(super) ops: Vec<Op>,
    pub(super) savepoint: Option<usize>,
}

impl MemoryTx {
    /// Rows of `ids` ours now and not already changed in this transaction.
    fn still_ours(&self, instance: InstanceId, ids: &[Uuid]) -> Vec<Uuid> {
        let staged: HashSet<Uuid> = self
            .ops
            .iter()
            .flat_map(|op| match op {
                Op::Complete(_, ids)
                | Op::ReleaseUnstarted(_, ids)
                | Op::ReleaseStarted(_, ids) => ids.as_slice(),
                Op::Fail(_, id, _, _) => std::slice::from_ref(id),
            })
            .copied()
            .collect();
        let state = self.store.lock();
        let mut seen = HashSet::new();
        ids.iter()
            .copied()
            .filter(|id| !staged.contains(id) && state.ours(instance, id) && seen.insert(*id))
            .collect()
    }
}

#[async_trait]
impl WorkTx for MemoryTx {
    fn connection(&mut self) -> Option<&mut PgConnection> {
        None
    }

    fn backend(&self) -> Option<i32> {
        None
    }

    fn has_database(&self) -> bool {
        false
    }

    async fn savepoint(&mut self) -> Result<(), StoreError> {
        self.savepoint = Some(self.ops.len());
        Ok(())
    }

    async fn release_savepoint(&mut self) -> Result<(), StoreError> {
        self.savepoint = None;
        Ok(())
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), StoreError> {
        if let Some(at) = self.savepoint.take() {
            self.ops.truncate(at);
        }
        Ok(())
    }

    async fn complete(&mut self, instance: InstanceId, ids: &[Uuid]) -> Result<u64, StoreError> {
        let ours = self.still_ours(instance, ids);
        let n = ours.len() as u64;
        self.ops.push(Op::Complete(instance, ours));
        Ok(n)
    }

    async fn apply_statements_and_complete(
        &mut self,
        _batch: &StatementBatch<'_>,
        _instance: InstanceId,
        _ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        Err(StoreError::Unsupported(
            "the memory store runs no SQL statements".into(),
        ))
    }

    async fn record_failure(
        &mut self,
        instance: InstanceId,
        id: Uuid,
        error: &str,
        retry_after: Duration,
    ) -> Result<bool, StoreError> {
        if self.still_ours(instance, &[id]).is_empty() {
            return Ok(false);
        }
        self.ops
            .push(Op::Fail(instance, id, error.to_string(), retry_after));
        Ok(true)
    }

    async fn release_unstarted(
        &mut self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        let ours = self.still_ours(instance, ids);
        let n = ours.len() as u64;
        self.ops.push(Op::ReleaseUnstarted(instance, ours));
        Ok(n)
    }

    async fn release_started(
        &mut self,
        instance: InstanceId,
        ids: &[Uuid],
    ) -> Result<u64, StoreError> {
        let ours = self.still_ours(instance, ids);
        let n = ours.len() as u64;
        self.ops.push(Op::ReleaseStarted(instance, ours));
        Ok(n)
    }

    async fn move_to_dead_letters(
        &mut self,
        _instance: InstanceId,
        _id: Uuid,
        _reason: &str,
        _error: &str,
    ) -> Result<MoveOutcome, StoreError> {
        Err(no_dead_letters())
    }

    async fn commit(self) -> Result<(), StoreError> {
        self.store.commit_ops(self.ops);
        Ok(())
    }
}
