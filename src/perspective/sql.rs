//! SQL perspectives: one parameterised statement per event type, from configuration.
//!
//! Parameters bound to every statement: `$1` data (jsonb), `$2` stream_id, `$3` event_id,
//! `$4` event_type, `$5` global_position, `$6` stream_version, `$7` metadata. Event data is only
//! ever bound, never formatted into SQL.

use std::collections::BTreeMap;

use async_trait::async_trait;
use sqlx::{Executor, PgConnection};

use super::{ApplyError, EventEnvelope, Perspective};
use crate::config::PerspectiveSettings;

/// A statement that does not prepare (bad SQL, unknown table, ...).
#[derive(Debug, thiserror::Error)]
#[error("perspective '{perspective}', event type '{event_type}': the statement does not prepare: {reason}")]
pub struct SqlPerspectiveError {
    /// The perspective.
    pub perspective: String,
    /// The event type (or `reset`).
    pub event_type: String,
    /// What PostgreSQL said.
    pub reason: String,
}

/// A perspective whose handler is SQL from configuration.
#[derive(Clone, Debug)]
pub struct SqlPerspective {
    name: String,
    events: Vec<String>,
    statements: BTreeMap<String, String>,
    reset: Option<String>,
}

impl SqlPerspective {
    /// From its configuration.
    pub fn from_settings(s: &PerspectiveSettings) -> Self {
        SqlPerspective {
            name: s.name.clone(),
            events: s.events.clone(),
            statements: s.sql.clone(),
            reset: s.reset.clone(),
        }
    }

    /// The statement for an event type, if any.
    pub fn statement(&self, event_type: &str) -> Option<&str> {
        self.statements.get(event_type).map(String::as_str)
    }

    /// Prepares every statement (and `reset`) on `conn`, so a typo stops the daemon at start-up
    /// with the perspective and event type named, not at the first matching event.
    pub async fn prepare(&self, conn: &mut PgConnection) -> Result<(), SqlPerspectiveError> {
        let all = self
            .statements
            .iter()
            .map(|(t, s)| (t.as_str(), s.as_str()))
            .chain(self.reset.as_deref().map(|s| ("reset", s)));
        for (event_type, statement) in all {
            let prepared = if event_type == "reset" {
                conn.prepare(statement).await.map(|_| ())
            } else {
                conn.prepare_with(statement, &param_types())
                    .await
                    .map(|_| ())
            };
            prepared.map_err(|e| SqlPerspectiveError {
                perspective: self.name.clone(),
                event_type: event_type.to_string(),
                reason: match &e {
                    sqlx::Error::Database(db) => db.message().to_string(),
                    other => other.to_string(),
                },
            })?;
        }
        Ok(())
    }
}

fn param_types() -> [sqlx::postgres::PgTypeInfo; 7] {
    use sqlx::postgres::PgTypeInfo;
    [
        PgTypeInfo::with_name("jsonb"),
        PgTypeInfo::with_name("uuid"),
        PgTypeInfo::with_name("uuid"),
        PgTypeInfo::with_name("text"),
        PgTypeInfo::with_name("int8"),
        PgTypeInfo::with_name("int4"),
        PgTypeInfo::with_name("jsonb"),
    ]
}

#[async_trait]
impl Perspective for SqlPerspective {
    fn name(&self) -> &str {
        &self.name
    }

    fn event_types(&self) -> Vec<String> {
        self.events.clone()
    }

    async fn apply(&self, event: &EventEnvelope, tx: &mut PgConnection) -> Result<(), ApplyError> {
        // Subscribed through '*' but without a statement for this type: nothing to do.
        let Some(statement) = self.statements.get(&event.event_type) else {
            return Ok(());
        };
        sqlx::query(statement)
            .bind(&event.data)
            .bind(event.stream_id)
            .bind(event.event_id)
            .bind(&event.event_type)
            .bind(event.global_position)
            .bind(event.stream_version)
            .bind(&event.metadata)
            .execute(&mut *tx)
            .await
            .map_err(ApplyError::from_sqlx)?;
        Ok(())
    }

    async fn reset(&self, tx: &mut PgConnection) -> Result<(), ApplyError> {
        if let Some(reset) = &self.reset {
            sqlx::query(reset)
                .execute(&mut *tx)
                .await
                .map_err(ApplyError::from_sqlx)?;
        }
        Ok(())
    }
}
