#!/usr/bin/env bash
# Runs every loom model (loom-tests/*.rs registered as `loom_*` tests in Cargo.toml), then proves each
# model bites: with its seeded bug enabled the model must build and then FAIL.
#
# Usage: ci/loom.sh [models|bites|all]   (default all)
# Env: LOOM_MAX_PREEMPTIONS (default 2), LOOM_TARGET_DIR (default target/loom).
# Recipe (facts.md section 5): --cfg loom --cfg crossbeam_loom --cfg crossbeam_sanitize, our `loom`
# feature (which enables crossbeam-epoch/loom), --release, a target dir of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
export RUSTFLAGS="--cfg loom --cfg crossbeam_loom --cfg crossbeam_sanitize"
export LOOM_MAX_PREEMPTIONS=${LOOM_MAX_PREEMPTIONS:-2}
export CARGO_TARGET_DIR=${LOOM_TARGET_DIR:-target/loom}
export RUST_BACKTRACE=0

# Only the loom test targets are built under the loom cfgs (ordinary tests panic there).
targets=()
for f in loom-tests/*.rs; do
    name="loom_$(basename "$f" .rs)"
    if grep -q "^name = \"$name\"" Cargo.toml; then targets+=("$name"); fi
done
test_args=()
for t in "${targets[@]}"; do test_args+=(--test "$t"); done
echo "loom targets: ${targets[*]} (LOOM_MAX_PREEMPTIONS=$LOOM_MAX_PREEMPTIONS)"

fail=0
if [[ $what == all || $what == models ]]; then
    cargo test -p kvtier --release --features loom "${test_args[@]}" --no-run 2>&1 | grep -v "^\s*Compiling" || true
    for t in "${targets[@]}"; do
        start=$(date +%s.%N)
        if ! cargo test -p kvtier -q --release --features loom --test "$t" -- --test-threads=1; then
            echo "FAIL: loom model $t"
            fail=1
        fi
        printf 'loom %-16s %6.1f s\n' "$t" "$(echo "$(date +%s.%N) - $start" | bc)"
    done
fi

# seeded bug feature | test target | test name (empty: the whole target)
bites=(
    "seeded-bug-evict-pinned|loom_lease|query_pin_holds_off_eviction"
    "seeded-bug-lease-double-settle|loom_lease|settle_exactly_once"
    "seeded-bug-lease-first-consume-settles|loom_lease|shared_lease_serves_every_rank"
    "seeded-bug-guard-borrows-lease-pin|loom_guard|lease_dropped_during_copy_keeps_slot"
    "seeded-bug-pin-writing|loom_guard|reserved_slot_invisible_until_commit"
    "seeded-bug-evict-pinned|loom_evict|evict_vs_pin_vs_lookup"
    "seeded-bug-stale-generation|loom_evict|stale_lookup_after_reuse_fails"
    "seeded-bug-freelist-aba|loom_freelist|aba_two_threads_one_shard"
    "seeded-bug-index-early-unpin|loom_index|remove_races_get_with_reclamation"
)
if [[ $what == all || $what == bites ]]; then
    for b in "${bites[@]}"; do
        IFS='|' read -r feature target name <<<"$b"
        if [[ ! " ${targets[*]} " == *" $target "* ]]; then
            echo "skip: $target not present (seeded bug $feature)"
            continue
        fi
        if ! cargo test -p kvtier -q --release --features "loom,$feature" --test "$target" --no-run 2>/dev/null; then
            echo "FAIL: $target does not build with $feature"
            fail=1
            continue
        fi
        start=$(date +%s.%N)
        log=$(mktemp)
        if cargo test -p kvtier -q --release --features "loom,$feature" --test "$target" -- --test-threads=1 $name >"$log" 2>&1; then
            echo "FAIL: seeded bug $feature did NOT make $target${name:+::$name} fail"
            fail=1
        elif grep -q "panicked at" "$log"; then
            msg=$(grep -A1 "panicked at" "$log" | grep -v "panicked at\|^--" | head -1)
            printf 'bites: %-40s %s%s (%.1f s): %s\n' "$feature" "$target" "${name:+::$name}" \
                "$(echo "$(date +%s.%N) - $start" | bc)" "$msg"
        else
            echo "FAIL: $target with $feature exited non-zero without a model failure:"
            tail -20 "$log"
            fail=1
        fi
        rm -f "$log"
    done
fi
exit $fail
