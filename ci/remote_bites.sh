#!/usr/bin/env bash
# Seeded bugs of the shared pool and the connected tier's client: each must make its test fail with
# the expected panic message (the tests: kvtier's unit tests `pool::shared` and `remote::client`,
# kvtierd's daemon/tests/client_safety.rs).
#
# Usage: ci/remote_bites.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export RUST_BACKTRACE=0

# The panic messages of a test log: each "panicked at" line's message, up to the next note/blank line.
panic_messages() {
    awk '/panicked at/ { grab = 1; next } /^note:|^$|^thread / { grab = 0 } grab' "$1"
}

# seeded bug (a value of the cfg `kvtier_seeded_bug`, see Cargo.toml [lints.rust]) | cargo test
# target arguments | test name | expected panic message (substring)
bites=(
    "unsealed-pool|-p kvtier --features remote --lib|pool::shared::tests::a_shared_pool_is_size_sealed_before_it_is_shared|left: 0"
    "unsealed-pool|-p kvtierd --test client_safety|a_client_cannot_resize_the_pool_under_the_others|UnsealedSharedPool"
    "attach-unsealed|-p kvtier --features remote --lib|pool::shared::tests::attach_refuses_an_unsealed_or_short_file|called \`Result::unwrap_err()\` on an \`Ok\` value"
    "forked-child-unchecked|-p kvtier --features remote --lib|remote::client::tests::a_call_from_another_process_is_refused_before_anything_is_sent|called \`Result::unwrap_err()\` on an \`Ok\` value"
    "forked-child-unchecked|-p kvtierd --test client_safety|a_forked_child_is_refused_before_it_sends_anything|each bit: a call the child was refused"
    "client-sends-oversized|-p kvtier --features remote --lib|remote::client::tests::a_request_over_the_frame_limit_is_refused_before_anything_is_sent|protocol misuse: encoding Query"
    "client-sends-oversized|-p kvtierd --test client_safety|a_request_over_the_frame_limit_is_refused_and_the_connection_goes_on|protocol misuse: encoding Query"
    "daemon-uid-unchecked|-p kvtierd --test client_safety|a_socket_served_by_another_uid_is_refused_before_the_hello|connecting to a socket of uid 65534"
)
fail=0
for b in "${bites[@]}"; do
    IFS='|' read -r bug target name expect <<<"$b"
    # shellcheck disable=SC2086 # $target is a list of arguments
    if ! KVTIER_SEEDED_BUG="$bug" cargo test -q --release $target --no-run 2>/dev/null; then
        echo "FAIL: $target does not build with seeded bug $bug"
        fail=1
        continue
    fi
    log=$(mktemp)
    # shellcheck disable=SC2086
    if KVTIER_SEEDED_BUG="$bug" cargo test -q --release $target -- --exact "$name" >"$log" 2>&1; then
        echo "FAIL: seeded bug $bug did NOT make $name fail"
        fail=1
    else
        msgs=$(panic_messages "$log")
        if msg=$(grep -F -m1 -- "$expect" <<<"$msgs"); then
            printf 'bites: %-24s %s: %s\n' "$bug" "$name" "$msg"
        else
            echo "FAIL: $name with seeded bug $bug failed, but not with \"$expect\":"
            sed -n 1,5p <<<"$msgs"
            tail -n 20 "$log"
            fail=1
        fi
    fi
    rm -f "$log"
done
exit $fail
