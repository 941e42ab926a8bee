//! The operator commands the report suggests, written so they reach the demo's database and
//! perspectives when pasted into a shell.

use std::path::Path;

use super::config::{DatabaseSource, DemoConfig, EMBEDDED_CONFIG};

/// How the printed commands reach the demo's database and perspectives.
pub(super) struct CliHint {
    /// Environment assignments, program and global options.
    prefix: String,
    pub(super) notes: Vec<String>,
}

impl CliHint {
    pub(super) fn new(demo: &DemoConfig) -> CliHint {
        let mut notes = Vec::new();
        let mut parts = Vec::new();
        let settings = &demo.settings;
        if settings.database.schema != "vantage"
            && std::env::var("VANTAGE__DATABASE__SCHEMA").map_or(true, |v| v.is_empty())
        {
            parts.push(format!(
                "VANTAGE__DATABASE__SCHEMA={}",
                shell_quote(&settings.database.schema)
            ));
        }
        parts.push(shell_quote(&program()));

        // Replay needs the perspectives' statements: point the commands at the demo's file.
        let config = match &demo.file {
            Some(path) => Some(path.clone()),
            None => match write_private_copy(&std::env::temp_dir()) {
                Ok(copy) => {
                    notes.push(format!(
                        "{} is a copy of the demo configuration built into this binary",
                        copy.display()
                    ));
                    Some(copy)
                }
                Err(e) => {
                    notes.push(format!(
                        "replay needs the demo perspectives' configuration, which could not \
                             be written to a new directory in {}: {e}",
                        std::env::temp_dir().display()
                    ));
                    None
                }
            },
        };
        if let Some(config) = config {
            parts.push(format!(
                "--config {}",
                shell_quote(&config.display().to_string())
            ));
        }

        let url = settings.database.url.as_ref();
        match (&demo.database, url) {
            (DatabaseSource::Throwaway(url), _) => {
                parts.push(format!("--database-url {}", shell_quote(url)));
            }
            (_, Some(url)) if url.redacted() == url.expose() => {
                parts.push(format!("--database-url {}", shell_quote(url.expose())));
            }
            (DatabaseSource::Environment, Some(_)) => notes.push(
                "they use the database of DATABASE_URL / VANTAGE__DATABASE__URL: run them with \
                 the same environment"
                    .into(),
            ),
            (_, Some(url)) => {
                parts.push(format!("--database-url {}", shell_quote(&url.redacted())));
                notes.push("the password is hidden: put yours in place of ***".into());
            }
            (_, None) => {}
        }
        CliHint {
            prefix: parts.join(" "),
            notes,
        }
    }

    pub(super) fn command(&self, rest: &str) -> String {
        format!("{} {rest}", self.prefix)
    }
}

/// Writes the embedded demo configuration to `vantage-demo.toml` in a new directory of its own
/// under `parent` (`vantage-demo-XXXXXX`, mode 0700, the file 0600, created new): never
/// through a planted symlink, never into a file someone else created (who could then change
/// the SQL the printed commands run). The directory is kept: the printed commands use it.
fn write_private_copy(parent: &Path) -> std::io::Result<std::path::PathBuf> {
    use std::io::Write as _;
    let mut builder = tempfile::Builder::new();
    builder.prefix("vantage-demo-");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        builder.permissions(std::fs::Permissions::from_mode(0o700));
    }
    let dir = builder.tempdir_in(parent)?.keep();
    let path = dir.join("vantage-demo.toml");
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(0o600);
    }
    let mut file = options.open(&path)?;
    file.write_all(EMBEDDED_CONFIG.as_bytes())?;
    file.sync_all()?;
    Ok(path)
}

/// This executable as the user can type it: relative to the working directory when it is
/// inside it (`target/release/vantage`), else its full path.
fn program() -> String {
    let Ok(exe) = std::env::current_exe() else {
        return "vantage".into();
    };
    let relative = std::env::current_dir()
        .ok()
        .and_then(|cwd| exe.strip_prefix(cwd).ok().map(Path::to_path_buf));
    match relative {
        Some(rel) if rel.components().count() > 1 => rel.display().to_string(),
        Some(rel) => format!("./{}", rel.display()),
        None => exe.display().to_string(),
    }
}

/// Quotes `s` for a POSIX shell when it holds anything but plainly safe characters.
fn shell_quote(s: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "@%+=:,./-_".contains(c);
    if !s.is_empty() && s.chars().all(safe) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 19, defect 11: the copy never follows a planted symlink nor reuses a file.
    #[cfg(unix)]
    #[test]
    fn the_config_copy_is_new_and_private() {
        use std::os::unix::fs::PermissionsExt as _;
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        // What an attacker plants where the old code wrote.
        std::os::unix::fs::symlink(&victim, tmp.path().join("vantage-demo.toml")).unwrap();
        let copy = write_private_copy(tmp.path()).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(std::fs::read_to_string(&copy).unwrap(), EMBEDDED_CONFIG);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&copy), 0o600);
        assert_eq!(mode(copy.parent().unwrap()), 0o700);
        assert!(!std::fs::symlink_metadata(&copy)
            .unwrap()
            .file_type()
            .is_symlink());
        let again = write_private_copy(tmp.path()).unwrap();
        assert_ne!(copy, again, "each run gets a directory of its own");
    }

    #[test]
    fn shell_quoting() {
        assert_eq!(shell_quote("postgres://u@h:5/db"), "postgres://u@h:5/db");
        assert_eq!(
            shell_quote("postgres://u:***@h/db"),
            "'postgres://u:***@h/db'"
        );
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
