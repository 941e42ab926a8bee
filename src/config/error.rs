//! [`ConfigError`]: what is wrong, always naming the key, and never the database password.

use std::path::PathBuf;

use super::secret::scrub_secrets;

/// Invalid configuration. `vantage` exits with [`ConfigError::EXIT_CODE`]. Messages name the
/// key, the bad value and the layer it came from, and never contain the database password.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A value of the wrong type or out of range.
    #[error("invalid configuration: {key} = {value}{}: expected {expected}", from_suffix(.origin))]
    InvalidValue {
        /// Dotted key, e.g. `worker.consumers` or `perspectives[0].name`.
        key: String,
        /// The value as written (strings quoted), secrets redacted.
        value: String,
        /// The layer that set it: a file path, an environment variable, `an override`.
        origin: Option<String>,
        /// What would have been accepted.
        expected: String,
    },
    /// A key vantage does not know (usually a typo).
    #[error("invalid configuration: unknown key {key}{}: expected one of {expected}", from_suffix(.origin))]
    UnknownKey {
        /// Dotted key.
        key: String,
        /// The layer that set it.
        origin: Option<String>,
        /// The keys valid at that place.
        expected: String,
    },
    /// A rule about a key that is not about a single value (missing, inconsistent).
    #[error("invalid configuration: {key}: {message}")]
    Invalid {
        /// Dotted key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// `--config PATH` names a file that does not exist.
    #[error("invalid configuration: configuration file {} does not exist", .path.display())]
    FileNotFound {
        /// The path given.
        path: PathBuf,
    },
    /// The configuration file exists but cannot be read.
    #[error("invalid configuration: cannot read configuration file {}: {error}", .path.display())]
    FileRead {
        /// The file's path, as given or found.
        path: PathBuf,
        /// The operating system's reason (permission denied, a directory, …).
        error: std::io::Error,
    },
    /// The file is not valid TOML. The message gives line and column but never echoes the
    /// source line, which could hold a password.
    #[error("invalid configuration: {origin} is not valid TOML: {message}")]
    Syntax {
        /// Where the TOML came from (the file's path), as the message names it.
        origin: String,
        /// Position and reason.
        message: String,
    },
    /// A `VANTAGE__*` or `DATABASE_URL` variable is not UTF-8.
    #[error("invalid configuration: environment variable {var} is not valid UTF-8")]
    NotUnicode {
        /// The variable name.
        var: String,
    },
    /// Anything else reported by the layering machinery (secrets scrubbed).
    #[error("invalid configuration: {0}")]
    Other(String),
}

impl ConfigError {
    /// Process exit code for invalid configuration (`EX_CONFIG` of sysexits.h).
    pub const EXIT_CODE: i32 = 78;

    pub(super) fn other(err: config::ConfigError) -> Self {
        ConfigError::Other(scrub_secrets(&err.to_string()))
    }
}

fn from_suffix(origin: &Option<String>) -> String {
    match origin {
        Some(origin) => format!(" (from {origin})"),
        None => String::new(),
    }
}
