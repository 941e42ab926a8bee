//! The memory store's state and its rules: what each change does to it, as the SQL functions
//! do.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use uuid::Uuid;

use crate::store::claims::WorkRow;
use crate::store::instances::InstanceId;

/// An event in the memory store.
#[derive(Clone, Debug)]
pub(super) struct Event {
    pub(super) event_id: Uuid,
    pub(super) event_type: String,
    pub(super) data: serde_json::Value,
    pub(super) metadata: serde_json::Value,
}

#[derive(Clone, Debug)]
pub(super) struct Row {
    pub(super) perspective: String,
    pub(super) stream_id: Uuid,
    pub(super) stream_version: i32,
    pub(super) global_position: i64,
    pub(super) attempts: i32,
    pub(super) failures: i32,
    pub(super) holder: Option<Uuid>,
    pub(super) lease_expiry: Duration,
    pub(super) scheduled_for: Duration,
    pub(super) refundable: bool,
    pub(super) last_error: Option<String>,
}

#[derive(Debug, Default)]
pub(super) struct State {
    /// Index = global position - 1.
    pub(super) events: Vec<Event>,
    pub(super) versions: HashMap<Uuid, i32>,
    /// Perspective → subscribed event types (`*` = all).
    pub(super) subscriptions: BTreeMap<String, Vec<String>>,
    /// Lane (perspective, stream) → version → work row.
    pub(super) lanes: BTreeMap<(String, Uuid), BTreeMap<i32, Uuid>>,
    pub(super) rows: HashMap<Uuid, Row>,
    pub(super) instances: HashSet<Uuid>,
}

/// A change to leased rows, made at once or staged in a [`MemoryTx`].
#[derive(Clone, Debug)]
pub(super) enum Op {
    Complete(InstanceId, Vec<Uuid>),
    Fail(InstanceId, Uuid, String, Duration),
    ReleaseUnstarted(InstanceId, Vec<Uuid>),
    ReleaseStarted(InstanceId, Vec<Uuid>),
}

impl State {
    pub(super) fn ours(&self, instance: InstanceId, id: &Uuid) -> bool {
        self.rows
            .get(id)
            .is_some_and(|r| r.holder == Some(instance.0))
    }

    /// Applies one change; returns how many rows it changed.
    pub(super) fn apply(&mut self, op: Op, now: Duration) -> u64 {
        match op {
            Op::Complete(instance, ids) => {
                let mut n = 0;
                for id in ids {
                    if !self.ours(instance, &id) {
                        continue;
                    }
                    let row = self.rows.remove(&id).expect("checked above");
                    let lane = (row.perspective, row.stream_id);
                    if let Some(versions) = self.lanes.get_mut(&lane) {
                        versions.remove(&row.stream_version);
                        if versions.is_empty() {
                            self.lanes.remove(&lane);
                        }
                    }
                    n += 1;
                }
                n
            }
            Op::Fail(instance, id, error, retry_after) => {
                if !self.ours(instance, &id) {
                    return 0;
                }
                let r = self.rows.get_mut(&id).expect("checked above");
                r.failures += 1;
                r.last_error = Some(error);
                r.holder = None;
                r.refundable = false;
                r.scheduled_for = now + retry_after;
                1
            }
            Op::ReleaseUnstarted(instance, ids) => self.release(instance, &ids, true),
            Op::ReleaseStarted(instance, ids) => self.release(instance, &ids, false),
        }
    }

    /// Gives rows back; `refund` takes back exactly the bump their claim made.
    pub(super) fn release(&mut self, instance: InstanceId, ids: &[Uuid], refund: bool) -> u64 {
        let mut n = 0;
        let unique: HashSet<&Uuid> = ids.iter().collect();
        for id in unique {
            if !self.ours(instance, id) {
                continue;
            }
            let r = self.rows.get_mut(id).expect("checked above");
            if refund && r.refundable {
                r.attempts = (r.attempts - 1).max(0);
            }
            r.holder = None;
            r.refundable = false;
            n += 1;
        }
        n
    }

    /// A row a claim may take now: unleased and due, or leased by a lapsed or departed holder.
    pub(super) fn claimable(&self, row: &Row, now: Duration) -> bool {
        match row.holder {
            None => row.scheduled_for <= now,
            Some(holder) => row.lease_expiry < now || !self.instances.contains(&holder),
        }
    }

    /// The claim of `wh_claim_lanes`, in memory: lanes whose head is claimable, a fair share
    /// per perspective (oldest head first), each lane's claimable prefix, the row budget dealt
    /// round-robin over the lanes.
    pub(super) fn claim(
        &mut self,
        instance: InstanceId,
        lease: Duration,
        max_lanes: u32,
        max_rows: u32,
        perspectives: &[String],
        now: Duration,
    ) -> Vec<WorkRow> {
        if !self.instances.contains(&instance.0) || max_lanes == 0 || max_rows == 0 {
            return Vec::new();
        }
        // Due lanes per perspective, oldest head first: (head's global position, lane).
        type Lane = (String, Uuid);
        let mut due: BTreeMap<String, Vec<(i64, Lane)>> = BTreeMap::new();
        for (lane, versions) in &self.lanes {
            if !perspectives.contains(&lane.0) {
                continue;
            }
            let Some(head) = versions.values().next() else {
                continue;
            };
            let row = &self.rows[head];
            if self.claimable(row, now) {
                due.entry(lane.0.clone())
                    .or_default()
                    .push((row.global_position, lane.clone()));
            }
        }
        for lanes in due.values_mut() {
            lanes.sort();
            lanes.reverse(); // popped from the back: oldest first
        }
        // Round-robin over perspectives: each gets its share, what one leaves goes to the next.
        let mut chosen: Vec<Lane> = Vec::new();
        while chosen.len() < max_lanes as usize {
            let mut took = false;
            for lanes in due.values_mut() {
                if chosen.len() >= max_lanes as usize {
                    break;
                }
                if let Some((_, lane)) = lanes.pop() {
                    chosen.push(lane);
                    took = true;
                }
            }
            if !took {
                break;
            }
        }
        // Each chosen lane's claimable prefix.
        let prefixes: Vec<Vec<Uuid>> = chosen
            .iter()
            .map(|lane| {
                self.lanes[lane]
                    .values()
                    .take_while(|id| self.claimable(&self.rows[*id], now))
                    .copied()
                    .collect()
            })
            .collect();
        // The budget, dealt round-robin: first rows of every lane, then second rows, …
        let mut taken: Vec<Uuid> = Vec::new();
        let longest = prefixes.iter().map(Vec::len).max().unwrap_or(0);
        'deal: for rank in 0..longest {
            for prefix in &prefixes {
                if taken.len() >= max_rows as usize {
                    break 'deal;
                }
                if let Some(id) = prefix.get(rank) {
                    taken.push(*id);
                }
            }
        }
        let mut out = Vec::with_capacity(taken.len());
        for id in taken {
            let row = self.rows.get_mut(&id).expect("a lane's row exists");
            let takeover = row.holder != Some(instance.0);
            if takeover {
                row.attempts += 1;
            }
            row.refundable = takeover;
            row.holder = Some(instance.0);
            row.lease_expiry = now + lease;
            let event = &self.events[(row.global_position - 1) as usize];
            out.push(WorkRow {
                event_work_id: id,
                stream_id: row.stream_id,
                event_id: event.event_id,
                perspective_name: row.perspective.clone(),
                global_position: row.global_position,
                stream_version: row.stream_version,
                event_type: Some(event.event_type.clone()),
                event_data: Some(event.data.clone()),
                metadata: Some(event.metadata.clone()),
                attempts: row.attempts,
                failures: row.failures,
                queued_for: None,
                // (the memory store has no rebuild and no versions: every row is a first delivery)
                replay: false,
            });
        }
        out.sort_by(|a, b| {
            (a.stream_id, &a.perspective_name, a.stream_version).cmp(&(
                b.stream_id,
                &b.perspective_name,
                b.stream_version,
            ))
        });
        out
    }
}
