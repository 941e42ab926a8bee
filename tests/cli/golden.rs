//! The normalisation the golden files of `tests/golden/` rely on.

use crate::support::normalise;

#[test]
fn normalise_replaces_uuids_timestamps() {
    assert_eq!(
        normalise("id 6f1c1a8e-5f4e-4c59-9d59-0d3b8f1c2a01 at 2024-05-01T10:11:12.345Z, 2024-05-01T10:11:12Z."),
        "id <uuid> at <timestamp>, <timestamp>."
    );
}
