//! Finding the server binaries (PATH, then Debian's versioned directories) and choosing the
//! user the server runs as.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use nix::unistd::{geteuid, User};

use super::error::ThrowawayError;

/// Where Debian (and derivatives) install versioned server binaries.
const DEBIAN_PG_ROOT: &str = "/usr/lib/postgresql";

pub(super) struct Binaries {
    pub(super) initdb: PathBuf,
    pub(super) postgres: PathBuf,
    pub(super) pg_isready: Option<PathBuf>,
}

pub(super) fn find_binaries() -> Option<Binaries> {
    let (initdb, postgres) = match (on_path("initdb"), on_path("postgres")) {
        (Some(initdb), Some(postgres)) => (initdb, postgres),
        _ => {
            let dir = debian_bin_dirs()
                .into_iter()
                .find(|d| is_executable(&d.join("initdb")) && is_executable(&d.join("postgres")))?;
            (dir.join("initdb"), dir.join("postgres"))
        }
    };
    // Symlinks such as /usr/local/bin/postgres lead to the real bin directory, where
    // pg_isready of the same version lives.
    let real_postgres = fs::canonicalize(&postgres).unwrap_or_else(|_| postgres.clone());
    let pg_isready = [real_postgres.parent(), postgres.parent()]
        .into_iter()
        .flatten()
        .map(|dir| dir.join("pg_isready"))
        .find(|p| is_executable(p))
        .or_else(|| on_path("pg_isready"));
    Some(Binaries {
        initdb: fs::canonicalize(&initdb).unwrap_or(initdb),
        postgres: real_postgres,
        pg_isready,
    })
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

/// `/usr/lib/postgresql/*/bin`, highest version first.
fn debian_bin_dirs() -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(DEBIAN_PG_ROOT) else {
        return Vec::new();
    };
    let mut versions: Vec<(Vec<u32>, PathBuf)> = entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            let version = name
                .to_str()?
                .split('.')
                .map(|part| part.parse().ok())
                .collect::<Option<Vec<u32>>>()?;
            Some((version, entry.path().join("bin")))
        })
        .collect();
    versions.sort_by(|a, b| b.0.cmp(&a.0));
    versions.into_iter().map(|(_, dir)| dir).collect()
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The database superuser name, and the uid/gid to switch to when we are root (the server
/// refuses to run as root).
pub(super) fn server_identity() -> Result<(String, Option<(u32, u32)>), ThrowawayError> {
    let euid = geteuid();
    if euid.is_root() {
        let user = User::from_name("postgres")
            .ok()
            .flatten()
            .ok_or(ThrowawayError::NoPostgresUser)?;
        return Ok((
            "postgres".to_owned(),
            Some((user.uid.as_raw(), user.gid.as_raw())),
        ));
    }
    let name = User::from_uid(euid)
        .ok()
        .flatten()
        .map(|u| u.name)
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "postgres".to_owned());
    Ok((name, None))
}
