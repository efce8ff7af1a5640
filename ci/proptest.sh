#!/usr/bin/env bash
# Runs (debug build: the tier's debug_asserts stay on) the property-test suite (tier state machine vs reference model, slab, geometry) with
# PROPTEST_CASES cases per property (default 10000) and the kept regression sequences.
# Usage: ci/proptest.sh [CASES]
set -euo pipefail
cd "$(dirname "$0")/.."
export PROPTEST_CASES=${1:-${PROPTEST_CASES:-10000}}
start=$(date +%s)
cargo test --test state_machine -- --test-threads=2
echo "proptest: $PROPTEST_CASES cases per property, $(($(date +%s) - start)) s (incl. build)"
