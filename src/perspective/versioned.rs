//! Versioned perspectives at start-up (docs/versions.md): the configured version of each is
//! registered with its definition (its schema set up, its statements checked there, in one
//! transaction), then every version not retired, whatever this configuration says, becomes a
//! SQL perspective of its own (`order_summary@v2`) that runs the version's apply statement.

use std::collections::BTreeMap;

use super::registry::RegistryError;
use super::sql::SqlPerspective;
use crate::config::PerspectiveSettings;
use crate::store::{
    register_version, search_version_schema, RegisterError, RegisteredVersion, Store, StoreError,
    VersionDefinition,
};

/// The definition a versioned perspective's settings give.
pub(crate) fn definition(s: &PerspectiveSettings) -> Option<VersionDefinition> {
    Some(VersionDefinition {
        perspective: s.name.clone(),
        version: i32::try_from(s.version).unwrap_or(i32::MAX),
        read_schema: s.read_schema.clone()?,
        tables: s.tables.clone(),
        event_types: s.events.clone(),
        statements: serde_json::to_value(&s.sql).unwrap_or_default(),
        setup: s.setup.clone().unwrap_or_default(),
    })
}

/// Registers the configured version of every versioned perspective in `settings` and returns
/// a perspective for every version of them not retired (none when nothing is versioned).
/// A changed definition under a registered version, a retired version, a setup that fails or a
/// statement that does not prepare in the version's schema is a configuration error.
pub(crate) async fn register_versions(
    store: &Store,
    settings: &[PerspectiveSettings],
) -> Result<Vec<SqlPerspective>, RegistryError> {
    let mut names = Vec::new();
    for (index, s) in settings.iter().enumerate() {
        let Some(definition) = definition(s) else {
            continue;
        };
        names.push(s.name.clone());
        let mut tx = store.pool().begin().await.map_err(StoreError::from)?;
        let (registered, created) = register_version(&mut tx, &definition, "vantage")
            .await
            .map_err(|e| match e {
                RegisterError::Refused(message) => RegistryError::Version { index, message },
                RegisterError::Store(e) => RegistryError::Store(e),
            })?;
        if created {
            // The statements as configured, in the version's schema: a mistake stops the start
            // here, and the registration (schema and setup included) is rolled back.
            search_version_schema(&mut tx, &registered.version_schema).await?;
            SqlPerspective::from_parts(&s.name, s.events.clone(), s.sql.clone())
                .prepare(&mut tx)
                .await
                .map_err(|problem| RegistryError::Statement { index, problem })?;
        }
        tx.commit().await.map_err(StoreError::from)?;
        if created {
            tracing::info!(perspective = %s.name, version = s.version, schema = %registered.version_schema,
                "registered a new version; its backfill starts now");
        }
    }
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let versions = store.registered_versions(&names).await?;
    Ok(versions.iter().map(perspective).collect())
}

/// The perspective that applies one version: every subscribed type runs the version's apply
/// statement (which picks the type's statement inside the version's schema).
fn perspective(v: &RegisteredVersion) -> SqlPerspective {
    let statements: BTreeMap<String, String> = v
        .event_types
        .iter()
        .map(|t| (t.clone(), v.apply_statement.clone()))
        .collect();
    SqlPerspective::from_parts(&v.registry_name, v.event_types.clone(), statements)
}
