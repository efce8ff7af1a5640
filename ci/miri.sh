#!/usr/bin/env bash
# Miri lane: the unit tests of the content index, the free list and the slot word run under Miri,
# which reports undefined behaviour (use after free, data races, invalid aliasing, misaligned or
# out-of-bounds accesses) on every path those tests take, including the threaded ones.
#
# Usage: ci/miri.sh [FILTER...]   (default: the modules that define BlockIndex, FreeList, SlotWord)
# Env: PROPTEST_CASES (default 4, for property tests a module may add), MIRIFLAGS (replaces ours), MIRI_TEST_ARGS (more libtest
# arguments, e.g. `-Zunstable-options --report-time`). Miri builds into target/miri.
#
# Which tests: the module of each anchor type, found in src/ (`struct BlockIndex` in src/index/mod.rs
# is the module `index`, so the filter `index::`; a move of the file moves the filter), so the lane
# follows a restructure. The tests cut their loop counts under `cfg(miri)` and mark what Miri cannot
# run in minutes `#[cfg_attr(miri, ignore = "reason")]`.
#
# What is installed when missing: the nightly toolchain (minimal profile) and its `miri` and
# `rust-src` components (rustup; Miri builds its own sysroot from rust-src on first use).
# If rustup cannot reach its server, run `ci/miri.sh --valgrind`: the same tests at full size, the
# release test binary (debug assertions off), under valgrind memcheck (installed with apt-get if
# missing; measured: 10 s of tests); memcheck finds reads of freed or uninitialised memory, not data
# races or aliasing.
#
# MIRIFLAGS and why:
# -Zmiri-tree-borrows: crossbeam-epoch 0.9 breaks the Stacked Borrows rules (it re-borrows its
#   `Local` through a shared reference: crossbeam issue 545; crossbeam's own Miri CI turns Stacked
#   Borrows off for it); Tree Borrows accepts that pattern and still checks our aliasing.
# -Zmiri-permissive-provenance: crossbeam-epoch's tagged pointers cast integers to pointers;
#   strict provenance would stop there, this keeps checking with exposed provenance, warning-free.
# -Zmiri-ignore-leaks: the epoch's global collector keeps deferred garbage and thread-local
#   handles alive at exit (crossbeam issue 579); the index frees its own tables on drop, and
#   memcheck in --valgrind mode covers leaks.
# -Zmiri-disable-isolation: tests may read the clock (and proptest its regressions file).
# -Zmiri-many-seeds is not used: one seed per run keeps the lane inside its time.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
mode=miri
if [[ ${1:-} == --valgrind ]]; then mode=valgrind; shift; fi

# The module path (crate-relative, `::`-joined) of the file defining `struct NAME` in src/.
module_of() {
    local file
    file=$(grep -rlE "^\s*pub(\([a-z]+\))? struct $1\b" src --include='*.rs' | head -1)
    [[ -n $file ]] || { echo "ci/miri.sh: no struct $1 in src/" >&2; exit 1; }
    file=${file#src/}
    file=${file%.rs}
    file=${file%/mod}
    echo "${file//\//::}"
}
if [[ $# -gt 0 ]]; then
    filters=("$@")
else
    filters=()
    for anchor in BlockIndex FreeList SlotWord; do filters+=("$(module_of "$anchor")::"); done
fi
echo "miri lane ($mode): unit tests matching ${filters[*]}"
export PROPTEST_CASES=${PROPTEST_CASES:-4}

if [[ $mode == valgrind ]]; then
    command -v valgrind > /dev/null || apt-get install -y valgrind
    bin=$(cargo test --release -p kvtier --lib --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["executable"])' | tail -1)
    exec valgrind --tool=memcheck --error-exitcode=1 --leak-check=no --track-origins=no -q \
        "$bin" --test-threads=2 "${filters[@]}"
fi

if ! rustup run nightly cargo miri --version > /dev/null 2>&1; then
    rustup toolchain install nightly --profile minimal
    rustup +nightly component add miri rust-src
fi
export MIRIFLAGS=${MIRIFLAGS:--Zmiri-tree-borrows -Zmiri-permissive-provenance -Zmiri-ignore-leaks -Zmiri-disable-isolation}
echo "MIRIFLAGS=$MIRIFLAGS PROPTEST_CASES=$PROPTEST_CASES"
cargo +nightly miri setup
start=$(date +%s)
# shellcheck disable=SC2086
cargo +nightly miri test -p kvtier --lib -- "${filters[@]}" ${MIRI_TEST_ARGS:-}
echo "miri lane: passed in $(($(date +%s) - start)) s"
