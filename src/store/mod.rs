//! Storage: every SQL statement vantage issues lives under this module.
//!
//! The pipeline, the CLI and the background loops call typed methods on [`Store`]; none of
//! them builds SQL. The schema (`database.schema`) is selected with the connection's
//! `search_path` startup option, so the same statements serve any schema name.

mod apply;
pub mod bench;
mod claims;
mod console;
mod dead_letters;
pub mod dry_run;
mod error;
mod events;
mod handle;
mod instances;
mod lanes;
pub(crate) mod leases;
mod memory;
mod operator;
mod status;
mod triage;
mod work;

pub use apply::{StatementBatch, StatementParams};
pub use claims::{ClaimedHead, WorkRow};
pub use console::{
    BulkOrder, CountedDeadLetters, DeadLetterCursor, DeadLetterFilter, DeadLetterPage,
    DeadLetterSummary, ERROR_PREVIEW_CHARS,
};
pub use dead_letters::{
    resolve_dead_letter_in, DeadLetter, DeadLetterStatus, HistoryEntry, MoveOutcome,
    FAILURE_MAX_ATTEMPTS, FAILURE_PERMANENT, SOURCE_TABLE,
};
pub use events::{
    append_events_in, append_events_json_in, requeue_history_batch_in, stored_event_ids_in,
    AppendedEvent, NewEvent, PerspectiveRecord, StoredEvent,
};
pub use instances::{InstanceInfo, LiveInstance};
pub use lanes::{LaneCursor, LaneRepairs};
pub use memory::{MemoryStore, MemoryTx, MemoryWork};
pub use status::{PerspectiveStatus, StoreGauges};
pub use triage::{BlockedLane, BlockedTotals, ErrorGroup, PauseState, QUARANTINE_BY};
pub use work::{PgWorkTx, WorkStore, WorkTx};
// Kept under its old path: callers classify a sqlx error where they hold one.
pub use crate::sqlstate::is_connection_error;

pub use error::StoreError;
pub use handle::{AppliedMigration, Store, StoreOptions, LOCK_TIMEOUT, MIGRATOR, WORK_CHANNEL};
pub use instances::InstanceId;
