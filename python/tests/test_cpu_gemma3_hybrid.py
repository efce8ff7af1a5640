"""The hybrid end-to-end protocol on a CPU: a tiny randomly initialised Gemma-3 text model (bf16,
sdpa; 12 layers, 10 sliding over 48 tokens, full attention at layers 5 and 11) whose full-attention
pages form one kvtier cache group and sliding-window pages another, host ranks over CPU tensors.
Cold prefill, save every full-attention page and the window's sliding pages only, NaN, query,
restore into other shuffled pages (no page at all for the sliding blocks before the window),
suffix only: logits bitwise equal, greedy tokens equal, pages identical. Runs where torch and
transformers are installed (CI installs them)."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.examples.hybrid_cache import HybridBench, main  # noqa: E402

ALL_CHECKS = {
    "logits_bitwise_equal": True,
    "greedy_tokens_equal": True,
    "cold_greedy_tokens_repeatable": True,
    "restored_pages_byte_identical": True,
    "logits_finite": True,
    "unheld_sliding_pages_still_nan": True,
    "window_covers_every_read": True,
    "first_read_block_is_read_from_its_page": True,
}


def test_tiny_gemma3_restored_window_gives_bitwise_equal_logits():
    bench = HybridBench("tiny", "cpu", max_prefix=192, suffix=32, greedy=8, seed=3)
    try:
        assert bench.cfg.layer_types.count("full_attention") == 2 and bench.window == 48
        assert [len(g.geometry) for g in bench.layout.groups] == [4, 20]  # K and V per layer
        r = bench.run_case(192)
        assert r["checks"] == ALL_CHECKS
        # 12 blocks of 16 tokens; the 48-token window before the boundary is blocks 9..11, and
        # the model's first sliding read (token 192 - 47 = 145) is in block 9.
        assert r["prefix_blocks"] == 12 and r["window_blocks"] == [9, 12]
        assert (r["model_reads_sliding_from_block"], r["extra_window_blocks"]) == (9, 0)
        assert r["saved_blocks"] == [12, 3] and r["restored_blocks"] == [12, 3]
        full, sliding = (g.geometry.slot_bytes for g in bench.layout.groups)
        assert (full, sliding) == (4 * 2048, 20 * 2048)
        assert r["restore_bytes"] == 12 * full + 3 * sliding
        assert r["all_layers_bytes"] == 12 * (full + sliding)
        assert len(r["greedy_tokens"]) == 8
        # Reference only: transformers' own DynamicCache agrees with this cache's cold run.
        assert r["stock_cache"]["max_abs_logit_diff"] < 0.05
        for g in range(2):
            assert bench.tier.group(g).stats()["pinned_slots"] == 0
        # A prefix shorter than the window: every sliding block is in it.
        r = bench.run_case(32)
        assert r["checks"] == ALL_CHECKS and r["window_blocks"] == [0, 2] and r["saved_blocks"] == [2, 2]
    finally:
        bench.close()


def test_a_window_one_token_past_whole_blocks_restores_one_block_the_model_does_not_read():
    # 33 tokens: a query attends itself and the 32 tokens before it (two whole blocks); kvtier's
    # rule keeps the 33 tokens before the boundary, so one block more than is read.
    bench = HybridBench("tiny", "cpu", max_prefix=128, suffix=16, greedy=4, seed=5, sliding_window=33)
    try:
        r = bench.run_case(128)
        assert r["checks"] == ALL_CHECKS
        assert r["window_blocks"] == [5, 8] and r["model_reads_sliding_from_block"] == 6
        assert r["extra_window_blocks"] == 1
    finally:
        bench.close()


def test_the_cli_writes_json(tmp_path):
    out = tmp_path / "r.json"
    rc = main(["--config", "tiny", "--device", "cpu", "--prefix", "128,256", "--suffix", "16", "--greedy", "4",
               "--repeats", "1", "--warmup", "0", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["prefix_tokens"] for r in data["results"]] == [128, 256]
    assert all(all(r["checks"].values()) for r in data["results"])
    env = data["environment"]
    assert env["config"] == "tiny" and env["sliding_window"] == 48 and len(env["layer_types"]) == 12
