//! Where the layers above the defaults come from: the options a caller (the CLI, an embedding
//! binary) passes to [`Settings::load`](super::Settings::load).

use std::path::{Path, PathBuf};

/// The file read when no `--config` is given, relative to the working directory (only if it
/// exists).
pub const DEFAULT_CONFIG_PATH: &str = "config/vantage.toml";

/// Where the layers above the defaults come from.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// `--config PATH`. `None` = [`DEFAULT_CONFIG_PATH`] if it exists, else no file.
    pub config_path: Option<PathBuf>,
    /// `--database-url`: the highest layer for `database.url`.
    pub database_url: Option<String>,
    /// Explicit `("section.key", "value")` overrides (CLI flags), e.g.
    /// `("worker.consumers", "8")`. Values are parsed like environment variables.
    pub overrides: Vec<(String, String)>,
}

impl LoadOptions {
    /// The file that will be read: the explicit path (even if missing, which is then an error
    /// at load), else [`DEFAULT_CONFIG_PATH`] if it is a file, else none.
    pub fn resolved_config_path(&self) -> Option<PathBuf> {
        match &self.config_path {
            Some(path) => Some(path.clone()),
            None => {
                let default = Path::new(DEFAULT_CONFIG_PATH);
                default.is_file().then(|| default.to_path_buf())
            }
        }
    }
}
