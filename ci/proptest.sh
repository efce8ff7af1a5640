#!/usr/bin/env bash
# Property tests: the tier state machine against its reference model, the slab, the geometry
# validator, plus the kept regression sequences (tests/state_machine.rs). Debug build, so the tier's
# debug_asserts stay on.
#
# Usage: ci/proptest.sh [CASES]      run with CASES cases per property (default 10000)
#        ci/proptest.sh bites [CASES] show the state machine catches the seeded bugs reachable
#                                    without concurrency (each must make it fail; default 2000 cases)
set -euo pipefail
cd "$(dirname "$0")/.."
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
    # Layer-wise readiness (src/copy/layers.rs): a layer wait that returns before its group is
    # copied must fail the host backend's per-layer test (the GPU test bites on it too).
    for feature in layer-ready-early; do
        log=$(mktemp)
        if KVTIER_SEEDED_BUG="$feature" cargo test -p kvtier -q --lib a_layer_wait_makes_its_group_ready \
            >"$log" 2>&1; then
            echo "FAIL: seeded bug $feature did NOT make the layer-wise test fail"
            fail=1
        else
            echo "bites: $feature: $(grep -m1 '^assertion' "$log" | cut -c1-160)"
        fi
        rm -f "$log"
    done
    exit $fail
fi
export PROPTEST_CASES=${1:-${PROPTEST_CASES:-10000}}
start=$(date +%s)
cargo test -p kvtier --test state_machine -- --test-threads=2
echo "proptest: $PROPTEST_CASES cases per property, $(($(date +%s) - start)) s (incl. build)"
