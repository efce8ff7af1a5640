#!/usr/bin/env bash
# Proves the regression tests bite: builds the tests that ci/bites.txt names ONCE with every seeded
# bug compiled in (KVTIER_SEEDED_BUGS=1, read by the build scripts of kvtier, the CLI and the daemon; see
# src/seeded.rs), then for each row runs its test with that row's bug planted at run time
# (KVTIER_SEEDED_BUG=NAME, inherited by the kvtierd and kvtier processes the tests start, which
# are the same build) and requires it to FAIL with the expected text. A test that passes with its
# bug planted, fails without the text, or does not run at all fails the script, as does a bug name
# that has no seeded branch or a seeded branch in no table (ci/seeded-names.sh).
#
# Usage: ci/bites.sh [BUG...]    (default: every bug in ci/bites.txt)
# The `bites` profile (Cargo.toml): the dependencies optimized, the workspace's crates unoptimized,
# into target/bites (release builds stay unseeded).
set -euo pipefail
cd "$(dirname "$0")/.."
export RUST_BACKTRACE=0 KVTIER_SEEDED_BUGS=1
unset KVTIER_SEEDED_BUG
fail=0
bash ci/seeded-names.sh || fail=1
only=" $* "
mapfile -t rows < <(grep -vE '^\s*(#|$)' ci/bites.txt)
picked=()
sels=()
declare -A seen built
for row in "${rows[@]}"; do
    IFS='|' read -r bug sel _ <<<"$row"
    [[ $only != "  " && $only != *" $bug "* ]] && continue
    picked+=("$row")
    [[ -n ${seen[$sel]:-} ]] || sels+=("$sel")
    seen[$sel]=1
done
start=$(date +%s)
for sel in "${sels[@]}"; do
    # shellcheck disable=SC2086 # $sel is a list of cargo arguments
    if cargo test -q --profile bites $sel --no-run 2>/dev/null; then
        built[$sel]=1
    else
        echo "FAIL: $sel does not build with the seeded bugs"
        fail=1
    fi
done
echo "bites: built ${#sels[@]} test selections with the seeded bugs in $(($(date +%s) - start)) s"
start=$(date +%s)
for row in "${picked[@]}"; do
    IFS='|' read -r bug sel name expect <<<"$row"
    [[ -n ${built[$sel]:-} ]] || continue
    log=$(mktemp)
    # The test is expected to fail: its outcome is read from the log.
    # shellcheck disable=SC2086
    KVTIER_SEEDED_BUG="$bug" cargo test -q --profile bites $sel -- "$name" >"$log" 2>&1 || true
    if ! grep -qE "test result: FAILED\. [0-9]+ passed; [1-9][0-9]* failed" "$log"; then
        if grep -qE "test result: ok\. [1-9]" "$log"; then
            echo "FAIL: seeded bug $bug did NOT make $name fail"
        else
            echo "FAIL: $name did not run with seeded bug $bug"
            tail -n 20 "$log"
        fi
        fail=1
    elif msg=$(grep -F -m1 -- "$expect" "$log"); then
        printf 'bites: %-28s %s: %s\n' "$bug" "$name" "$(cut -c1-160 <<<"$msg")"
    else
        echo "FAIL: $name failed with seeded bug $bug, but not with \"$expect\":"
        grep -m3 -A3 "panicked at" "$log" || tail -n 20 "$log"
        fail=1
    fi
    rm -f "$log"
done
echo "bites: ran ${#picked[@]} rows in $(($(date +%s) - start)) s"
exit $fail
