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
            None => {
                let copy = std::env::temp_dir().join("vantage-demo.toml");
                match std::fs::write(&copy, EMBEDDED_CONFIG) {
                    Ok(()) => {
                        notes.push(format!(
                            "{} is a copy of the demo configuration built into this binary",
                            copy.display()
                        ));
                        Some(copy)
                    }
                    Err(e) => {
                        notes.push(format!(
                            "replay needs the demo perspectives' configuration, which could not \
                             be written to {}: {e}",
                            copy.display()
                        ));
                        None
                    }
                }
            }
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
