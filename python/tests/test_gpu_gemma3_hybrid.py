"""The hybrid end-to-end test on a GPU: a randomly initialised Gemma-3-1B-shaped text model (bf16,
sdpa; 26 layers, 4 full attention, 22 sliding over 512 tokens), its full-attention pages one
kvtier cache group and its sliding pages another, CUDA ranks. A 4,096-token prefix saved (all 256
full-attention blocks, the 32 window blocks of the sliding layers), every GPU page filled with NaN,
the prefix restored into other shuffled pages, the 256-token suffix run alone: logits bitwise equal
to the cold run's, 16 greedy tokens identical, restored pages byte-identical. Skipped without CUDA.
Needs about 8 GB of GPU memory. Runs `python -m kvtier.examples.hybrid_cache` in a process of its
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


def test_gemma3_1b_shape_restored_window_gives_bitwise_equal_logits(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "kvtier.examples.hybrid_cache", "--config", "gemma3-1b", "--prefix", "4096",
           "--suffix", "256", "--greedy", "16", "--repeats", "3", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert out.exists(), p.stderr[-3000:]
    data = json.loads(out.read_text())
    r = data["results"][0]
    print(data["environment"].get("gpu"), r["ttft_ms"], r["stock_cache"], r["restore_bytes"], r["all_layers_bytes"])
    assert r["checks"]["logits_bitwise_equal"]
    assert r["checks"]["greedy_tokens_equal"] and len(r["greedy_tokens"]) == 16
    assert r["checks"]["restored_pages_byte_identical"]
    assert r["checks"]["logits_finite"]
    assert all(r["checks"].values()), r["checks"]
    # 256 blocks; the 512-token window before the boundary is blocks 224..255.
    assert r["prefix_blocks"] == 256 and r["window_blocks"] == [224, 256]
    assert r["saved_blocks"] == [256, 32] and r["restored_blocks"][1] >= 32
    # Slots: 4 full layers x K, V x 8,192 B; 22 sliding layers x K, V x 8,192 B.
    assert data["environment"]["group_slot_bytes"] == [65536, 360448]
    assert r["restore_bytes"] == 256 * 65536 + 32 * 360448
    assert r["all_layers_bytes"] == 256 * (65536 + 360448)
    assert p.returncode == 0, p.stderr[-3000:]
