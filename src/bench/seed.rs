//! The seeded state of one run: events over streams, fanned out to perspectives by the
//! database's own trigger. [`apply`] empties the bench schema and seeds it again, so every run
//! (vantage, the limit, each check) starts from the same state.

use crate::config::PerspectiveSettings;
use crate::store::bench::{perspective_statement, BENCH_EVENT_TYPE, POISON_STATEMENT};

use super::{Bench, BenchConfig, BenchError};

/// A perspective of the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PerspectiveSpec {
    /// Its name, `bench_<something>`.
    pub name: String,
    /// The one event type it subscribes to.
    pub event_type: String,
    /// Its rows are parked for an hour after seeding (failed rows waiting out a backoff).
    pub parked: bool,
    /// Its rows are at the last attempt after seeding: the next claim dead-letters them.
    pub exhausted: bool,
    /// Its statement always fails (a retryable error): each row is retried until the attempt
    /// limit dead-letters it.
    pub failing: bool,
}

impl PerspectiveSpec {
    /// A healthy perspective of the usual event type.
    pub fn healthy(name: impl Into<String>) -> Self {
        PerspectiveSpec {
            name: name.into(),
            event_type: BENCH_EVENT_TYPE.into(),
            parked: false,
            exhausted: false,
            failing: false,
        }
    }

    /// The daemon's configuration of it: the trivial upsert (or, for a parked perspective, a
    /// statement that fails, in case its rows come due; for a failing one, the same).
    pub fn settings(&self) -> PerspectiveSettings {
        let statement = if self.parked || self.failing {
            POISON_STATEMENT.to_string()
        } else {
            perspective_statement(&self.name)
        };
        PerspectiveSettings {
            name: self.name.clone(),
            events: vec![self.event_type.clone()],
            sql: [(self.event_type.clone(), statement)].into(),
            reset: None,
            quarantine_after: None,
            ..Default::default()
        }
    }
}

/// Events of one type over some streams.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// Keeps the stream ids of parts apart.
    pub salt: String,
    /// Streams.
    pub streams: u64,
    /// Events per stream.
    pub per_stream: u64,
    /// Their type.
    pub event_type: String,
}

/// The whole seeded state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seed {
    /// Registered perspectives.
    pub perspectives: Vec<PerspectiveSpec>,
    /// Seeded events.
    pub parts: Vec<Part>,
    /// Padding per event payload.
    pub payload_bytes: u32,
    /// Every event's metadata carries a W3C `traceparent` of its own (the traces check).
    pub traced: bool,
}

impl Seed {
    /// N events over S streams into P healthy perspectives.
    pub fn main(config: &BenchConfig) -> Seed {
        Seed::healthy(
            config.events,
            config.streams,
            config.perspectives,
            config.payload_bytes,
        )
    }

    /// `events` events (rounded down to whole streams) over `streams` streams into
    /// `perspectives` healthy perspectives.
    pub fn healthy(events: u64, streams: u64, perspectives: u32, payload_bytes: u32) -> Seed {
        let streams = streams.clamp(1, events.max(1));
        Seed {
            perspectives: (0..perspectives.max(1))
                .map(|p| PerspectiveSpec::healthy(format!("bench_{p}")))
                .collect(),
            parts: vec![Part {
                salt: "main".into(),
                streams,
                per_stream: (events / streams).max(1),
                event_type: BENCH_EVENT_TYPE.into(),
            }],
            payload_bytes,
            traced: false,
        }
    }

    /// Work rows the daemon is expected to finish (applied or dead-lettered): every row of a
    /// perspective that is not parked.
    pub fn rows(&self) -> u64 {
        self.perspectives
            .iter()
            .filter(|p| !p.parked)
            .map(|p| self.events_of(&p.event_type))
            .sum()
    }

    /// Events seeded of one type.
    pub fn events_of(&self, event_type: &str) -> u64 {
        self.parts
            .iter()
            .filter(|part| part.event_type == event_type)
            .map(|part| part.streams * part.per_stream)
            .sum()
    }

    /// Events seeded.
    pub fn events(&self) -> u64 {
        self.parts.iter().map(|p| p.streams * p.per_stream).sum()
    }

    /// Names of the perspectives whose rows are drained (not parked).
    pub fn perspective_names(&self) -> Vec<String> {
        self.perspectives
            .iter()
            .filter(|p| !p.parked)
            .map(|p| p.name.clone())
            .collect()
    }

    /// The daemon's perspective settings.
    pub fn settings(&self) -> Vec<PerspectiveSettings> {
        self.perspectives.iter().map(|p| p.settings()).collect()
    }
}

/// Empties the bench schema and seeds `seed` (one `generate_series` statement per part), then
/// parks or exhausts the rows that should be, and refreshes statistics.
pub async fn apply(bench: &Bench, seed: &Seed) -> Result<(), BenchError> {
    let bar = bench
        .progress
        .spinner(&format!("seeding {} events", seed.events()));
    let db = &bench.db;
    db.reset_data().await?;
    for p in &seed.perspectives {
        db.store()
            .register_perspective(&p.name, std::slice::from_ref(&p.event_type))
            .await?;
    }
    for part in &seed.parts {
        db.seed(
            &part.salt,
            part.streams as i64,
            part.per_stream as i64,
            &part.event_type,
            seed.payload_bytes.min(i32::MAX as u32) as i32,
            seed.traced,
        )
        .await?;
    }
    for p in &seed.perspectives {
        if p.parked {
            db.park(&p.name).await?;
        }
        if p.exhausted {
            // Claimed 10 times already: the 11th claim dead-letters it (default max 10).
            let max = bench
                .base_settings
                .worker
                .max_perspective_event_attempts
                .unwrap_or(10);
            db.exhaust(&p.name, max.min(i32::MAX as u32) as i32).await?;
        }
    }
    db.analyze().await?;
    bar.finish_and_clear();
    Ok(())
}
