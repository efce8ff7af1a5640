"""The real-model end-to-end test on a GPU: a randomly initialised Llama-3-8B-shaped model (bf16,
sdpa), a 7,936-token prefix saved through kvtier, the GPU pages filled with NaN, the prefix
restored into other shuffled pages, the 256-token suffix run alone: logits bitwise equal to the
cold run's, 32 greedy tokens identical, restored pages byte-identical. Skipped without CUDA.
Needs about 30 GB of GPU memory. Runs `python -m kvtier.examples.llama_restore` in a process of its
own, so its deterministic-kernel settings (cuBLAS workspace, set before CUDA starts) apply."""

import json
import os
import subprocess
import sys

import pytest

import kvtier

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and kvtier.cuda_available()), reason="needs a CUDA GPU"
)


def test_llama3_8b_shape_restored_prefix_gives_bitwise_equal_logits(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "kvtier.examples.llama_restore", "--prefix", "7936", "--repeats", "1"]
    p = subprocess.run(cmd + ["--json", str(out)], capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert out.exists(), p.stderr[-2000:]
    r = json.loads(out.read_text())["results"][0]
    print(r["ttft_ms"], r["restore_gbps"])
    assert r["checks"]["logits_bitwise_equal"]
    assert r["checks"]["greedy_tokens_equal"] and len(r["greedy_tokens"]) == 32
    assert r["checks"]["restored_pages_byte_identical"]
    assert r["checks"]["logits_finite"]
    assert all(r["checks"].values()), r["checks"]
    assert r["prefix_pages"] == 496 and r["restore_bytes"] == 496 * 64 * 32768
    assert p.returncode == 0, p.stderr[-2000:]
