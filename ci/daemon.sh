#!/usr/bin/env bash
# The tier daemon under hostile clients (daemon/tests/hostile.rs) and the seeded bugs its tests must
# catch: each bug is planted with KVTIER_SEEDED_BUG (kvtier's build script), and the named test must
# then fail with the expected message.
#
# Usage: ci/daemon.sh          the hostile-client suite and the daemon's unit tests
#        ci/daemon.sh bites [BUG...]   each seeded daemon bug (or the ones named) makes its test fail
set -euo pipefail
cd "$(dirname "$0")/.."
export RUST_BACKTRACE=0
if [[ ${1:-} == bites ]]; then
    shift
    only=" $* "
    fail=0
    # bug | test target (lib or a daemon test file) | test name | expected message
    while IFS='|' read -r bug target test msg; do
        [[ -z $bug ]] && continue
        [[ $# -gt 0 && $only != *" $bug "* ]] && continue
        if [[ $target == lib ]]; then
            cmd=(cargo test --release -p kvtier --features remote --lib "$test" -- --exact "remote::$test")
        else
            cmd=(cargo test --release -p kvtierd --test "$target" -- --exact "$test")
        fi
        log=$(mktemp)
        if KVTIER_SEEDED_BUG="$bug" "${cmd[@]}" >"$log" 2>&1; then
            echo "FAIL: seeded bug $bug did NOT make $target::$test fail"
            fail=1
        elif grep -qF "$msg" "$log"; then
            echo "bites: $bug: $target::$test: $msg"
        else
            echo "FAIL: seeded bug $bug made $target::$test fail without \"$msg\":"
            grep -m3 "panicked at" -A3 "$log" || tail -5 "$log"
            fail=1
        fi
        rm -f "$log"
    done <<'BITES'
session-drop-skips-close|lib|server::tests::a_session_dropped_by_an_unwinding_thread_withholds_its_writes_and_drops_its_leases|the live writer's slots are withheld
request-panic-unwinds|hostile|a_panicking_request_fails_alone_and_the_sessions_slots_and_leases_stay_sound|a reply
sequential-lease-ids|hostile|lease_ids_cannot_be_guessed_and_another_runs_token_is_refused|opened by guessing
frame-prealloc|lib|proto::tests::a_length_prefix_alone_allocates_nothing_near_its_length|reserved for 60 B that arrived
session-outlives-process|hostile|connect_then_fork_then_kill_9_of_the_parent_ends_its_session|the session of the killed parent ends
hints-outlive-connection|hostile|hints_leases_and_copies_are_bounded_per_connection_and_go_with_it|the connection's hints and leases are gone
frame-prealloc|hostile|a_length_prefix_alone_makes_the_daemon_hold_no_memory|16 length prefixes grew the daemon
bind-deletes-anything|hostile|bind_replaces_only_a_stale_socket_and_makes_it_private|bind took the path of a regular file
spawn-failure-stops-daemon|hostile|a_connection_whose_thread_cannot_start_is_refused_and_the_daemon_goes_on|the refusal does not say a thread could not start
misuse-untyped|hostile|garbage_truncated_and_out_of_order_frames_get_typed_answers|misuse not answered Protocol
oversized-frame-closes|hostile|oversized_frames_and_requests_over_a_bound_are_refused_and_the_connection_kept|a reply
no-connection-limit|hostile|connections_over_the_limit_are_refused_and_silent_ones_closed_at_the_hello_deadline|a fourth connection was served
no-write-timeout|hostile|a_client_that_never_reads_its_replies_is_dropped_with_everything_it_held|the lease and the hint are gone
BITES
    # Build the normal crate again so later steps do not pick up a seeded build.
    cargo build --release -p kvtierd -q
    exit $fail
fi
cargo test --release -p kvtier --features remote --lib remote::
cargo test --release -p kvtierd --test hostile --test api --test remote
