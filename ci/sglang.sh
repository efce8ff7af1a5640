#!/usr/bin/env bash
# kvtier's SGLang HiCache backend (python/kvtier/sglang) under SGLang's own HiCache classes:
# sglang==0.5.23 from PyPI (no dependencies: its requirements pin CUDA builds) with the few
# packages its HiCache storage layer imports, over the torch of vLLM's CPU environment
# (ci/vllm-env.sh: a no-op when ci/vllm.sh already made it), then python/tests/test_sglang_hicache.py
# with KVTIER_REQUIRE_SGLANG=1 (a test that cannot run fails, never skips) and
# python/tests/test_sglang_store.py. SGLang's page hash is a C++ extension that torch compiles on
# first use (ninja, g++, OpenSSL's headers; about 15 s on 2 cores).
# Then the backend's seeded bugs: each, planted in a wheel built with KVTIER_PY_SEEDED_BUGS=1
# (ci/vllm.sh's, when it built one), must make its test fail with the expected text
# (ci/seeded-names.sh checks the names against python/kvtier/).
# What does not run here: an SGLang engine (CUDA builds on a GPU; on a CPU, sgl-kernel's CPU ops, not on PyPI).
# About 1.5 min on 2 cores when the wheels and vLLM's environment exist (ci/python.sh, ci/vllm.sh).
#
# Usage: ci/sglang.sh   Environment: CARGO_TARGET_DIR (cargo's; ci/vllm.sh's, to reuse its venv and
# seeded wheel), WHEEL (a built kvtier wheel; default target/wheels/kvtier-*.whl, where ci/python.sh
# leaves it, else built here), BITE_WHEEL (a seeded one; default $CARGO_TARGET_DIR/vllm-bite-wheel/
# from ci/vllm.sh, else built here).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
target=${CARGO_TARGET_DIR:-$repo/target}
# Absolute: the tests run from inside it (so python/kvtier, the sources, shadow nothing).
[[ $target = /* ]] || target=$repo/$target
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
step() { printf '\n--- %s (%s UTC)\n' "$1" "$(date -u +%T)"; }
sglang_pins=(sglang==0.5.23 orjson==3.13.0 ipython==9.19.1 traitlets==5.16.1 torchvision==0.29.2 gguf==0.19.0 ninja==1.13.2)

step "torch: vLLM's CPU environment (ci/vllm-env.sh) in $target/vllm-venv"
bash ci/vllm-env.sh "$target/vllm-venv"
py=$target/vllm-venv/bin/python

step "SGLang's HiCache layer in $target/sglang-site (pip --target, no dependencies)"
site=$target/sglang-site
if ! PYTHONPATH=$site "$py" -c 'import importlib.metadata as m; assert m.version("sglang") == "0.5.23"' 2>/dev/null; then
    rm -rf "$site"
    "$py" -m pip install -q --no-deps --target "$site" "${sglang_pins[@]}"
fi
if ! dpkg -s libssl-dev >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libssl-dev g++ >/dev/null
fi
"$py" -m pip install -q pytest==9.2.0

install_kvtier() { # WHEEL DIR
    rm -rf "$2"
    "$py" -m pip install -q --no-deps --target "$2" "$1"
}
maturin_build() { # OUT [env...]
    python3 -m venv "$target/sglang-build"
    "$target/sglang-build/bin/pip" install -q maturin==1.16.0
    "$target/sglang-build/bin/maturin" build --release -m python/Cargo.toml -o "$1"
}

step "the kvtier wheel"
wheel=${WHEEL:-$(ls "$repo"/target/wheels/kvtier-*.whl 2>/dev/null | head -1 || true)}
if [[ -z $wheel ]]; then
    maturin_build "$target/sglang-wheel"
    wheel=$(ls "$target"/sglang-wheel/kvtier-*.whl)
fi
echo "$wheel"
install_kvtier "$wheel" "$target/sglang-kvtier"

export PATH=$site/bin:$PATH TORCH_EXTENSIONS_DIR=$target/sglang-torch-ext
tests=$repo/python/tests
run_pytest() { # KVTIER_DIR args...
    local dir=$1
    shift
    (cd "$target" && PYTHONPATH="$dir:$site" "$py" -m pytest -q -p no:cacheprovider -W ignore::UserWarning "$@")
}

step "pytest: the backend under SGLang's HiCache classes, and without them"
KVTIER_REQUIRE_SGLANG=1 run_pytest "$target/sglang-kvtier" -rA "$tests/test_sglang_hicache.py" "$tests/test_sglang_store.py"

step "the backend's seeded bugs: each makes its test fail"
# bug | test (python/tests/...) | expected text in the failure
bites_table=(
    "sglang-set-keys-shifted|test_sglang_store.py::test_pages_saved_from_the_host_pool_come_back_byte_for_byte|restored bytes differ from the saved page"
    "sglang-get-drops-last|test_sglang_store.py::test_pages_saved_from_the_host_pool_come_back_byte_for_byte|restored bytes differ from the saved page"
)
bite=${BITE_WHEEL:-$(ls "$target"/vllm-bite-wheel/kvtier-*.whl 2>/dev/null | head -1 || true)}
if [[ -z $bite ]]; then
    KVTIER_PY_SEEDED_BUGS=1 maturin_build "$target/sglang-bite-wheel" >"$target/sglang-bite-build.log" 2>&1 \
        || { tail -20 "$target/sglang-bite-build.log"; echo "FAIL: the seeded wheel does not build"; exit 1; }
    bite=$(ls "$target"/sglang-bite-wheel/kvtier-*.whl)
fi
install_kvtier "$bite" "$target/sglang-kvtier-bites"
failed=0
for row in "${bites_table[@]}"; do
    IFS='|' read -r bug test expect <<<"$row"
    step "seeded bug $bug: $test must fail with \"$expect\""
    if KVTIER_PY_SEEDED_BUG="$bug" run_pytest "$target/sglang-kvtier-bites" "$tests/$test" >"$target/sglang-bite.log" 2>&1; then
        echo "FAIL: seeded bug $bug did NOT make $test fail"
        failed=1
    elif ! grep -qF -- "$expect" "$target/sglang-bite.log"; then
        tail -40 "$target/sglang-bite.log"
        echo "FAIL: $test failed with seeded bug $bug, but not with \"$expect\""
        failed=1
    else
        echo "ok: $(tail -1 "$target/sglang-bite.log")"
    fi
done
exit "$failed"
