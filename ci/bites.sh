#!/usr/bin/env bash
# Proves the regression tests bite: for each seeded bug in ci/bites.txt, plants it (KVTIER_SEEDED_BUG,
# read by kvtier's build script), builds its tests once, and requires each named test to FAIL with the
# expected text. A test that passes with its bug planted, fails without the text, or does not run at
# all fails the script.
#
# Usage: ci/bites.sh [BUG...]    (default: every bug in ci/bites.txt)
# The `bites` profile (Cargo.toml): the dependencies are optimized and built once; each bug rebuilds
# kvtier and the tests it names, unoptimized, into target/bites (release builds stay unseeded).
set -euo pipefail
cd "$(dirname "$0")/.."
export RUST_BACKTRACE=0
only=" $* "
mapfile -t rows < <(grep -vE '^\s*(#|$)' ci/bites.txt)
bugs=()
for row in "${rows[@]}"; do
    bug=${row%%|*}
    [[ $only != "  " && $only != *" $bug "* ]] && continue
    [[ " ${bugs[*]} " == *" $bug "* ]] || bugs+=("$bug")
done
fail=0
for bug in "${bugs[@]}"; do
    for row in "${rows[@]}"; do
        IFS='|' read -r b sel name expect <<<"$row"
        [[ $b == "$bug" ]] || continue
        # shellcheck disable=SC2086 # $sel is a list of cargo arguments
        if ! KVTIER_SEEDED_BUG="$bug" cargo test -q --profile bites $sel --no-run 2>/dev/null; then
            echo "FAIL: $sel does not build with seeded bug $bug"
            fail=1
            continue
        fi
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
done
exit $fail
