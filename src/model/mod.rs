//! A model of the claim/lease protocol, checked exhaustively by [stateright] in `cargo test`.
//!
//! One lane (one stream, one perspective) of a few events, two daemon instances, and every
//! interleaving of what can happen to them: claims, slow applies whose lease lapses, a crash,
//! failures with a backoff, the DLQ pre-filter, the give-back of rows another loop's lane holds,
//! a pass that dies with its session at its COMMIT (its rows given back, refunded within budget),
//! a claim that commits while its answer is lost (its rows given back by their owner's sweep).
//! Each action stands for SQL the baseline migrations define (named at the action), reduced to
//! what decides ownership and order; time is abstract (a lease lapses, a backoff ends, whenever).
//!
//! The properties are the guarantees vantage makes: at most one instance works on a lane under a
//! valid lease; every event is applied at most once and in stream order; `attempts` counts the
//! claims that changed a row's holder, minus the refunds of claims no handler saw; a row is
//! dead-lettered only after `max + 1` claims; nothing is stranded (while rows remain, some action
//! that makes progress is enabled). [`Bug`] re-introduces, one at a time, bugs that queues like
//! ours really had, and the tests show the checker finds each of them.

pub mod backfill;
#[cfg(test)]
mod tests;

use stateright::{Model, Property};

/// Events in the lane (versions 1..=EVENTS).
const EVENTS: u8 = 3;
/// How many times, in one run, a lease may lapse under its holder (a stall), and a process may
/// crash: bounded, so that the state space is finite (every other action makes progress).
const LAPSES: u8 = 2;
const CRASHES: u8 = 1;
/// How many passes may die with their session at a step of their own (their COMMIT).
const CUTS: u8 = 2;
/// How many claims may commit with their answer lost (the session cut after the commit).
const LOST_ANSWERS: u8 = 1;
/// `worker.max_perspective_event_attempts` in the model: claimed more than this, dead-lettered.
const MAX_ATTEMPTS: u8 = 2;
/// Instances. Instance 0 never crashes (someone must be left to drain the lane).
const INSTANCES: usize = 2;

/// A bug the model can be told to have (the real protocol has none of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bug {
    /// A claim takes a row validly leased to a live instance (a takeover that ignores a live
    /// owner's lease).
    TakeoverOfLiveOwner,
    /// A claim takes the first unleased row of the lane instead of stopping at a head it cannot
    /// take (the head-of-line gate ignored; `SKIP LOCKED` on rows instead of on lanes).
    FirstUnleasedRowInsteadOfHead,
    /// The batch's completion is not fenced on the holder: a slow owner whose lease lapsed
    /// and was taken over still applies and completes (lost updates, a double apply).
    UnfencedCompletion,
    /// A claim whose answer was lost is left to its lease: the rows stay validly leased to a
    /// live instance that does not know it holds them, and no claim may take them (the
    /// 60-minute soak's 60 s stalls under terminated sessions, before
    /// `InFlight::settle_lost_claims`).
    LostClaimLeftToLapse,
}

/// The lane, the instances and the ghost variables the properties read.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// Work rows of the lane (`wh_perspective_events`), in stream_version order.
    rows: Vec<Row>,
    /// The read model: versions whose effects committed, in commit order.
    applied: Vec<u8>,
    /// Dead letters: (version, attempts when moved).
    dead: Vec<(u8, u8)>,
    instances: [Instance; INSTANCES],
    /// Stalls and crashes still allowed in this run.
    lapses_left: u8,
    crashes_left: u8,
    cuts_left: u8,
    lost_answers_left: u8,
    /// Ghost: per version (index v - 1), the attempts the protocol says the row should have:
    /// + 1 for each claim that changed its holder, - 1 for each refund of such a claim.
    charged: [u8; EVENTS as usize],
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Row {
    version: u8,
    attempts: u8,
    failures: u8,
    /// `instance_id`.
    holder: Option<u8>,
    /// The holder's lease has lapsed (`lease_expiry` in the past).
    lapsed: bool,
    /// Parked by a failure until its backoff ends (`scheduled_for` in the future).
    parked: bool,
    /// The claim that leased it bumped `attempts` (a refund is owed if no handler sees it).
    bumped: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Instance {
    alive: bool,
    /// The versions its current batch holds, as its lease handle believes.
    batch: Vec<u8>,
    /// The batch's lane is reserved by another loop of the same process: its rows are to be
    /// given back unworked (`give_back` of the lease handle).
    lane_taken: bool,
    /// Ghost: the lease handle's lease has not lapsed since its claim.
    lease_valid: bool,
    /// Per version, how often this process gave the row back refunded after a cut pass
    /// (`InFlight::forgive_started`: at most MAX_ATTEMPTS times).
    forgiven: [u8; EVENTS as usize],
    /// A claim of this process failed, and its answer may have been lost (`InFlight::claim_lost`).
    claim_lost: bool,
}

/// What can happen.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// `get_stream_events`: instance leases the claimable prefix of the lane. `lane_taken`:
    /// another loop of the same process holds the lane (so the rows go back unworked).
    Claim { instance: u8, lane_taken: bool },
    /// The same claim commits, but its session is cut before the answer arrives: the rows are
    /// leased to the instance, which records nothing and knows only that a claim failed.
    ClaimAnswerLost { instance: u8 },
    /// Before its next claim, the instance gives back, refunded, the rows leased to it that no
    /// batch of it holds (`InFlight::settle_lost_claims`: `leased_to`, then
    /// `release_unstarted_leases`).
    SweepLostClaims { instance: u8 },
    /// The lease handle gives back the rows of a lane another loop holds
    /// (`release_unstarted_leases`, a refund when the claim bumped).
    GiveBack { instance: u8 },
    /// The DLQ pre-filter moves the batch's rows claimed more than max times
    /// (`move_many_to_dead_letters`, fenced on the holder).
    DeadLetter { instance: u8 },
    /// The batch's transaction: apply every event in order and complete it
    /// (`apply_and_complete_perspective_events`), or fail at `fail_at` (the careful pass:
    /// `record_perspective_event_failure` and `release_started_leases` for the rest). Fenced: if
    /// a row is no longer ours the transaction rolls back and the rest is given back.
    Settle { instance: u8, fail_at: Option<u8> },
    /// The batch's transaction dies with its session at its COMMIT (terminated, the server
    /// restarted): rolled back, nothing applied; the rows still ours go back, those the
    /// process has not forgiven MAX_ATTEMPTS times yet with a refund
    /// (`release_unstarted_leases`), the rest without (`release_started_leases`).
    Cut { instance: u8 },
    /// The holder's lease lapses (a slow apply, a stalled process; renewal lost).
    Lapse { instance: u8 },
    /// The process dies (`cleanup_dead_instances` makes its leases claimable).
    Crash { instance: u8 },
    /// A parked row's backoff ends.
    Due { version: u8 },
}

/// The protocol, with at most one [`Bug`].
#[derive(Clone, Debug)]
pub struct Protocol {
    /// The bug re-introduced, if any.
    pub bug: Option<Bug>,
}

impl Protocol {
    fn claimable(&self, row: &Row, instance: u8, state: &State) -> bool {
        if row.parked {
            return false;
        }
        match row.holder {
            None => true,
            Some(h) if h == instance => row.lapsed,
            Some(h) => {
                row.lapsed
                    || !state.instances[h as usize].alive
                    || self.bug == Some(Bug::TakeoverOfLiveOwner)
            }
        }
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            rows: (1..=EVENTS)
                .map(|version| Row {
                    version,
                    attempts: 0,
                    failures: 0,
                    holder: None,
                    lapsed: false,
                    parked: false,
                    bumped: false,
                })
                .collect(),
            applied: Vec::new(),
            dead: Vec::new(),
            instances: std::array::from_fn(|_| Instance {
                alive: true,
                batch: Vec::new(),
                lane_taken: false,
                lease_valid: false,
                forgiven: [0; EVENTS as usize],
                claim_lost: false,
            }),
            lapses_left: LAPSES,
            crashes_left: CRASHES,
            cuts_left: CUTS,
            lost_answers_left: LOST_ANSWERS,
            charged: [0; EVENTS as usize],
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        for i in 0..INSTANCES as u8 {
            let inst = &state.instances[i as usize];
            if !inst.alive {
                continue;
            }
            if inst.batch.is_empty() {
                // The sweep runs first, in the same pass as the next claim.
                if inst.claim_lost && self.bug != Some(Bug::LostClaimLeftToLapse) {
                    actions.push(Action::SweepLostClaims { instance: i });
                    continue;
                }
                if state.rows.iter().any(|r| self.claimable(r, i, state)) {
                    if state.lost_answers_left > 0 {
                        actions.push(Action::ClaimAnswerLost { instance: i });
                    }
                    actions.push(Action::Claim {
                        instance: i,
                        lane_taken: false,
                    });
                    actions.push(Action::Claim {
                        instance: i,
                        lane_taken: true,
                    });
                }
                continue;
            }
            if inst.lane_taken {
                actions.push(Action::GiveBack { instance: i });
                continue;
            }
            // The DLQ pre-filter runs before anything of the batch is applied.
            let doomed = state.rows.iter().any(|r| {
                inst.batch.contains(&r.version) && r.holder == Some(i) && r.attempts > MAX_ATTEMPTS
            });
            if doomed {
                actions.push(Action::DeadLetter { instance: i });
            } else {
                actions.push(Action::Settle {
                    instance: i,
                    fail_at: None,
                });
                for k in 0..inst.batch.len() as u8 {
                    actions.push(Action::Settle {
                        instance: i,
                        fail_at: Some(k),
                    });
                }
                if state.cuts_left > 0 {
                    actions.push(Action::Cut { instance: i });
                }
            }
            if state.lapses_left > 0 && state.rows.iter().any(|r| r.holder == Some(i) && !r.lapsed)
            {
                actions.push(Action::Lapse { instance: i });
            }
            if i != 0 && state.crashes_left > 0 {
                actions.push(Action::Crash { instance: i });
            }
        }
        for r in &state.rows {
            if r.parked {
                actions.push(Action::Due { version: r.version });
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        let claim = match action {
            Action::ClaimAnswerLost { instance } => {
                s.lost_answers_left -= 1;
                s.instances[instance as usize].claim_lost = true;
                Some((instance, false, false))
            }
            Action::Claim {
                instance,
                lane_taken,
            } => Some((instance, lane_taken, true)),
            _ => None,
        };
        match action {
            Action::Claim { .. } | Action::ClaimAnswerLost { .. } => {
                let (instance, lane_taken, answered) = claim?;
                // The claimable prefix: from the head, while rows can be taken; the gate stops
                // at the first row that cannot (bug: skip it and take the next). A head that
                // failed before comes alone (get_stream_events, migration 0025).
                let mut taken = Vec::new();
                for idx in 0..s.rows.len() {
                    if self.claimable(&s.rows[idx], instance, last) {
                        let row = &mut s.rows[idx];
                        let changed = row.holder != Some(instance);
                        if changed {
                            row.attempts = row.attempts.saturating_add(1);
                            s.charged[row.version as usize - 1] =
                                s.charged[row.version as usize - 1].saturating_add(1);
                        }
                        row.bumped = changed;
                        row.holder = Some(instance);
                        row.lapsed = false;
                        taken.push(row.version);
                        if idx == 0 && row.failures > 0 {
                            break;
                        }
                    } else if self.bug != Some(Bug::FirstUnleasedRowInsteadOfHead) {
                        break;
                    }
                }
                if taken.is_empty() {
                    return None;
                }
                if answered {
                    let inst = &mut s.instances[instance as usize];
                    inst.batch = taken;
                    inst.lane_taken = lane_taken;
                    inst.lease_valid = true;
                }
            }
            Action::SweepLostClaims { instance } => {
                let inst = &mut s.instances[instance as usize];
                inst.claim_lost = false;
                let held = inst.batch.clone();
                // Fenced on the holder; no handler saw these rows, so a bump is refunded.
                for row in s.rows.iter_mut() {
                    if row.holder == Some(instance) && !held.contains(&row.version) {
                        if row.bumped {
                            row.attempts -= 1;
                            s.charged[row.version as usize - 1] -= 1;
                        }
                        row.holder = None;
                        row.lapsed = false;
                        row.bumped = false;
                    }
                }
            }
            Action::GiveBack { instance } => {
                let batch = std::mem::take(&mut s.instances[instance as usize].batch);
                for v in batch {
                    if let Some(row) = s
                        .rows
                        .iter_mut()
                        .find(|r| r.version == v && r.holder == Some(instance))
                    {
                        if row.bumped {
                            row.attempts -= 1;
                            s.charged[v as usize - 1] -= 1;
                        }
                        row.holder = None;
                        row.lapsed = false;
                        row.bumped = false;
                    }
                }
            }
            Action::DeadLetter { instance } => {
                let batch = &s.instances[instance as usize].batch;
                let doomed: Vec<u8> = s
                    .rows
                    .iter()
                    .filter(|r| {
                        batch.contains(&r.version)
                            && r.holder == Some(instance)
                            && r.attempts > MAX_ATTEMPTS
                    })
                    .map(|r| r.version)
                    .collect();
                if doomed.is_empty() {
                    return None;
                }
                for v in &doomed {
                    let idx = s.rows.iter().position(|r| r.version == *v)?;
                    let row = s.rows.remove(idx);
                    s.dead.push((row.version, row.attempts));
                }
                s.instances[instance as usize]
                    .batch
                    .retain(|v| !doomed.contains(v));
                if s.instances[instance as usize].batch.is_empty() {
                    return Some(s);
                }
            }
            Action::Settle { instance, fail_at } => {
                let batch = std::mem::take(&mut s.instances[instance as usize].batch);
                let ours = |s: &State, v: u8| {
                    s.rows
                        .iter()
                        .any(|r| r.version == v && r.holder == Some(instance))
                };
                let fenced = self.bug != Some(Bug::UnfencedCompletion);
                if fenced && !batch.iter().all(|&v| ours(&s, v)) {
                    // A lost lease: the transaction rolls back; what is still ours goes back
                    // (started: no refund).
                    for row in s.rows.iter_mut() {
                        if row.holder == Some(instance) && batch.contains(&row.version) {
                            row.holder = None;
                            row.lapsed = false;
                            row.bumped = false;
                        }
                    }
                    return Some(s);
                }
                for (k, v) in batch.iter().enumerate() {
                    if !s.rows.iter().any(|r| r.version == *v) {
                        // (only with the bug: completed by its new owner already)
                        s.applied.push(*v);
                        continue;
                    }
                    if fail_at == Some(k as u8) {
                        let row = s.rows.iter_mut().find(|r| r.version == *v)?;
                        row.failures += 1;
                        row.holder = None;
                        row.lapsed = false;
                        row.bumped = false;
                        row.parked = true;
                        for behind in &batch[k + 1..] {
                            let row = s.rows.iter_mut().find(|r| r.version == *behind)?;
                            row.holder = None;
                            row.lapsed = false;
                            row.bumped = false;
                        }
                        break;
                    }
                    s.applied.push(*v);
                    s.rows.retain(|r| r.version != *v);
                }
            }
            Action::Cut { instance } => {
                s.cuts_left -= 1;
                let batch = std::mem::take(&mut s.instances[instance as usize].batch);
                for v in batch {
                    let idx = v as usize - 1;
                    // (the process counts what it forgives before the fenced give-back runs)
                    let forgive = s.instances[instance as usize].forgiven[idx] < MAX_ATTEMPTS;
                    if forgive {
                        s.instances[instance as usize].forgiven[idx] += 1;
                    }
                    // Fenced on the holder: a row taken over meanwhile is not touched.
                    let Some(row) = s
                        .rows
                        .iter_mut()
                        .find(|r| r.version == v && r.holder == Some(instance))
                    else {
                        continue;
                    };
                    if forgive && row.bumped {
                        row.attempts -= 1;
                        s.charged[idx] -= 1;
                    }
                    row.holder = None;
                    row.lapsed = false;
                    row.bumped = false;
                }
            }
            Action::Lapse { instance } => {
                s.lapses_left -= 1;
                s.instances[instance as usize].lease_valid = false;
                for row in s.rows.iter_mut() {
                    if row.holder == Some(instance) {
                        row.lapsed = true;
                    }
                }
            }
            Action::Crash { instance } => {
                s.crashes_left -= 1;
                let inst = &mut s.instances[instance as usize];
                inst.alive = false;
                inst.batch.clear();
            }
            Action::Due { version } => {
                s.rows.iter_mut().find(|r| r.version == version)?.parked = false;
            }
        }
        Some(s)
    }

    /// Runs whose claims keep taking a row from its live owner (only a bug does that) end
    /// here: past max + 3 attempts nothing new can be learnt.
    fn within_boundary(&self, state: &State) -> bool {
        state.rows.iter().all(|r| r.attempts <= MAX_ATTEMPTS + 3)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("one live holder per lane", |_, s: &State| {
                // Lease handles that believe they hold the lane under a lease that has not
                // lapsed.
                s.instances
                    .iter()
                    .filter(|inst| inst.alive && !inst.batch.is_empty() && inst.lease_valid)
                    .count()
                    <= 1
            }),
            Property::always("applied at most once", |_, s: &State| {
                let mut seen = s.applied.clone();
                seen.sort_unstable();
                seen.windows(2).all(|w| w[0] != w[1])
            }),
            Property::always("applied in stream order", |_, s: &State| {
                s.applied.windows(2).all(|w| w[0] < w[1])
            }),
            Property::always(
                "attempts count the claims that changed the holder",
                |_, s: &State| {
                    s.rows
                        .iter()
                        .all(|r| r.attempts == s.charged[r.version as usize - 1])
                },
            ),
            // (more than max + 1 when a holder died between its claim and its pre-filter: the
            // next claim is one more)
            Property::always("dead-lettered only after max + 1 claims", |_, s: &State| {
                s.dead.iter().all(|(_, attempts)| *attempts > MAX_ATTEMPTS)
            }),
            Property::always("nothing stranded", |m: &Protocol, s: &State| {
                let mut actions = Vec::new();
                m.actions(s, &mut actions);
                s.rows.is_empty()
                    || actions.iter().any(|a| {
                        matches!(
                            a,
                            Action::Claim { .. }
                                | Action::SweepLostClaims { .. }
                                | Action::DeadLetter { .. }
                                | Action::Settle { .. }
                                | Action::GiveBack { .. }
                                | Action::Due { .. }
                        )
                    })
            }),
            Property::sometimes("every event applied", |_, s: &State| {
                s.applied.len() == EVENTS as usize
            }),
            Property::sometimes("an event dead-lettered", |_, s: &State| !s.dead.is_empty()),
        ]
    }
}
