//! Golden files: what a command printed, with what changes from run to run replaced, compared
//! with `tests/golden/<name>` (`UPDATE_GOLDEN=1` rewrites them after review).

use std::path::{Path, PathBuf};

/// Replaces what changes from run to run: UUIDs, RFC 3339 timestamps, this host's name.
pub fn normalise(text: &str) -> String {
    let host = nix_hostname();
    let mut out = replace_uuids(text);
    out = replace_timestamps(&out);
    if !host.is_empty() {
        out = out.replace(&format!("@{host}"), "@<host>");
    }
    out
}

fn nix_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

fn replace_uuids(text: &str) -> String {
    let shape = [8, 4, 4, 4, 12];
    let bytes = text.as_bytes();
    let len = 36;
    let mut out = String::new();
    let mut i = 0;
    while i < bytes.len() {
        if i + len <= bytes.len() && is_uuid(&bytes[i..i + len], &shape) {
            out.push_str("<uuid>");
            i += len;
        } else {
            let ch = text[i..].chars().next().unwrap();
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn is_uuid(b: &[u8], shape: &[usize]) -> bool {
    let mut pos = 0;
    for (n, &group) in shape.iter().enumerate() {
        if n > 0 {
            if b[pos] != b'-' {
                return false;
            }
            pos += 1;
        }
        if !b[pos..pos + group].iter().all(u8::is_ascii_hexdigit) {
            return false;
        }
        pos += group;
    }
    true
}

/// `YYYY-MM-DDTHH:MM:SS(.fff)Z` → `<timestamp>`.
fn replace_timestamps(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::new();
    let mut i = 0;
    while i < b.len() {
        if let Some(end) = timestamp_at(b, i) {
            out.push_str("<timestamp>");
            i = end;
        } else {
            let ch = text[i..].chars().next().unwrap();
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn timestamp_at(b: &[u8], i: usize) -> Option<usize> {
    let pattern = b"dddd-dd-ddTdd:dd:dd";
    if i + pattern.len() > b.len() {
        return None;
    }
    for (k, p) in pattern.iter().enumerate() {
        let c = b[i + k];
        let ok = match p {
            b'd' => c.is_ascii_digit(),
            other => c == *other,
        };
        if !ok {
            return None;
        }
    }
    let mut end = i + pattern.len();
    if end < b.len() && b[end] == b'.' {
        end += 1;
        while end < b.len() && b[end].is_ascii_digit() {
            end += 1;
        }
    }
    if end < b.len() && b[end] == b'Z' {
        end += 1;
    }
    Some(end)
}

/// Compares `actual` (normalised) with `tests/golden/<name>`; `UPDATE_GOLDEN=1` rewrites it.
#[track_caller]
pub fn assert_golden(name: &str, actual: &str) {
    let path: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    let actual = normalise(actual);
    if std::env::var("UPDATE_GOLDEN").is_ok_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read golden file {} ({e}); run with UPDATE_GOLDEN=1 to create it",
            path.display()
        )
    });
    assert_eq!(
        actual,
        expected,
        "output differs from {} (UPDATE_GOLDEN=1 rewrites it after review)",
        path.display()
    );
}
