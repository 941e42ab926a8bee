//! Storage: every SQL statement vantage issues lives under this module.
//!
//! The pipeline, the CLI and the background loops call typed methods on [`Store`]; none of
//! them builds SQL. The schema (`database.schema`) is selected with the connection's
//! `search_path` startup option, so the same statements serve any schema name.

pub(crate) mod apply;
pub(crate) mod bench;
pub(crate) mod claims;
mod console;
pub(crate) mod dead_letters;
pub(crate) mod dry_run;
mod error;
pub(crate) mod events;
pub(crate) mod handle;
pub(crate) mod instances;
mod lanes;
pub(crate) mod leases;
mod memory;
mod operator;
mod samples;
pub(crate) mod soak;
mod status;
pub(crate) mod triage;
mod versions;
pub(crate) mod work;

// What a library user names (lib.rs, "What is API"): the handle and how to reach the database,
// the events it appends, its errors, and the memory store the testkit runs on.
pub use error::StoreError;
pub use events::{AppendedEvent, NewEvent};
pub use handle::{Store, StoreOptions};
pub use instances::InstanceId;
pub use memory::{MemoryStore, MemoryWork};

// The rest is the crate's own; integration tests reach what they drive through
// `crate::internals::store`.
pub(crate) use apply::{mentioned_params, StatementBatch, StatementParams};
pub(crate) use claims::WorkRow;
pub(crate) use console::{BulkOrder, CountedDeadLetters, DeadLetterCursor, DeadLetterFilter};
pub(crate) use dead_letters::{
    resolve_dead_letter_in, DeadLetter, HistoryEntry, MoveOutcome, FAILURE_MAX_ATTEMPTS,
    FAILURE_PERMANENT,
};
pub(crate) use events::{
    append_events_in, append_events_json_in, requeue_history_batch_in, stored_event_ids_in,
    StoredEvent,
};
pub(crate) use handle::WORK_CHANNEL;
pub(crate) use instances::InstanceInfo;
pub(crate) use lanes::LaneCursor;
pub(crate) use samples::{MinuteSample, Window};
pub(crate) use status::{PerspectiveStatus, StoreGauges};
pub(crate) use triage::BlockedTotals;
pub(crate) use versions::{
    register_version, search_version_schema, RegisterError, RegisteredVersion, Switch,
    SwitchOutcome, VersionDefinition, VersionStatus,
};
pub(crate) use work::{WorkStore, WorkTx};
