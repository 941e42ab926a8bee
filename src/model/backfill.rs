//! A model of a new version's backfill and the drain that follows it, checked exhaustively by
//! [stateright] in `cargo test` (docs/versions.md, "Backfill").
//!
//! History: two streams of two events each, interleaved by position, and one event appended
//! after the registration (its work row written by the fan-out, `wh_event_store_fan_out`). Any
//! one event may be poison (its statement always fails). The backfill
//! (`backfill_perspective_version`) takes batches of one or two events in position order and
//! either applies them directly (a batch holding a poison event fails and changes nothing) or
//! diverts them to the work table (`p_divert`: what the daemon does after a failed batch; the
//! model lets it happen to any batch, as a timeout can). When the history is done the version
//! is ready, and the drain takes each lane's head (`claim_perspective_events`' head-of-line
//! gate), applying it, or dead-lettering a poison one after its retries.
//!
//! Properties: each stream's events are applied in stream order and at most once; a poison
//! event is never applied; when nothing is left to do, every healthy event is applied and the
//! poison one dead-lettered; and something can always make progress until then. [`BackfillBug`]
//! re-introduces the mistake the divert rule guards against.

#[cfg(test)]
mod tests;

use stateright::{Model, Property};

/// An event: (stream, version in its stream).
pub type Event = (u8, u8);

/// The history in position order, then the event appended after the registration.
const HISTORY: [Event; 4] = [(0, 1), (1, 1), (0, 2), (1, 2)];
const APPENDED: Event = (0, 3);

/// A mistake the model can be told to make (the real backfill makes neither).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackfillBug {
    /// A later event of a stream with a diverted event is applied directly, ahead of it (the
    /// `EXISTS … stream_version <` clause of the divert left out).
    DirectBehindDiverted,
    /// A failed batch is skipped instead of diverted (its events are lost).
    SkipFailedBatch,
}

/// The backfill and drain of one version.
#[derive(Clone, Debug)]
pub struct Backfill {
    /// The mistake to make, if any.
    pub bug: Option<BackfillBug>,
}

/// What the version has, at one moment.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// The poison event of this run, if any.
    poison: Option<Event>,
    /// History events the backfill has looked at (`backfill_position`).
    position: usize,
    /// Work rows of the version.
    rows: Vec<Event>,
    /// The version's read model: events applied, in commit order.
    applied: Vec<Event>,
    /// Dead letters of the version.
    dead: Vec<Event>,
}

/// One step.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// A batch of this many events, applied directly where the rule allows.
    Apply(usize),
    /// A batch of this many events, diverted to the work table.
    Divert(usize),
    /// The drain takes the head of this stream's lane (the version is ready).
    Drain(u8),
}

impl State {
    fn ready(&self) -> bool {
        self.position == HISTORY.len()
    }

    fn head(&self, stream: u8) -> Option<Event> {
        self.rows
            .iter()
            .filter(|e| e.0 == stream)
            .min_by_key(|e| e.1)
            .copied()
    }
}

impl Model for Backfill {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let poisons = std::iter::once(None).chain(HISTORY.iter().copied().map(Some));
        poisons
            .map(|poison| State {
                poison,
                position: 0,
                rows: vec![APPENDED],
                applied: Vec::new(),
                dead: Vec::new(),
            })
            .collect()
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        if !state.ready() {
            for size in 1..=2 {
                if state.position + size <= HISTORY.len() {
                    actions.push(Action::Apply(size));
                    actions.push(Action::Divert(size));
                }
            }
            return;
        }
        for stream in 0..2 {
            if state.head(stream).is_some() {
                actions.push(Action::Drain(stream));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Apply(size) => {
                let batch = &HISTORY[s.position..s.position + size];
                // Events behind a work row of their stream go to the work table, in order.
                let mut direct = Vec::new();
                for &e in batch {
                    let behind = s.rows.iter().any(|w| w.0 == e.0 && w.1 < e.1);
                    if behind && self.bug != Some(BackfillBug::DirectBehindDiverted) {
                        s.rows.push(e);
                    } else {
                        direct.push(e);
                    }
                }
                if direct.iter().any(|e| Some(*e) == s.poison) {
                    // The statement fails: the transaction rolls back, nothing moved.
                    if self.bug != Some(BackfillBug::SkipFailedBatch) {
                        return None;
                    }
                    s = last.clone();
                } else {
                    s.applied.extend(direct);
                }
                s.position += size;
            }
            Action::Divert(size) => {
                s.rows
                    .extend_from_slice(&HISTORY[s.position..s.position + size]);
                s.position += size;
            }
            Action::Drain(stream) => {
                let head = s.head(stream)?;
                s.rows.retain(|e| *e != head);
                if Some(head) == s.poison {
                    s.dead.push(head);
                } else {
                    s.applied.push(head);
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("applied in stream order", |_, s: &State| {
                (0..2).all(|stream| {
                    let versions: Vec<u8> = s
                        .applied
                        .iter()
                        .filter(|e| e.0 == stream)
                        .map(|e| e.1)
                        .collect();
                    versions.windows(2).all(|w| w[0] < w[1])
                })
            }),
            Property::always("applied at most once", |_, s: &State| {
                let mut seen = s.applied.clone();
                seen.sort_unstable();
                seen.windows(2).all(|w| w[0] != w[1])
            }),
            Property::always("a poison event is never applied", |_, s: &State| {
                !s.poison.is_some_and(|p| s.applied.contains(&p))
            }),
            Property::always("done means every event accounted for", |_, s: &State| {
                if !s.ready() || !s.rows.is_empty() {
                    return true;
                }
                let everything = HISTORY.iter().chain(std::iter::once(&APPENDED));
                everything.clone().all(|e| {
                    let applied = s.applied.iter().filter(|a| *a == e).count();
                    let dead = s.dead.iter().filter(|d| *d == e).count();
                    if Some(*e) == s.poison {
                        applied == 0 && dead == 1
                    } else {
                        applied == 1 && dead == 0
                    }
                })
            }),
            Property::always("nothing stranded", |m: &Backfill, s: &State| {
                let mut actions = Vec::new();
                m.actions(s, &mut actions);
                (s.ready() && s.rows.is_empty())
                    || actions.iter().any(|a| m.next_state(s, a.clone()).is_some())
            }),
            Property::sometimes(
                "a poison run ends with its history applied",
                |_, s: &State| {
                    s.applied.iter().any(|e| HISTORY.contains(e))
                        && s.dead.len() == 1
                        && s.rows.is_empty()
                        && s.ready()
                },
            ),
        ]
    }
}
