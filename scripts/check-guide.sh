#!/usr/bin/env bash
# Follows the README's "Build your own daemon binary" as a new user would: a fresh crate whose
# Cargo.toml is the guide's (with this checkout as the vantage dependency) and whose
# src/main.rs is the guide's Rust blocks, in order; then `cargo test` (the unit tests on the
# memory store, no PostgreSQL) and `cargo build` with warnings denied. Not part of `cargo test`:
# it compiles vantage a second time, in a target directory of its own (a few minutes).
#
#   scripts/check-guide.sh [WORK_DIR]     (default: a temporary directory, removed afterwards)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-}"
if [ -z "$work" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
fi
python3 - "$repo" "$work" <<'PY'
import os, re, sys
repo, work = sys.argv[1], sys.argv[2]
readme = open(os.path.join(repo, "README.md")).read()
start = readme.index("## Build your own daemon binary\n")
end = readme.index("\n## ", start + 10)
guide = readme[start:end]
toml = re.findall(r"```toml\n(.*?)```\n", guide, re.S)[0]
rust = re.findall(r"```rust\n(.*?)```\n", guide, re.S)
toml = toml.replace('path = "../vantage"', 'path = "%s"' % repo)
crate = os.path.join(work, "inventory-daemon")
os.makedirs(os.path.join(crate, "src"), exist_ok=True)
open(os.path.join(crate, "Cargo.toml"), "w").write(
    '[package]\nname = "inventory-daemon"\nversion = "0.1.0"\nedition = "2021"\n\n'
    '[workspace]\n\n' + toml)
open(os.path.join(crate, "src", "main.rs"), "w").write("\n".join(rust))
print(f"guide: {len(rust)} Rust blocks -> {crate}/src/main.rs")
PY
cd "$work/inventory-daemon"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$work/target}"
RUSTFLAGS="-D warnings" cargo test
RUSTFLAGS="-D warnings" cargo build
echo "the guide builds and its tests pass"
