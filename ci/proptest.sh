#!/usr/bin/env bash
# Property tests: the tier state machine against its reference model, the slab, the geometry
# validator, plus the kept regression sequences (tests/state_machine.rs). Debug build, so the tier's
# debug_asserts stay on.
#
# Usage: ci/proptest.sh [CASES]      run with CASES cases per property (default 10000)
#        ci/proptest.sh bites [CASES] show the state machine catches the seeded bugs reachable
#                                    without concurrency (each must make it fail; default 2000 cases);
#                                    the regression tests' bites are ci/bites.sh
set -euo pipefail
cd "$(dirname "$0")/.."
unset KVTIER_SEEDED_BUGS KVTIER_SEEDED_BUG

if [[ ${1:-} == bites ]]; then
    export PROPTEST_CASES=${2:-2000} RUST_BACKTRACE=0 PROPTEST_DISABLE_FAILURE_PERSISTENCE=1
    fail=0
    bash ci/seeded-names.sh || fail=1
    # One build with every seeded bug compiled in (KVTIER_SEEDED_BUGS=1, read by kvtier's build
    # script: it rebuilds kvtier and the test only), each bug then planted at run time by
    # KVTIER_SEEDED_BUG (src/seeded.rs; ci/seeded-names.sh checks the names).
    export KVTIER_SEEDED_BUGS=1
    bites_bugs=(
        pin-writing
        guard-borrows-lease-pin
        lease-first-consume-settles
        requeue-claimed-victim
        victim-order-marks-lost
        filing-drops-unready
        protect-hinted-ignored
        interior-withheld
        lone-selection-takes-one-shard
        probation-room-ignores-free
    )
    if ! cargo test -p kvtier -q --test state_machine --no-run 2>/dev/null; then
        echo "FAIL: the state machine does not build with the seeded bugs"
        exit 1
    fi
    for feature in "${bites_bugs[@]}"; do
        log=$(mktemp)
        if KVTIER_SEEDED_BUG="$feature" cargo test -p kvtier -q --test state_machine tier_matches_reference_model \
            >"$log" 2>&1; then
            echo "FAIL: seeded bug $feature did NOT make the state machine fail"
            fail=1
        elif ! grep -q "^Test failed:" "$log"; then
            # No proptest report: the process aborted before shrinking ended. A broken invariant
            # found again by a destructor that runs while the thread unwinds from the first (a
            # save's claims given back) panics a second time, and Rust aborts then: the bug was
            # caught (its first panic is in the log), without a minimal input. Anything else (no
            # panic at all: a crash) fails.
            first=$(grep -m1 -A1 "panicked at" "$log" | tail -1 | cut -c1-160 || true)
            if grep -q "panic in a destructor during cleanup" "$log" && [[ -n $first ]]; then
                echo "bites: $feature: (aborted while unwinding, no minimal input) $first"
            else
                echo "FAIL: seeded bug $feature made the state machine fail without a panic report:"
                tail -n 5 "$log"
                fail=1
            fi
        else
            msg=$(grep -m1 "^Test failed:" "$log" | cut -c1-160)
            ops=$(sed -n '/^minimal failing input/,/^\]/p' "$log" | tr -s ' \n' ' ' | cut -c1-400)
            echo "bites: $feature: $msg"
            echo "       $ops"
        fi
        rm -f "$log"
    done
    exit $fail
fi
export PROPTEST_CASES=${1:-${PROPTEST_CASES:-10000}}
start=$(date +%s)
cargo test -p kvtier --test state_machine -- --test-threads=2
echo "proptest: $PROPTEST_CASES cases per property, $(($(date +%s) - start)) s (incl. build)"
