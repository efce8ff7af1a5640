"""The real-model end-to-end test on a GPU: a randomly initialised Llama-3-8B-shaped model (bf16,
sdpa), a 7,936-token prefix saved through kvtier, the GPU pages filled with NaN, the prefix
restored into other shuffled pages, the 256-token suffix run alone: logits bitwise equal to the
cold run's, 32 greedy tokens identical, restored pages byte-identical. Skipped without CUDA.
Needs about 30 GB of GPU memory. The timings are `python -m kvtier.examples.llama_restore`."""

import pytest

import kvtier

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and kvtier.cuda_available()), reason="needs a CUDA GPU"
)


def test_llama3_8b_shape_restored_prefix_gives_bitwise_equal_logits():
    import os

    from kvtier.examples.llama_restore import Bench

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)

    bench = Bench("llama3-8b", "cuda", max_prefix=7936, suffix=256, greedy=32, seed=0)
    try:
        r = bench.run_case(7936, repeats=1, warmup=1)
        print(r["ttft_ms"], r["restore_gbps"])
        assert r["checks"]["logits_bitwise_equal"]
        assert r["checks"]["greedy_tokens_equal"] and len(r["greedy_tokens"]) == 32
        assert r["checks"]["restored_pages_byte_identical"]
        assert r["checks"]["logits_finite"]
        assert all(r["checks"].values()), r["checks"]
        assert r["prefix_pages"] == 496 and r["restore_bytes"] == 496 * 64 * 32768
    finally:
        bench.close()
        torch.use_deterministic_algorithms(deterministic)
