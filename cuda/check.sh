#!/usr/bin/env bash
# CI check of the CUDA kernels without a GPU: compile cuda/kvtier_copy.cu with NVRTC (as the crate
# does at run time) for sm_80 and sm_90, then assemble the PTX with ptxas for those targets and print
# the resource use. NVRTC and ptxas come from NVIDIA's PyPI wheels, installed into
# $KVT_NVTOOLS (default: target/nvtools) on first use. Exits non-zero on any failure.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tools=${KVT_NVTOOLS:-$here/../target/nvtools}
site=$tools/site
if [ ! -x "$site/nvidia/cuda_nvcc/bin/ptxas" ] || ! ls "$site"/nvidia/cuda_nvrtc/lib/libnvrtc.so.* >/dev/null 2>&1; then
    echo "installing nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvcc-cu12 (PyPI) into $site"
    mkdir -p "$site"
    python3 -m pip install -q --disable-pip-version-check --target "$site" nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12
fi
nvrtc=$(ls "$site"/nvidia/cuda_nvrtc/lib/libnvrtc.so.* | head -n1)
ptxas=$site/nvidia/cuda_nvcc/bin/ptxas
export LD_LIBRARY_PATH=$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
echo "cuda/check.sh: NVRTC $nvrtc; ptxas: $("$ptxas" --version | tail -n1)"; echo
for arch in sm_80 sm_90; do
    python3 "$here/nvrtc_compile.py" "$nvrtc" "$arch" "$out/k_$arch.ptx"
    "$ptxas" -arch="$arch" -v -o "$out/k_$arch.cubin" "$out/k_$arch.ptx" 2>&1 | grep -E "Compiling entry|Used|spill" | sed 's/^ptxas info *: /  /'
    # Spills would put the copy loop's in-flight registers in local memory.
    if "$ptxas" -arch="$arch" -v -o /dev/null "$out/k_$arch.ptx" 2>&1 | grep -E "[1-9][0-9]* bytes spill" >/dev/null; then
        echo "cuda/check.sh: FAIL: register spills for $arch"; exit 1
    fi
    echo "  ptxas $arch: ok"
done
echo "cuda/check.sh: kernels compile for sm_80 and sm_90"
