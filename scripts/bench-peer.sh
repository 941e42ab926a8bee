#!/usr/bin/env bash
# Runs vantage bench (main drain only) and the apalis-postgres peer (bench/apalis-peer) on one
# PostgreSQL, with the same events, streams, concurrency, batch size and payload, one after the
# other, and prints `vantage/apalis ratio: <x.xx>`.
#
#   scripts/bench-peer.sh [--events N] [--streams S] [--consumers K] [--batch-size B] [--payload-bytes P]
#
# With DATABASE_URL set it uses that database (schemas vantage_bench, apalis and apalis_peer are
# dropped and recreated there). Without it, it starts a throwaway cluster in a temporary
# directory with the settings of vantage's throwaway server (fsync off) plus
# pg_stat_statements, and removes it at exit.
set -euo pipefail

events=200000 streams=2000 consumers=4 batch=500 payload=64
while [ $# -gt 0 ]; do
    case "$1" in
        --events) events=$2 ;;
        --streams) streams=$2 ;;
        --consumers) consumers=$2 ;;
        --batch-size) batch=$2 ;;
        --payload-bytes) payload=$2 ;;
        *) echo "bench-peer.sh: unknown option $1" >&2; exit 2 ;;
    esac
    shift 2
done

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
main_target=${CARGO_TARGET_DIR:-$root/target}
peer_target=${PEER_TARGET_DIR:-$root/bench/apalis-peer/target}

echo "building vantage bench and the apalis peer (release)..." >&2
cargo build --release --bin vantage >&2
CARGO_TARGET_DIR=$peer_target cargo build --release --manifest-path bench/apalis-peer/Cargo.toml >&2

cleanup() { :; }
if [ -z "${DATABASE_URL:-}" ]; then
    bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
    [ -x "$bindir/initdb" ] || { echo "bench-peer.sh: no PostgreSQL server binaries; set DATABASE_URL" >&2; exit 2; }
    dir=$(mktemp -d "${TMPDIR:-/tmp}/vantage-peer-XXXXXX")
    as_pg=()
    user=$(id -un)
    if [ "$(id -u)" = 0 ]; then
        chown postgres "$dir"; as_pg=(runuser -u postgres --); user=postgres
    fi
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    "${as_pg[@]}" "$bindir/initdb" -D "$dir/data" -U "$user" -A trust >/dev/null
    "${as_pg[@]}" "$bindir/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w start -o \
        "-h 127.0.0.1 -p $port -k $dir -c fsync=off -c synchronous_commit=off -c full_page_writes=off \
         -c max_connections=300 -c shared_buffers=128MB -c shared_preload_libraries=pg_stat_statements" >/dev/null
    cleanup() { "${as_pg[@]}" "$bindir/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true; rm -rf "$dir"; }
    export DATABASE_URL="postgres://$user@127.0.0.1:$port/postgres"
    echo "throwaway PostgreSQL on 127.0.0.1:$port" >&2
fi
trap cleanup EXIT

common=(--events "$events" --streams "$streams")
vantage_out=$("$main_target/release/vantage" bench "${common[@]}" --consumers "$consumers" \
    --batch-size "$batch" --payload-bytes "$payload" --checks none)
echo "$vantage_out" >&2
apalis_out=$("$peer_target/release/apalis-peer" "${common[@]}" --concurrency "$consumers" \
    --batch-size "$batch" --payload-bytes "$payload")
echo "$apalis_out" >&2

vantage=$(echo "$vantage_out" | sed -n 's/^vantage: \([0-9.]*\)$/\1/p' | tail -1)
apalis=$(echo "$apalis_out" | sed -n 's/^apalis: \([0-9.]*\)$/\1/p' | tail -1)
[ -n "$vantage" ] && [ -n "$apalis" ] || { echo "bench-peer.sh: a run printed no figure" >&2; exit 1; }
awk -v v="$vantage" -v a="$apalis" 'BEGIN { printf "vantage/apalis ratio: %.2f\n", (a > 0 ? v / a : 0) }'
