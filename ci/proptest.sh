#!/usr/bin/env bash
# Property tests: the tier state machine against its reference model, the slab, the geometry
# validator, plus the kept regression sequences (tests/state_machine.rs). Debug build, so the tier's
# debug_asserts stay on.
#
# Usage: ci/proptest.sh [CASES]      run with CASES cases per property (default 10000)
#        ci/proptest.sh bites [CASES] show the state machine catches the seeded bugs reachable
#                                    without concurrency (each must make it fail; default 2000 cases),
#                                    then run the test bites below
#        ci/proptest.sh test-bites [BUG...]  only the test bites (or those of the seeded bugs named): each
#                                    seeded bug must make its (non-proptest) regression test fail with
#                                    the expected panic message
set -euo pipefail
cd "$(dirname "$0")/.."

# seeded bug | cargo test target (`lib`: the unit tests) | test name | expected panic message (substring)
test_bites=(
    "submit-panic-releases|reliability|a_backend_that_panics_in_save_after_queuing_quarantines_the_slot|the slot under the queued copy must be quarantined, not freed"
    "submit-panic-releases|reliability|a_backend_that_panics_in_restore_after_queuing_keeps_its_pins|the pin under the queued copy must be kept, not dropped"
    "wait-panic-releases|reliability|a_panicking_completion_quarantines_its_slots_and_the_rank_keeps_working|a copy whose outcome is unknown must keep its slots"
    "use-returned-to-settled-lease|lib|a_use_given_back_after_another_rank_took_the_last_is_served|a claimed use may still come back"
    "unfit-save-evicts|tier|slot_acquisition_that_cannot_be_satisfied_evicts_nothing|every block is still resident"
    "lease-expiry-ignores-age|reliability|a_forgotten_lease_expires_under_pool_pressure|a lease younger than the TTL was expired"
    "evict-while-free|lib|a_slot_freed_during_claiming_replaces_a_claim|a block was evicted while a slot was free"
    "lease-pins-repeated-key|lib|a_lease_holds_at_most_one_pin_per_slot|the lease stops at the first repeated key"
    "evict-unclamped|tier|an_evict_of_any_size_returns_sanely_and_later_saves_still_evict|capacity overflow"
    "lock-poisons|lib|a_panic_under_the_eviction_lock_does_not_poison_it|a tier lock was poisoned by an earlier panic"
    "insert-log-hole|lib|sieve::tests::a_commit_half_way_into_the_log_does_not_hide_a_later_one|the block behind the hole is offered"
    "insert-log-hole|lib|s3fifo::tests::a_commit_half_way_into_the_log_does_not_hide_a_later_one|the block behind the hole is offered"
)

# Release builds (the tests' dependencies are built once in target/release); one rebuild of kvtier
# and the test target per seeded bug.
run_test_bites() {
    local fail=0 only=" $* "
    for b in "${test_bites[@]}"; do
        IFS='|' read -r bug target name expect <<<"$b"
        if [[ $only != "  " && $only != *" $bug "* ]]; then continue; fi
        local sel=(--test "$target")
        [[ $target == lib ]] && sel=(--lib)
        if ! KVTIER_SEEDED_BUG="$bug" cargo test -p kvtier -q --release "${sel[@]}" --no-run 2>/dev/null; then
            echo "FAIL: $target does not build with seeded bug $bug"
            fail=1
            continue
        fi
        local log
        log=$(mktemp)
        # The test is expected to fail: its status is read from the log.
        KVTIER_SEEDED_BUG="$bug" RUST_BACKTRACE=0 cargo test -p kvtier -q --release "${sel[@]}" -- "$name" \
            >"$log" 2>&1 || true
        if grep -q "test result: ok. 1 passed" "$log"; then
            echo "FAIL: seeded bug $bug did NOT make $target::$name fail"
            fail=1
        elif ! grep -q "1 failed" "$log"; then
            echo "FAIL: $target::$name did not run with seeded bug $bug"
            tail -n 20 "$log"
            fail=1
        elif msg=$(grep -F -m1 -- "$expect" "$log"); then
            printf 'bites: %-32s %s::%s: %s\n' "$bug" "$target" "$name" "$msg"
        else
            echo "FAIL: $target::$name with seeded bug $bug failed, but not with \"$expect\":"
            tail -n 20 "$log"
            fail=1
        fi
        rm -f "$log"
    done
    return $fail
}

if [[ ${1:-} == test-bites ]]; then
    shift
    run_test_bites "$@"
    exit $?
fi
if [[ ${1:-} == bites ]]; then
    export PROPTEST_CASES=${2:-2000} RUST_BACKTRACE=0 PROPTEST_DISABLE_FAILURE_PERSISTENCE=1
    fail=0
    # Seeded bugs are the private cfg `kvtier_seeded_bug`, set through kvtier's build script.
    for feature in pin-writing guard-borrows-lease-pin lease-first-consume-settles requeue-claimed-victim; do
        KVTIER_SEEDED_BUG="$feature" cargo test -p kvtier -q --test state_machine --no-run 2>/dev/null
        log=$(mktemp)
        if KVTIER_SEEDED_BUG="$feature" cargo test -p kvtier -q --test state_machine tier_matches_reference_model \
            >"$log" 2>&1; then
            echo "FAIL: seeded bug $feature did NOT make the state machine fail"
            fail=1
        else
            msg=$(grep -m1 "^Test failed:" "$log" | cut -c1-160)
            ops=$(sed -n '/^minimal failing input/,/^\]/p' "$log" | tr -s ' \n' ' ' | cut -c1-400)
            echo "bites: $feature: $msg"
            echo "       $ops"
        fi
        rm -f "$log"
    done
    run_test_bites || fail=1
    exit $fail
fi
export PROPTEST_CASES=${1:-${PROPTEST_CASES:-10000}}
start=$(date +%s)
cargo test -p kvtier --test state_machine -- --test-threads=2
echo "proptest: $PROPTEST_CASES cases per property, $(($(date +%s) - start)) s (incl. build)"
