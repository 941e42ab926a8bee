//! The perspectives one process handles, by name.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::handler::Perspective;
use super::sql::{SqlPerspective, SqlPerspectiveError};
use crate::config::PerspectiveSettings;
use crate::store::{Store, StoreError};

/// Errors building or registering the set of perspectives.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// Two perspectives share a name.
    #[error("perspective '{0}' is defined twice")]
    Duplicate(String),
    /// A SQL perspective's statement is refused: it does not prepare, needs unbound
    /// parameters, controls the transaction, or a subscribed type has none. The message names
    /// the key, as configuration errors do.
    #[error("invalid configuration: perspectives[{index}].{}: {problem}", .problem.key)]
    Statement {
        /// The perspective's position in `[[perspectives]]`.
        index: usize,
        /// What is wrong, with the perspective and event type.
        problem: SqlPerspectiveError,
    },
    /// A versioned perspective's version is refused (docs/versions.md): a changed definition
    /// under a registered version, a retired version, a setup that fails.
    #[error("invalid configuration: perspectives[{index}]: {message}")]
    Version {
        /// The perspective's position in `[[perspectives]]`.
        index: usize,
        /// What is wrong, naming the perspective.
        message: String,
    },
    /// The database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The perspectives this process has handlers for.
#[derive(Clone, Default)]
pub struct PerspectiveRegistry {
    by_name: BTreeMap<String, Arc<dyn Perspective>>,
}

impl std::fmt::Debug for PerspectiveRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.by_name.keys()).finish()
    }
}

impl PerspectiveRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// SQL perspectives from configuration (a versioned one is added once its versions are
    /// registered: see [`register_versions`](super::versioned::register_versions)).
    pub fn from_settings(settings: &[PerspectiveSettings]) -> Result<Self, RegistryError> {
        let mut registry = Self::new();
        for s in settings.iter().filter(|s| !s.is_versioned()) {
            registry.add(Arc::new(SqlPerspective::from_settings(s)))?;
        }
        Ok(registry)
    }

    /// Adds a perspective.
    pub fn add(&mut self, perspective: Arc<dyn Perspective>) -> Result<(), RegistryError> {
        let name = perspective.name().to_string();
        if self.by_name.contains_key(&name) {
            return Err(RegistryError::Duplicate(name));
        }
        self.by_name.insert(name, perspective);
        Ok(())
    }

    /// The perspective with this name.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn Perspective>> {
        self.by_name.get(name)
    }

    /// Names, sorted.
    pub fn names(&self) -> Vec<String> {
        self.by_name.keys().cloned().collect()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// Every perspective.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<dyn Perspective>> {
        self.by_name.values()
    }

    /// Upserts every perspective into `wh_perspectives` (the fan-out reads it).
    pub async fn register_all(&self, store: &Store) -> Result<(), RegistryError> {
        for p in self.by_name.values() {
            store
                .register_perspective(p.name(), &p.event_types())
                .await?;
        }
        Ok(())
    }
}

/// Checks and prepares the statements of SQL perspectives from configuration on one
/// connection ([`SqlPerspective::prepare`]): run at start-up before anything is registered.
pub async fn prepare_sql_perspectives(
    store: &Store,
    settings: &[PerspectiveSettings],
) -> Result<(), RegistryError> {
    let mut conn = store.pool().acquire().await.map_err(StoreError::from)?;
    for (index, s) in settings
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.is_versioned())
    {
        SqlPerspective::from_settings(s)
            .prepare(&mut conn)
            .await
            .map_err(|problem| RegistryError::Statement { index, problem })?;
    }
    Ok(())
}
