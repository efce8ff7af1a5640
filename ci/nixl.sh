#!/usr/bin/env bash
# The NIXL runtime for the `nixl` feature's tests (tests/peer_nixl.rs) and benchmark (benches/peer.rs).
#
# `nixl-sys` is built with its `stub-api` feature: it needs libclang (bindgen) to build, and loads
# `libnixl_capi.so` and NIXL's UCX plugin at run time. Both come from PyPI's wheel `nixl-cu12`
# (NIXL, its plugins and its own UCX; no GPU is needed for host-memory transfers). This script
# installs libclang-dev (Debian) if missing and the wheel into target/nixl (idempotent: a second run
# downloads nothing), then prints the environment a test run needs.
#
# Usage:  bash ci/nixl.sh           installs, then prints `export ...` lines (eval "$(bash ci/nixl.sh)")
#         source ci/nixl.sh         installs and exports into the current shell
# Debian's own UCX (libucx0) must stay off the library path: the wheel's plugin is built against its
# bundled UCX.
(return 0 2>/dev/null) && nixl_sourced=1 || nixl_sourced=0
nixl_main() {
    set -euo pipefail
    local root version=1.5.1
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    local dir="$root/target/nixl"
    if ! [[ -e /usr/lib/llvm-14/lib/libclang.so || -n $(ls /usr/lib/llvm-*/lib/libclang.so 2>/dev/null) ]]; then
        echo "ci/nixl.sh: installing libclang-dev (bindgen, for nixl-sys)" >&2
        apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libclang-dev >&2
    fi
    local site="$dir/site"
    if [[ ! -f $site/.installed-$version ]]; then
        echo "ci/nixl.sh: installing nixl-cu12==$version into $site" >&2
        rm -rf "$site" "$dir/wheel"
        mkdir -p "$dir/wheel"
        python3 -m pip download -q --no-deps "nixl-cu12==$version" -d "$dir/wheel" >&2
        python3 -m pip install -q --no-deps --no-compile --target "$site" "$dir"/wheel/nixl_cu12-*.whl >&2
        rm -rf "$dir/wheel"
        touch "$site/.installed-$version"
    fi
    local libs="$site/.nixl_cu12.mesonpy.libs"
    [[ -f $libs/libnixl_capi.so ]] || { echo "ci/nixl.sh: $libs/libnixl_capi.so missing" >&2; return 1; }
    # UCX finds its loadable transport modules (cma, ib, cuda) as lib*.so.0 in the `ucx` folder next
    # to libucs (nixl_cu12.libs/ucx); the wheel ships only the fully versioned names.
    local m
    for m in "$site"/nixl_cu12.libs/ucx/*.so.0.0.0; do
        [[ -e $m ]] || continue
        [[ -e ${m%.0.0} ]] || ln -s "$(basename "$m")" "${m%.0.0}"
    done
    echo "export LD_LIBRARY_PATH=$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
    echo "export NIXL_PLUGIN_DIR=$libs/plugins"
    # Without an RDMA device, UCX's ib module is of no use, and the libnl-route the wheel bundles
    # for it crashes in its exit handler (SIGSEGV in rtnl_tc_unregister after main returns): keep
    # UCX from loading it.
    if [[ -z $(ls /sys/class/infiniband 2>/dev/null) ]]; then
        echo "export UCX_MODULES=^ib"
    fi
}
if [[ $nixl_sourced == 1 ]]; then
    nixl_exports=$( (nixl_main) ) || return 1
    eval "$nixl_exports"
    unset nixl_exports
else
    nixl_main
fi
unset nixl_sourced
