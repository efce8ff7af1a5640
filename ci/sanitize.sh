#!/usr/bin/env bash
# Sanitizer lane: the concurrent tests built with ThreadSanitizer (nightly `-Zsanitizer=thread`):
# the tier's threaded tests (tests/reliability.rs, tests/ranks.rs) and the index and free-list unit
# tests, whose threads race inserts, removes, migrations, pops and pushes. TSan stops a test at the
# first data race (two accesses, one a write, not ordered by happens-before), with both stacks.
# `address` (AddressSanitizer) instead stops at a heap use after free, double free or
# out-of-bounds access, with the stack of the access and of the free.
#
# Usage: ci/sanitize.sh [thread|address] [lane|bites|all]   (default: thread all; CI runs that)
#   lane: the tests must pass with no report; bites: each seeded bug below must make its test stop
#   with the sanitizer's report (a seeded bug is a `seeded("NAME")` branch of kvtier, src/seeded.rs:
#   compiled in by KVTIER_SEEDED_BUGS=1, read by its build script, so only kvtier is rebuilt, and
#   planted at run time by KVTIER_SEEDED_BUG=NAME).
# Env: SANITIZE_TARGET_DIR (default target/sanitize-KIND).
#
# Flags and why:
# --target x86_64-unknown-linux-gnu: the sanitizer instruments the tests and their crates only, not
#   build scripts and proc macros (which would then need the sanitizer runtime at build time).
# -Zbuild-std (thread only; needs rust-src, installed if missing): std is instrumented too, or
#   TSan misses the synchronisation inside std (Arc, Mutex, thread join) and reports false races.
# crossbeam-epoch under TSan: its build script sees the sanitizer (CARGO_CFG_SANITIZE) and sets
#   `crossbeam_sanitize_thread`, which replaces the fences TSan does not model by acquire loads it
#   does; so the epoch needs no suppression file.
# --cfg crossbeam_sanitize: crossbeam-epoch's own sanitizer mode: it collects garbage far more
#   eagerly (small bags, every pin tries to advance), so a node freed while a reader still holds
#   it is freed while that reader runs, where the sanitizer sees it.
# --release with debug assertions on: the threaded loops run at full length in seconds, and the
#   debug assertions (the invariants) stay.
# ASAN_OPTIONS detect_leaks=0: the epoch's global collector keeps garbage and thread handles alive
#   at exit by design (freed when the process ends).
# allocator_may_return_null=1: the index's huge-capacity test asks for 2^62 B and expects the
#   allocation to fail with a typed error (a sanitizer would stop the process instead).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never
kind=${1:-thread}
what=${2:-all}
target=x86_64-unknown-linux-gnu
export CARGO_TARGET_DIR=${SANITIZE_TARGET_DIR:-target/sanitize-$kind}

if ! rustup run nightly rustc --version > /dev/null 2>&1; then
    rustup toolchain install nightly --profile minimal
fi
build_std=()
if [[ $kind == thread ]]; then
    rustup +nightly component add rust-src
    build_std=(-Zbuild-std)
    export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 allocator_may_return_null=1"
fi
export RUSTFLAGS="-Zsanitizer=$kind --cfg crossbeam_sanitize"
export RUSTDOCFLAGS=$RUSTFLAGS
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:halt_on_error=1"
export RUST_BACKTRACE=0

# The same anchors as ci/miri.sh: the modules that define the index and the free list.
module_of() {
    local file
    file=$(grep -rlE "^\s*pub(\([a-z]+\))? struct $1\b" src --include='*.rs' | head -1)
    [[ -n $file ]] || { echo "ci/sanitize.sh: no struct $1 in src/" >&2; exit 1; }
    file=${file#src/}
    file=${file%.rs}
    file=${file%/mod}
    echo "${file//\//::}"
}
unit=("$(module_of BlockIndex)::" "$(module_of FreeList)::")
echo "sanitizer lane ($kind): tests/reliability.rs, tests/ranks.rs; unit tests matching ${unit[*]}"

start=$(date +%s)
# Release settings keep the threaded loops fast; debug assertions stay on (they are the invariants).
profile=(--release --config profile.release.debug-assertions=true --config profile.release.debug=1)
run() { cargo +nightly test "${build_std[@]}" --target "$target" -p kvtier "${profile[@]}" "$@"; }
fail=0
if [[ $what == all || $what == lane ]]; then
    run --lib --test reliability --test ranks --no-run
    echo "built in $(($(date +%s) - start)) s"
    run --test reliability --test ranks || fail=1
    run --lib -- "${unit[@]}" || fail=1
fi

# seeded bug | lib unit test (path below the index's module) | what the sanitizer must report.
# Thread only: TSan sees the free and the read unordered by happens-before on every run and reports
# it as a data race or, when the read came after the free, as a heap-use-after-free (both seen in
# CI: the report's kind depends on the interleaving); ASan sees
# the use after free only when the free lands inside the reader's short window, which the test does
# not force (measured: the test passes under ASan with the bug), so ASan has no bites.
bites=()
if [[ $kind == thread ]]; then
    bites+=("index-early-unpin|tests::lookups_race_removals_of_the_same_keys|ThreadSanitizer: (data race|heap-use-after-free)")
fi
if [[ $what == all || $what == bites ]]; then
    mkdir -p "$CARGO_TARGET_DIR"
    for b in ${bites[@]+"${bites[@]}"}; do
        IFS='|' read -r bug test want <<< "$b"
        test="${unit[0]}$test"
        log=$CARGO_TARGET_DIR/bite-$bug.log
        if KVTIER_SEEDED_BUGS=1 KVTIER_SEEDED_BUG=$bug run --lib -- --exact "$test" > "$log" 2>&1; then
            echo "FAIL: seeded bug $bug: $test passed under $kind sanitizer"
            fail=1
        elif grep -Eq "$want" "$log" && grep -q "${test##*::}" "$log"; then
            echo "ok: seeded bug $bug: $test stopped with \"$want\""
        else
            echo "FAIL: seeded bug $bug: $test failed without \"$want\" naming it:"
            tail -30 "$log"
            fail=1
        fi
    done
fi
[[ $fail == 0 ]] || { echo "sanitizer lane ($kind): FAILED"; exit 1; }
echo "sanitizer lane ($kind, $what): passed in $(($(date +%s) - start)) s"
