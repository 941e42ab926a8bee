//! Not API: the crate's internals its own integration tests reach (SQL-contract tests call the
//! fenced per-row statements directly, daemon tests drive one pipeline pass, console tests
//! serve the router in-process). Anything here may change in any release.
//!
//! Items are re-exported from where they are defined (their modules are crate-private);
//! methods that only the binary and the tests call are reached through the extension traits
//! below (`store::StoreInternals`) or small functions, so the public types keep only the
//! methods a library user needs.

/// The statements that change rows leased to us (the pipeline reaches them through
/// `WorkStore` and `WorkTx`).
pub mod leases {
    pub use crate::store::leases::*;
}

/// The store's statement-level surface: the rows it returns, the storage seam of the pipeline,
/// the operator's statements, the migrations.
pub mod store {
    use std::future::Future;
    use std::time::Duration;

    use chrono::{DateTime, Utc};
    use uuid::Uuid;

    pub use crate::store::apply::{StatementBatch, StatementParams};
    pub use crate::store::claims::{ClaimedHead, WorkRow};
    pub use crate::store::dead_letters::{
        resolve_dead_letter_in, DeadLetter, HistoryEntry, MoveOutcome, FAILURE_MAX_ATTEMPTS,
        SOURCE_TABLE,
    };
    pub use crate::store::events::{requeue_history_batch_in, StoredEvent};
    pub use crate::store::handle::MIGRATOR;
    pub use crate::store::instances::InstanceInfo;
    pub use crate::store::triage::{PauseState, QUARANTINE_BY};
    pub use crate::store::work::{WorkStore, WorkTx};

    use crate::store::{InstanceId, Store, StoreError};

    /// The [`Store`] methods the binary's commands, the daemon and the SQL-contract tests call
    /// (claims, instances, dead-letter actions, pauses), which are not a library user's API.
    /// Bring it into scope (`use vantage::internals::store::StoreInternals as _;`) and call
    /// them as methods; each forwards to the crate's own method of the same name.
    #[allow(missing_docs)]
    pub trait StoreInternals {
        fn claim_work(
            &self,
            instance: InstanceId,
            lease: Duration,
            max_lanes: u32,
            max_rows: u32,
            perspectives: Option<&[String]>,
        ) -> impl Future<Output = Result<Vec<WorkRow>, StoreError>> + Send;
        fn claim_orphaned(
            &self,
            instance: InstanceId,
            lease: Duration,
            max_streams: u32,
            max_rows: u32,
            perspectives: Option<&[String]>,
        ) -> impl Future<Output = Result<Vec<ClaimedHead>, StoreError>> + Send;
        fn get_stream_events(
            &self,
            instance: InstanceId,
            streams: &[Uuid],
            lease: Duration,
            perspectives: Option<&[String]>,
            max_rows: Option<u32>,
        ) -> impl Future<Output = Result<Vec<WorkRow>, StoreError>> + Send;
        fn claim_and_fetch_pending(
            &self,
            stream: Uuid,
            perspective: &str,
            instance: InstanceId,
            lease: Duration,
        ) -> impl Future<Output = Result<Vec<(Uuid, Uuid, i32, i32)>, StoreError>> + Send;
        fn with_statement_timeout(&self, timeout: Duration) -> Store;
        fn heartbeat(
            &self,
            instance: InstanceId,
            info: &InstanceInfo,
        ) -> impl Future<Output = Result<bool, StoreError>> + Send;
        fn deregister(
            &self,
            instance: InstanceId,
        ) -> impl Future<Output = Result<u64, StoreError>> + Send;
        fn cleanup_dead_instances(
            &self,
            stale_after: Duration,
        ) -> impl Future<Output = Result<Vec<Uuid>, StoreError>> + Send;
        fn dead_letter(
            &self,
            id: Uuid,
        ) -> impl Future<Output = Result<Option<DeadLetter>, StoreError>> + Send;
        fn dead_letter_history(
            &self,
            id: Uuid,
        ) -> impl Future<Output = Result<Vec<HistoryEntry>, StoreError>> + Send;
        fn open_dead_letters_at(
            &self,
            global_position: i64,
            perspective: Option<&str>,
        ) -> impl Future<Output = Result<Vec<DeadLetter>, StoreError>> + Send;
        fn requeue_dead_letter(
            &self,
            id: Uuid,
            actor: &str,
        ) -> impl Future<Output = Result<bool, StoreError>> + Send;
        fn purge_dead_letter(
            &self,
            id: Uuid,
            actor: &str,
        ) -> impl Future<Output = Result<bool, StoreError>> + Send;
        fn event_at(
            &self,
            global_position: i64,
        ) -> impl Future<Output = Result<Option<StoredEvent>, StoreError>> + Send;
        fn pause_perspective(
            &self,
            name: &str,
            reason: Option<&str>,
            by: &str,
        ) -> impl Future<Output = Result<Option<bool>, StoreError>> + Send;
        fn resume_perspective(
            &self,
            name: &str,
        ) -> impl Future<Output = Result<Option<bool>, StoreError>> + Send;
        fn quarantine_perspective(
            &self,
            name: &str,
            dead_letters: u32,
            window: Duration,
            reason: &str,
        ) -> impl Future<Output = Result<Option<DateTime<Utc>>, StoreError>> + Send;
        fn pause_states(&self) -> impl Future<Output = Result<Vec<PauseState>, StoreError>> + Send;
    }

    impl StoreInternals for Store {
        fn claim_work(
            &self,
            instance: InstanceId,
            lease: Duration,
            max_lanes: u32,
            max_rows: u32,
            perspectives: Option<&[String]>,
        ) -> impl Future<Output = Result<Vec<WorkRow>, StoreError>> + Send {
            Store::claim_work(
                self,
                instance,
                lease,
                max_lanes,
                max_rows,
                perspectives,
                true,
            )
        }
        fn claim_orphaned(
            &self,
            instance: InstanceId,
            lease: Duration,
            max_streams: u32,
            max_rows: u32,
            perspectives: Option<&[String]>,
        ) -> impl Future<Output = Result<Vec<ClaimedHead>, StoreError>> + Send {
            Store::claim_orphaned(self, instance, lease, max_streams, max_rows, perspectives)
        }
        fn get_stream_events(
            &self,
            instance: InstanceId,
            streams: &[Uuid],
            lease: Duration,
            perspectives: Option<&[String]>,
            max_rows: Option<u32>,
        ) -> impl Future<Output = Result<Vec<WorkRow>, StoreError>> + Send {
            Store::get_stream_events(self, instance, streams, lease, perspectives, max_rows)
        }
        fn claim_and_fetch_pending(
            &self,
            stream: Uuid,
            perspective: &str,
            instance: InstanceId,
            lease: Duration,
        ) -> impl Future<Output = Result<Vec<(Uuid, Uuid, i32, i32)>, StoreError>> + Send {
            Store::claim_and_fetch_pending(self, stream, perspective, instance, lease)
        }
        fn with_statement_timeout(&self, timeout: Duration) -> Store {
            Store::with_statement_timeout(self, timeout)
        }
        fn heartbeat(
            &self,
            instance: InstanceId,
            info: &InstanceInfo,
        ) -> impl Future<Output = Result<bool, StoreError>> + Send {
            Store::heartbeat(self, instance, info)
        }
        fn deregister(
            &self,
            instance: InstanceId,
        ) -> impl Future<Output = Result<u64, StoreError>> + Send {
            Store::deregister(self, instance)
        }
        fn cleanup_dead_instances(
            &self,
            stale_after: Duration,
        ) -> impl Future<Output = Result<Vec<Uuid>, StoreError>> + Send {
            Store::cleanup_dead_instances(self, stale_after)
        }
        fn dead_letter(
            &self,
            id: Uuid,
        ) -> impl Future<Output = Result<Option<DeadLetter>, StoreError>> + Send {
            Store::dead_letter(self, id)
        }
        fn dead_letter_history(
            &self,
            id: Uuid,
        ) -> impl Future<Output = Result<Vec<HistoryEntry>, StoreError>> + Send {
            Store::dead_letter_history(self, id)
        }
        fn open_dead_letters_at(
            &self,
            global_position: i64,
            perspective: Option<&str>,
        ) -> impl Future<Output = Result<Vec<DeadLetter>, StoreError>> + Send {
            Store::open_dead_letters_at(self, global_position, perspective)
        }
        fn requeue_dead_letter(
            &self,
            id: Uuid,
            actor: &str,
        ) -> impl Future<Output = Result<bool, StoreError>> + Send {
            Store::requeue_dead_letter(self, id, actor)
        }
        fn purge_dead_letter(
            &self,
            id: Uuid,
            actor: &str,
        ) -> impl Future<Output = Result<bool, StoreError>> + Send {
            Store::purge_dead_letter(self, id, actor)
        }
        fn event_at(
            &self,
            global_position: i64,
        ) -> impl Future<Output = Result<Option<StoredEvent>, StoreError>> + Send {
            Store::event_at(self, global_position)
        }
        fn pause_perspective(
            &self,
            name: &str,
            reason: Option<&str>,
            by: &str,
        ) -> impl Future<Output = Result<Option<bool>, StoreError>> + Send {
            Store::pause_perspective(self, name, reason, by)
        }
        fn resume_perspective(
            &self,
            name: &str,
        ) -> impl Future<Output = Result<Option<bool>, StoreError>> + Send {
            Store::resume_perspective(self, name)
        }
        fn quarantine_perspective(
            &self,
            name: &str,
            dead_letters: u32,
            window: Duration,
            reason: &str,
        ) -> impl Future<Output = Result<Option<DateTime<Utc>>, StoreError>> + Send {
            Store::quarantine_perspective(self, name, dead_letters, window, reason)
        }
        fn pause_states(&self) -> impl Future<Output = Result<Vec<PauseState>, StoreError>> + Send {
            Store::pause_states(self)
        }
    }
}

/// `vantage bench`, for its smoke test.
pub mod bench {
    pub use crate::bench::{progress, run, BenchConfig, Check};
}

/// The operator console, for tests that serve it in-process.
pub mod console {
    pub use crate::console::*;
}

/// The dead-letter actions' messages, which console pages must show word for word.
pub mod dlq {
    pub use crate::dlq::msg;
}

/// The drain pipeline's stages, for tests that drive one pass or one stage by hand.
pub mod pipeline {
    pub use crate::pipeline::{
        apply, backoff, claim, cooldown, dlq_filter, envelope, inflight, lease, settle, DrainError,
        DrainOutcome, Pipeline,
    };
}

/// The daemon's telemetry: the recorder (`render()` is what `/metrics` serves), health state
/// and the HTTP surface, for tests that assert on metrics or serve the probes themselves.
pub mod telemetry {
    /// Liveness and readiness state.
    pub mod health {
        pub use crate::telemetry::health::*;
    }
    /// `/metrics`, `/healthz`, `/readyz` and the bounded server under them and the console.
    pub mod http {
        pub use crate::telemetry::http::*;
    }
    /// The Prometheus recorder.
    pub mod recorder {
        pub use crate::telemetry::recorder::*;
    }
}

/// Text shown to operators, capped and escaped.
pub mod text {
    pub use crate::text::MAX_TEXT;
}

/// The daemon's knobs and views that only tests use.
pub mod daemon {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::daemon::DaemonBuilder;
    use crate::pipeline::cooldown::CooldownCache;

    /// How often a daemon checks its perspectives with `quarantine_after`.
    pub const QUARANTINE_PERIOD: Duration = crate::daemon::QUARANTINE_PERIOD;

    /// `builder` with this cooldown cache instead of its own (to observe or pre-mark it).
    pub fn cooldown_cache(builder: DaemonBuilder, cache: Arc<CooldownCache>) -> DaemonBuilder {
        builder.cooldown_cache(cache)
    }
}

/// What the testkit drives, for tests that run single passes.
pub mod testkit {
    use crate::pipeline::Pipeline;
    use crate::store::MemoryStore;
    use crate::testkit::TestKit;

    /// The pipeline `kit` drives (to run single passes, or reach the cooldown cache).
    pub fn pipeline(kit: &TestKit) -> &Pipeline<MemoryStore> {
        kit.pipeline()
    }
}

/// The registry the daemon builds from the settings and the builder, and the SQL perspectives
/// of the configuration (a library user adds perspectives to `DaemonBuilder` instead).
pub mod perspective {
    pub use crate::perspective::registry::{PerspectiveRegistry, RegistryError};
    pub use crate::perspective::sql::SqlPerspective;
}

/// Commands of the binary that tests call in-process.
pub mod cli {
    /// `vantage console`, for tests of its configuration rules without a child process.
    pub mod console {
        pub use crate::cli::console::{run, ConsoleArgs};
    }
}
