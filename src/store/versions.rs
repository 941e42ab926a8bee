//! Versioned perspectives (docs/versions.md): registering a version with its definition,
//! loading the definitions of every version not retired, the backfill's batches, cutover,
//! rollback and retire. The SQL is migrations/0012_versions.sql; every function here is one
//! call to it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnection;

use super::error::{map_db_error, StoreError};
use super::handle::Store;

/// What a version is made of, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionDefinition {
    /// The perspective's configured name (`order_summary`).
    pub perspective: String,
    /// Its version (≥ 1).
    pub version: i32,
    /// Where readers find its tables.
    pub read_schema: String,
    /// The tables it owns.
    pub tables: Vec<String>,
    /// Subscribed event types (`"*"` = every type).
    pub event_types: Vec<String>,
    /// Event type → statement.
    pub statements: serde_json::Value,
    /// SQL creating its tables, run once in its own schema.
    pub setup: String,
}

/// A version as registered: what the daemon needs to apply it.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct RegisteredVersion {
    /// The perspective's configured name.
    pub perspective_name: String,
    /// The version.
    pub version: i32,
    /// Its row in `wh_perspectives` (`order_summary@v2`): the name its work rows, dead letters
    /// and metrics carry.
    pub registry_name: String,
    /// The schema holding its tables (`order_summary_v2`).
    pub version_schema: String,
    /// The statement the daemon runs for each of its events.
    pub apply_statement: String,
    /// Subscribed event types.
    pub event_types: Vec<String>,
    /// Its configured statements (event type → statement).
    pub statements: serde_json::Value,
    /// `building`, `ready`, `live` or `retired`.
    pub state: String,
}

/// Why a version could not be registered: its definition (a changed definition under a
/// registered version, a retired version, a setup that fails or creates the wrong tables).
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// The definition is refused; the message names the perspective and what is wrong.
    #[error("{0}")]
    Refused(String),
    /// The database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// One backfill batch's result.
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct BackfillStep {
    /// `applied` (a batch was looked at), `waiting` (transactions older than the registration
    /// are still open), `busy` (another process is backfilling it), `ready`, `live` (done:
    /// `live` when it became the live version), or the version's state when it is not
    /// building.
    pub outcome: String,
    /// Events applied by this batch.
    pub applied: i32,
    /// The position reached.
    pub backfill_position: Option<i64>,
    /// The event store's end when the backfill began.
    pub backfill_target: Option<i64>,
    /// Events of the batch that became work rows instead (a diverted batch, or events behind
    /// an earlier diverted one in their stream): the drain applies them after the backfill.
    pub diverted: i32,
}

/// The result of a cutover or rollback (see [`Store::switch_version`]).
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct SwitchOutcome {
    /// `done`, or why not: `unknown`, `retired`, `live`, `building`, `no_previous`,
    /// `behind_live`.
    pub outcome: String,
    /// The version that was live.
    pub from_version: Option<i32>,
    /// The version asked for.
    pub to_version: Option<i32>,
    /// For `building` and `behind_live`: how many events it still has to apply.
    pub behind: Option<i64>,
}

/// A version as operators see it (`vantage perspectives versions`, the console).
#[derive(Clone, Debug, PartialEq, Eq, sqlx::FromRow)]
pub struct VersionStatus {
    /// The perspective's configured name.
    pub perspective_name: String,
    /// The version.
    pub version: i32,
    /// `building`, `ready`, `live` or `retired`.
    pub state: String,
    /// Events not yet applied.
    pub behind: i64,
    /// The backfill's position and the event store's end when it began.
    pub backfill_position: i64,
    /// (see `backfill_position`)
    pub backfill_target: Option<i64>,
    /// Events the backfill applied.
    pub backfill_applied: i64,
    /// When the backfill began and ended.
    pub backfill_started_at: Option<DateTime<Utc>>,
    /// (see `backfill_started_at`)
    pub backfill_done_at: Option<DateTime<Utc>>,
    /// When it was registered.
    pub created_at: DateTime<Utc>,
    /// Since when it is live (the last time it became live).
    pub live_since: Option<DateTime<Utc>>,
    /// Its registry name (`order_summary@v2`).
    pub registry_name: String,
    /// Its schema.
    pub version_schema: String,
}

impl VersionStatus {
    /// Its backfill in a few words, as the CLI and the console show it: `at position P of T`,
    /// `not started`, or `done (N applied)`.
    pub(crate) fn backfill_summary(&self) -> String {
        match (self.state.as_str(), self.backfill_target) {
            ("building", Some(target)) => {
                format!("at position {} of {target}", self.backfill_position)
            }
            ("building", None) => "not started".to_owned(),
            _ => format!("done ({} applied)", self.backfill_applied),
        }
    }
}

/// Which transition [`Store::switch_version`] makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Switch {
    /// To a given version, or the newest.
    Cutover,
    /// Back to the version live before the current one.
    Rollback,
}

impl Switch {
    fn kind(self) -> &'static str {
        match self {
            Switch::Cutover => "Cutover",
            Switch::Rollback => "Rollback",
        }
    }
}

/// Registers `definition` (idempotent) on `conn`, inside the caller's transaction, so the
/// caller can check the version's statements in its schema before committing (see
/// [`search_version_schema`]).
pub(crate) async fn register_version(
    conn: &mut PgConnection,
    definition: &VersionDefinition,
    actor: &str,
) -> Result<(RegisteredVersion, bool), RegisterError> {
    let row: Result<(String, String, String, String, bool), sqlx::Error> = sqlx::query_as(
        "SELECT registry_name, version_schema, apply_statement, state, created \
         FROM register_perspective_version($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(&definition.perspective)
    .bind(definition.version)
    .bind(&definition.read_schema)
    .bind(&definition.tables)
    .bind(&definition.event_types)
    .bind(&definition.statements)
    .bind(&definition.setup)
    .bind(actor)
    .fetch_one(conn)
    .await;
    match row {
        Ok((registry_name, version_schema, apply_statement, state, created)) => Ok((
            RegisteredVersion {
                perspective_name: definition.perspective.clone(),
                version: definition.version,
                registry_name,
                version_schema,
                apply_statement,
                event_types: definition.event_types.clone(),
                statements: definition.statements.clone(),
                state,
            },
            created,
        )),
        // Anything the database says about a definition (its setup included) is the
        // definition's fault; a lost connection is not.
        Err(sqlx::Error::Database(db)) => Err(RegisterError::Refused(format!(
            "perspective '{}' version {}: {}",
            definition.perspective,
            definition.version,
            db.message()
        ))),
        Err(e) => Err(RegisterError::Store(map_db_error(e))),
    }
}

/// Puts `schema` first on the search path for the rest of the caller's transaction (how a
/// version's statements see its tables, for checking them).
pub(crate) async fn search_version_schema(
    conn: &mut PgConnection,
    schema: &str,
) -> Result<(), StoreError> {
    sqlx::query(
        "SELECT set_config('search_path', format('%I, %s', $1::text, current_setting('search_path')), true)",
    )
    .bind(schema)
    .execute(conn)
    .await
    .map_err(map_db_error)?;
    Ok(())
}

impl Store {
    /// Every version not retired of these perspectives, by name then version.
    pub(crate) async fn registered_versions(
        &self,
        perspectives: &[String],
    ) -> Result<Vec<RegisteredVersion>, StoreError> {
        sqlx::query_as(
            "SELECT perspective_name, version, registry_name, version_schema, apply_statement, \
                    event_types, statements, state \
             FROM wh_perspective_versions \
             WHERE perspective_name = ANY ($1) AND state <> 'retired' \
             ORDER BY perspective_name, version",
        )
        .bind(perspectives)
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// The versions still building, among these perspectives.
    pub(crate) async fn building_versions(
        &self,
        perspectives: &[String],
    ) -> Result<Vec<(String, i32)>, StoreError> {
        sqlx::query_as(
            "SELECT perspective_name, version FROM wh_perspective_versions \
             WHERE perspective_name = ANY ($1) AND state = 'building' \
             ORDER BY perspective_name, version",
        )
        .bind(perspectives)
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// One backfill batch of at most `max` events (its own transaction), which also ends once
    /// it has run for `budget` (checked every 100 events). With `divert`, the batch's events
    /// are not applied but become work rows of the version, for the drain to take once the
    /// backfill is done (how a batch that failed to apply moves on).
    pub(crate) async fn backfill_version(
        &self,
        perspective: &str,
        version: i32,
        max: i32,
        budget: Duration,
        divert: bool,
    ) -> Result<BackfillStep, StoreError> {
        sqlx::query_as(
            "SELECT outcome, applied, backfill_position, backfill_target, diverted \
             FROM backfill_perspective_version($1, $2, $3, $4, $5)",
        )
        .bind(perspective)
        .bind(version)
        .bind(max)
        .bind(divert)
        .bind(i32::try_from(budget.as_millis()).unwrap_or(i32::MAX))
        .fetch_one(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// The versions of a perspective, oldest first (empty when it has none).
    pub(crate) async fn version_status(
        &self,
        perspective: &str,
    ) -> Result<Vec<VersionStatus>, StoreError> {
        sqlx::query_as(
            "SELECT perspective_name, version, state, \
                    coalesce(wh_version_behind(perspective_name, version), 0) AS behind, \
                    backfill_position, backfill_target, backfill_applied, backfill_started_at, \
                    backfill_done_at, created_at, live_since, registry_name, version_schema \
             FROM wh_perspective_versions WHERE perspective_name = $1 ORDER BY version",
        )
        .bind(perspective)
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Every version of every versioned perspective that is not retired, by name then version
    /// (the console's overview, the metrics).
    pub(crate) async fn all_version_status(&self) -> Result<Vec<VersionStatus>, StoreError> {
        sqlx::query_as(
            "SELECT perspective_name, version, state, \
                    coalesce(wh_version_behind(perspective_name, version), 0) AS behind, \
                    backfill_position, backfill_target, backfill_applied, backfill_started_at, \
                    backfill_done_at, created_at, live_since, registry_name, version_schema \
             FROM wh_perspective_versions WHERE state <> 'retired' \
             ORDER BY perspective_name, version",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Cutover (to `version`, or the newest) or rollback, in one transaction; a refusal is an
    /// outcome, not an error.
    pub(crate) async fn switch_version(
        &self,
        perspective: &str,
        switch: Switch,
        version: Option<i32>,
        actor: &str,
    ) -> Result<SwitchOutcome, StoreError> {
        sqlx::query_as(
            "SELECT outcome, from_version, to_version, behind \
             FROM switch_perspective_version($1, $2, $3, $4)",
        )
        .bind(perspective)
        .bind(switch.kind())
        .bind(version)
        .bind(actor)
        .fetch_one(&self.pool)
        .await
        .map_err(map_db_error)
    }

    /// Retires a version that is not live: `done`, `unknown`, `live` or `retired`, and how many
    /// pending work rows went with it.
    pub(crate) async fn retire_version(
        &self,
        perspective: &str,
        version: i32,
        actor: &str,
    ) -> Result<(String, i64), StoreError> {
        sqlx::query_as("SELECT outcome, dropped_rows FROM retire_perspective_version($1, $2, $3)")
            .bind(perspective)
            .bind(version)
            .bind(actor)
            .fetch_one(&self.pool)
            .await
            .map_err(map_db_error)
    }
}
