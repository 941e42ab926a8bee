//! Storage: every SQL statement vantage issues lives under this module.
//!
//! The pipeline, the CLI and the background loops call typed methods on [`Store`]; none of
//! them builds SQL. The schema (`database.schema`) is selected with the connection's
//! `search_path` startup option, so the same statements serve any schema name.

mod apply;
pub(crate) mod bench;
mod claims;
mod console;
mod dead_letters;
pub(crate) mod dry_run;
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
mod versions;
mod work;

// What a library user, the binary or the integration tests name (lib.rs, "What is API"):
pub use apply::{StatementBatch, StatementParams};
pub use claims::{ClaimedHead, WorkRow};
pub use dead_letters::{resolve_dead_letter_in, MoveOutcome, FAILURE_MAX_ATTEMPTS, SOURCE_TABLE};
pub use error::StoreError;
pub use events::{requeue_history_batch_in, AppendedEvent, NewEvent};
pub use handle::{Store, StoreOptions, MIGRATOR};
pub use instances::{InstanceId, InstanceInfo};
pub use memory::MemoryStore;
pub use triage::QUARANTINE_BY;
pub use versions::{
    register_version, search_version_schema, BackfillStep, RegisterError, RegisteredVersion,
    Switch, SwitchOutcome, VersionDefinition, VersionStatus,
};
pub use work::{WorkStore, WorkTx};

// The rest is the crate's own.
pub(crate) use console::{BulkOrder, CountedDeadLetters, DeadLetterCursor, DeadLetterFilter};
pub(crate) use dead_letters::{DeadLetter, HistoryEntry, FAILURE_PERMANENT};
pub(crate) use events::{
    append_events_in, append_events_json_in, stored_event_ids_in, StoredEvent,
};
pub(crate) use handle::WORK_CHANNEL;
pub(crate) use lanes::LaneCursor;
pub(crate) use memory::MemoryWork;
pub(crate) use triage::BlockedTotals;
