#!/usr/bin/env bash
# Runs each fuzz target for SECONDS (default 60) and prints its executions.
# Installs cargo-fuzz if missing. cargo fuzz needs a nightly toolchain (it passes -Z flags): we use
# `+nightly` when rustup has one, else the stable toolchain with RUSTC_BOOTSTRAP=1.
#
# Usage: ci/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then targets=(trace_parser geometry tier_ops wire_frame wire_session peer_frame); fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    tc=(+nightly)
else
    tc=()
    export RUSTC_BOOTSTRAP=1
fi
# Debug assertions on (the tier's debug_asserts are invariant checks), ASan on.
jobs=${FUZZ_JOBS:-1}
fail=0
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t"
    work=$(mktemp -d)
    # Grow a scratch copy of the corpus; the committed seed corpus is not modified.
    cp -r "fuzz/corpus/$t/." "$work/"
    log=$(mktemp)
    start=$(date +%s)
    if cargo "${tc[@]}" fuzz run --debug-assertions "$t" "$work" -- \
        -max_total_time="$secs" -rss_limit_mb=4096 -max_len=4096 -print_final_stats=1 >"$log" 2>&1; then
        status=ok
    else
        status=FAILED
        fail=1
        grep -B2 -A30 "panicked\|ERROR: \|SUMMARY" "$log" | head -60
    fi
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
    printf 'fuzz %-14s %-6s %6s s  executions %s  %s  corpus %s files\n' "$t" "$status" "$(($(date +%s) - start))" \
        "${execs:-?}" "${cov:-}" "$(ls "$work" | wc -l)"
    rm -rf "$work" "$log"
done
exit $fail
