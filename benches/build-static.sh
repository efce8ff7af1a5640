#!/usr/bin/env bash
# Builds the CPU benchmark binaries (index, slab, tier) as static x86-64 Linux executables that run
# on a machine without a Rust toolchain or a matching glibc, stripped of debug info but keeping their
# symbols (for profilers), into DIR (default: target/cpu-bench-bin).
#
#   bash benches/build-static.sh [DIR]
#   DIR/index --help          # every option; DIR/index --quick runs in seconds
#
# Needs the static C library (Debian/Ubuntu: libc6-dev). Uses its own target folder
# (target/static) so it never invalidates the ordinary build.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/cpu-bench-bin}
triple=x86_64-unknown-linux-gnu
export CARGO_TARGET_DIR=target/static
# --target keeps the flags off build scripts and proc macros (they must stay dynamic).
RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
    cargo bench -p kvtier --target "$triple" --no-run --bench index --bench slab --bench tier \
    --message-format json-render-diagnostics >target/static-build.json
mkdir -p "$out"
for b in index slab tier; do
    exe=$(grep -o "\"executable\":\"[^\"]*/deps/$b-[^\"]*\"" target/static-build.json | tail -1 | cut -d'"' -f4)
    [[ -n $exe ]] || { echo "no executable for bench $b" >&2; exit 1; }
    cp "$exe" "$out/$b"
    strip --strip-debug "$out/$b"
done
file "$out"/* | sed 's/, BuildID[^,]*//'
ls -l "$out"
