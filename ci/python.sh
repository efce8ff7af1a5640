#!/usr/bin/env bash
# The Python package: builds the abi3 wheel with maturin, checks it (size, tags, no torch or CUDA
# dependency), installs it into a fresh virtual environment with pinned test dependencies, and runs
# the CPU pytest suite (python/tests: the host backend, every error kind, the GIL tests, the
# thread-deadlock scenarios, the arena storage checks, and the tiny-Llama end-to-end test with
# torch + transformers). GPU tests skip without CUDA.
#
# Usage: ci/python.sh [--no-torch] [bites]
#   --no-torch: skip installing torch and transformers (about 3.5 GB, 1.5 min); the end-to-end test
#               and the torch storage tests then skip.
#   bites:      instead of the suite, show that each seeded bug of the binding makes its tests
#               FAIL with the expected message: one more wheel, built with every seeded bug compiled
#               in (KVTIER_PY_SEEDED_BUGS=1, read by python/build.rs: the private cfg
#               `kvtier_py_seeded_bugs`), each bug then planted at run time by
#               KVTIER_PY_SEEDED_BUG=NAME (python/src/seeded.rs; ci/seeded-names.sh checks the names).
# Environment: PYTHON (default python3), CARGO_TARGET_DIR (cargo's), WHEEL_DIR (default
# target/wheels: the wheel is left there).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
py=${PYTHON:-python3}
wheels=${WHEEL_DIR:-$repo/target/wheels}
torch_pins=(torch==2.11.0 transformers==5.17.0)
test_pins=(pytest==9.2.0 numpy==2.4.6)
maturin_pin=maturin==1.16.0
with_torch=1
bites=0
for arg in "$@"; do
    case $arg in
    --no-torch) with_torch=0 ;;
    bites) bites=1 ;;
    *)
        echo "usage: ci/python.sh [--no-torch] [bites]"
        exit 2
        ;;
    esac
done

# The virtual environments and pip's unpacking go on the build disk, not /tmp (a tmpfs on some
# machines is smaller than torch's wheels).
mkdir -p "$repo/target"
work=$(mktemp -d "$repo/target/python.XXXXXX")
trap 'rm -rf "$work"' EXIT
export TMPDIR=$work/tmp PIP_NO_CACHE_DIR=1
mkdir -p "$TMPDIR"
# torch 2.11 from PyPI with its CUDA wheels takes about 5.6 GB installed; pip needs room to unpack.
torch_needs_gb=9
step() { printf '\n--- %s (%s UTC)\n' "$1" "$(date -u +%T)"; }

step "the NIXL runtime and libclang (ci/nixl.sh), for the wheel's peers"
# The wheel is built with the cargo feature `peers` (nixl-sys's stub API: libclang to build, the
# NIXL runtime loaded at run time); the peer tests (test_peers.py) then run, and must not skip.
eval "$(bash "$repo/ci/nixl.sh")"
export KVTIER_REQUIRE_NIXL=1

step "build the wheel (maturin, release, abi3, --features peers)"
"$py" -m venv "$work/build"
"$work/build/bin/pip" install -q --disable-pip-version-check "$maturin_pin"
rm -f "$wheels"/kvtier-*.whl
"$work/build/bin/maturin" build --release -m python/Cargo.toml --features peers -o "$wheels"
wheel=$(ls "$wheels"/kvtier-*.whl)

step "check the wheel"
bytes=$(stat -c %s "$wheel")
echo "$(basename "$wheel"): $bytes B"
if ((bytes >= 2000000)); then
    echo "FAIL: the wheel is $bytes B; the target is under 2 MB"
    exit 1
fi
case $(basename "$wheel") in
*-cp310-abi3-manylinux_*_x86_64.whl) ;;
*)
    echo "FAIL: expected a cp310-abi3 manylinux wheel"
    exit 1
    ;;
esac
unzip -q -o "$wheel" -d "$work/unpacked"
if grep '^Requires-Dist:' "$work"/unpacked/kvtier-*.dist-info/METADATA | grep -v 'extra =='; then
    echo "FAIL: the wheel has runtime dependencies"
    exit 1
fi
needed=$(readelf -d "$work"/unpacked/kvtier/_kvtier*.so | grep NEEDED || true)
echo "$needed"
if grep -Eiq 'libcuda|libnvrtc|libtorch|libpython' <<<"$needed"; then
    echo "FAIL: the extension links CUDA, torch or libpython (it must load CUDA at run time)"
    exit 1
fi

step "install into a fresh virtual environment"
"$py" -m venv "$work/test"
pip=("$work/test/bin/pip" install -q --disable-pip-version-check)
start=$(date +%s)
"${pip[@]}" "$wheel" "${test_pins[@]}"
if ((with_torch)); then
    free_gb=$(($(df --output=avail -k "$work" | tail -1) / 1000000))
    if ((free_gb < torch_needs_gb)); then
        echo "SKIPPED: torch + transformers need about $torch_needs_gb GB of disk and $free_gb GB are free:"
        echo "         the end-to-end and torch storage tests below skip (the rest of the suite runs)"
        with_torch=0
    else
        "${pip[@]}" "${torch_pins[@]}"
    fi
fi
echo "installed in $(($(date +%s) - start)) s"
# Outside the source tree, so `kvtier` is the installed package.
cd "$work"
"$work/test/bin/python" - <<'EOF'
import time
t0 = time.perf_counter()
import kvtier
g = kvtier.Geometry.preset("llama3-8b", 1024)
tier = kvtier.Tier(g, 4 << 30)
print(f"import + 4 GiB tier: {time.perf_counter() - t0:.3f} s ({tier})")
EOF

if ((bites)); then
    # seeded bug | tests (under python/tests) | text the failure must show
    # A deadlock scenario fails when its child process hangs (faulthandler's "Timeout (" dump);
    # KVTIER_TEST_HANG_S shortens that bound. One scenario per hang bug: each waits out the bound.
    bites_table=(
        "close-waits-holding-gil|test_threads.py::test_close_while_another_thread_drains|Timeout ("
        "close-timeout-releases-tensors|test_threads.py::test_close_with_a_timeout_while_a_call_is_held_keeps_the_rank_for_good|a timed-out close released the tensors"
        "lease-drop-inline|test_threads.py::test_a_lease_collected_while_another_thread_holds_the_connection|no reply from the daemon within"
        "round-trip-holds-gil|test_threads.py::test_every_daemon_round_trip_releases_the_gil|kept the GIL across its round trip"
        "no-arena-check|test_arenas.py|DID NOT RAISE"
        "evict-count-usize|test_remote.py::test_evict_takes_any_count_and_clamps_it|OverflowError"
        "rank-drop-holds-gil|test_threads.py::test_a_rank_collected_unclosed_drains_without_the_gil|no reply from the daemon within"
        "exceeds-memory-untyped|test_errors.py::test_a_pool_larger_than_memory_raises_pool_exceeds_memory_error|kvtier.errors.PoolError"
        "ssd-stats-unmapped|test_ssd.py::test_evicted_blocks_come_back_from_the_ssd_in_one_lease_over_both_tiers|'NoneType' object is not subscriptable"
        "record-save-ignored|test_hybrid.py::test_a_checkpoint_whose_attention_prefix_was_evicted_goes_before_a_usable_one|the checkpoint no restore can use went first"
        "ssd-error-untyped|test_ssd.py::test_a_file_of_another_geometry_is_refused_and_left_untouched|kvtier.errors.KvtierError: "
        "py-query-skips-peers|test_peers.py::test_a_tier_with_a_peer_leases_the_peers_blocks_and_the_next_hit_is_local|the local block, then the peer's three after it"
    )
    failed=0
    bash "$repo/ci/seeded-names.sh" || failed=1
    step "build the wheel with the seeded bugs (KVTIER_PY_SEEDED_BUGS=1)"
    rm -rf "$work/bite-wheel"
    if ! KVTIER_PY_SEEDED_BUGS=1 "$work/build/bin/maturin" build --release -m "$repo/python/Cargo.toml" \
        --features peers -o "$work/bite-wheel" >"$work/bite-build.log" 2>&1; then
        tail -20 "$work/bite-build.log"
        echo "FAIL: the wheel does not build with the seeded bugs"
        exit 1
    fi
    "${pip[@]}" --force-reinstall --no-deps "$work"/bite-wheel/kvtier-*.whl
    for row in "${bites_table[@]}"; do
        IFS='|' read -r bug tests expect <<<"$row"
        step "seeded bug $bug: $tests must fail with \"$expect\""
        read -r -a selection <<<"$tests"
        selection[0]="$repo/python/tests/${selection[0]}"
        if KVTIER_PY_SEEDED_BUG="$bug" KVTIER_TEST_HANG_S=60 "$work/test/bin/python" -m pytest -q -p no:cacheprovider \
            "${selection[@]}" >"$work/bite.log" 2>&1; then
            echo "FAIL: seeded bug $bug did NOT make $tests fail"
            failed=1
        elif ! grep -qF -- "$expect" "$work/bite.log"; then
            tail -40 "$work/bite.log"
            echo "FAIL: $tests failed with seeded bug $bug, but not with \"$expect\""
            failed=1
        else
            echo "ok: $(tail -1 "$work/bite.log")"
        fi
    done
    "${pip[@]}" --force-reinstall --no-deps "$wheel"
    exit "$failed"
fi

step "pytest (CPU)"
"$work/test/bin/python" -m pytest -q -p no:cacheprovider "$repo/python/tests"
