#!/usr/bin/env bash
# Runs every loom model (loom-tests/*.rs registered as `loom_*` tests in Cargo.toml), then proves each
# model bites: with its seeded bug enabled the model must build and then FAIL with the panic message
# that bug is expected to cause (any other failure, or a pass, fails the script).
#
# Usage: ci/loom.sh [models|bites|all] [TARGET...]   (default all; TARGETs such as `loom_index`
#        restrict both the models and the bites to those test targets)
# Env: LOOM_MAX_PREEMPTIONS (default 2), LOOM_TARGET_DIR (default target/loom). The bites use one
# build of the selected models with every seeded bug compiled in (KVTIER_SEEDED_BUGS=1, read by
# kvtier's build script: it rebuilds kvtier and the models only, the dependencies are built once),
# each bug then planted at run time by KVTIER_SEEDED_BUG=NAME (src/seeded.rs).
# Recipe (facts.md section 5): --cfg loom --cfg crossbeam_loom --cfg crossbeam_sanitize, our `loom`
# feature (which enables crossbeam-epoch/loom), --release, a target dir of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
shift || true
only=" $* "
loom_flags="--cfg loom --cfg crossbeam_loom --cfg crossbeam_sanitize"
export RUSTFLAGS="$loom_flags"
export LOOM_MAX_PREEMPTIONS=${LOOM_MAX_PREEMPTIONS:-2}
export CARGO_TARGET_DIR=${LOOM_TARGET_DIR:-target/loom}
export RUST_BACKTRACE=0
unset KVTIER_SEEDED_BUGS KVTIER_SEEDED_BUG

# Only the loom test targets are built under the loom cfgs (ordinary tests panic there).
targets=()
for f in loom-tests/*.rs; do
    name="loom_$(basename "$f" .rs)"
    if [[ $only != "  " && $only != *" $name "* ]]; then continue; fi
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

# The panic messages of a test log: each "panicked at" line's message, up to the next note/blank line.
panic_messages() {
    awk '/panicked at/ { grab = 1; next } /^note:|^$|^thread / { grab = 0 } grab' "$1"
}

# seeded bug (a `seeded("NAME")` branch of kvtier, see src/seeded.rs; ci/seeded-names.sh checks the
# names) | test target | test name (empty: the whole target) | expected panic message (substring)
bites=(
    "evict-pinned|loom_lease|query_pin_holds_off_eviction|unpin of unpinned slot"
    "lease-double-settle|loom_lease|settle_exactly_once|unpin of unpinned slot"
    "lease-first-consume-settles|loom_lease|shared_lease_serves_every_rank|each rank has a use, yet its restore failed"
    "restore-use-before-pin|loom_lease|shared_lease_serves_every_rank|each rank has a use, yet its restore failed"
    "guard-borrows-lease-pin|loom_guard|lease_settled_during_copy_keeps_slot|evicted a slot under an in-flight copy"
    "pin-writing|loom_guard|reserved_slot_invisible_until_commit|Causality violation"
    "evict-pinned|loom_evict|evict_vs_pin_vs_lookup|unpin of unpinned slot"
    "demotion-unpinned|loom_ssd|demotion_pin_holds_off_eviction|a demotion read a block that was evicted under it"
    "promotion-commit-unpinned|loom_ssd|promoted_block_is_pinned_from_its_commit|a promoted block was evictable before its lease pinned it"
    "evict-pinned|loom_ssd|pinned_disk_slot_is_never_rewritten|unpin of unpinned slot"
    "stale-generation|loom_evict|stale_lookup_after_reuse_fails|no longer holds key A"
    "plan-finishing-in-flight|loom_evict|plan_racing_an_eviction_being_finished|never in flight"
    "probation-promotion-racy|loom_policy|probation_counts_survive_racing_hits_2q|make room for 9 pages"
    "refusal-under-shared-hold|loom_evict|a_save_beside_a_save_that_cannot_fit_is_not_refused|the save must get a slot"
    "escalation-keeps-claims|loom_evict|a_save_beside_a_save_that_cannot_fit_is_not_refused|the save must get a slot"
    "requeue-claimed-victim|loom_policy|acquire_races_a_query_pin_sieve|eviction policy contract broken: on_remove"
    "hinted-never-evicted|loom_policy|hinted_block_goes_only_when_nothing_else_can_lru|the survivor is offered (lru)"
    "interior-withheld|loom_policy|an_interior_block_is_offered_when_no_leaf_can_go_lru|an unpinned block exists, yet the save got no slot (lru)"
    "freelist-aba|loom_freelist|aba_two_threads_one_shard|Causality violation: Concurrent read and write accesses"
    "freelist-missed-pop|loom_freelist|pop_racing_push_and_pop_finds_an_id|pop returned None although an id was on the list throughout"
    "index-early-unpin|loom_index|remove_races_get_with_reclamation|use after free: read of a reclaimed index entry"
    "use-returned-to-settled-lease|loom_lease|a_failed_submission_keeps_the_use|the retry of a restore whose submission failed was refused"
    "filing-drops-unready|loom_policy|commit_races_a_selection_lru|the other committed block is offered (lru)"
    "filing-drops-unready|loom_policy|commit_races_a_selection_adaptive_lfu|the other committed block is offered (adaptive-lfu)"
    "insert-log-hole|loom_policy|commit_races_a_selection_sieve|a committed, unpinned block exists, yet the save got no slot (sieve)"
    "insert-log-hole|loom_policy|commit_races_a_selection_s3fifo|a committed, unpinned block exists, yet the save got no slot (s3fifo)"
    "hint-race|loom_policy|a_hint_racing_its_keys_reservation_is_kept|the hinted block was evicted first although an unhinted one was evictable"
    "mark-stack-flag-early|loom_policy|a_mark_pushed_again_during_a_drain_is_not_lost|a pushed mark was never drained"
    "victim-order-marks-lost|loom_policy|commit_races_a_selection_lru|a committed, unpinned block exists, yet the save got no slot (lru)"
    "victim-order-marks-lost|loom_policy|commit_races_a_selection_adaptive_lfu|a committed, unpinned block exists, yet the save got no slot (adaptive-lfu)"
    "hybrid-pin-unchecked|loom_hybrid|query_racing_a_checkpoint_eviction|holds 0 blocks of its range"
    "hybrid-lease-drops-state|loom_hybrid|query_racing_a_checkpoint_eviction|a hybrid lease's block"
    "cold-mark-unchecked|loom_hybrid|cold_mark_racing_its_blocks_eviction|a cold mark is counted only while its block is resident"
    "mark-stack-clear-unordered|loom_policy|a_cancel_racing_the_drain_of_its_queued_mark_is_not_lost|a resident, unpinned slot was never offered again"
)
if [[ $what == all || $what == bites ]]; then
    bash ci/seeded-names.sh || fail=1
    # The models, built once with every seeded bug compiled in; each bite plants one at run time.
    export KVTIER_SEEDED_BUGS=1
    start=$(date +%s.%N)
    if ! cargo test -p kvtier -q --release --features loom "${test_args[@]}" --no-run 2>/dev/null; then
        echo "FAIL: the loom models do not build with the seeded bugs"
        exit 1
    fi
    printf 'loom: built %s with the seeded bugs in %.0f s\n' "${targets[*]}" "$(echo "$(date +%s.%N) - $start" | bc)"
    for b in "${bites[@]}"; do
        IFS='|' read -r bug target name expect <<<"$b"
        if [[ ! " ${targets[*]} " == *" $target "* ]]; then
            echo "skip: $target not selected or not present (seeded bug $bug)"
            continue
        fi
        start=$(date +%s.%N)
        log=$(mktemp)
        if KVTIER_SEEDED_BUG="$bug" cargo test -p kvtier -q --release --features loom --test "$target" \
            -- --test-threads=1 $name >"$log" 2>&1; then
            echo "FAIL: seeded bug $bug did NOT make $target${name:+::$name} fail"
            fail=1
        else
            # Not `panic_messages | grep -q`: grep would exit at the first match and, with pipefail,
            # the writer's SIGPIPE would fail the test.
            msgs=$(panic_messages "$log")
            if msg=$(grep -F -m1 -- "$expect" <<<"$msgs"); then
                printf 'bites: %-40s %s%s (run %.1f s): %s\n' "$bug" "$target" "${name:+::$name}" \
                    "$(echo "$(date +%s.%N) - $start" | bc)" "$msg"
            else
                echo "FAIL: $target${name:+::$name} with seeded bug $bug failed, but not with \"$expect\":"
                sed -n 1,5p <<<"$msgs"
                tail -n 20 "$log"
                fail=1
            fi
        fi
        rm -f "$log"
    done
fi
exit $fail
