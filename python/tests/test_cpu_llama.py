"""The real-model end-to-end protocol on a CPU: a tiny randomly initialised Llama (bf16, sdpa) whose
KV pages are numpy-free torch CPU tensors attached as a host rank. Cold prefill, save, NaN, restore
into other shuffled pages, suffix only: logits bitwise equal, greedy tokens equal, pages identical.
Runs where torch and transformers are installed (CI installs them)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.examples.llama_restore import Bench, main, markdown  # noqa: E402


def test_tiny_llama_restored_prefix_gives_bitwise_equal_logits():
    bench = Bench("tiny", "cpu", max_prefix=128, suffix=32, greedy=8, seed=3, layer_groups=2)
    try:
        r = bench.run_case(128, repeats=1, warmup=0)
        assert r["checks"] == {
            "logits_bitwise_equal": True,
            "greedy_tokens_equal": True,
            "cold_greedy_tokens_repeatable": True,
            "restored_pages_byte_identical": True,
            "logits_finite": True,
            "torch_per_page_logits_equal": True,
            "torch_staged_logits_equal": True,
            "suffix_alone_first_token_equal": True,
            "suffix_beside_copy_first_token_equal": True,
            "layer_wise_logits_bitwise_equal": True,
            "layer_wise_greedy_tokens_equal": True,
            "layer_wise_restored_pages_byte_identical": True,
        }
        assert r["prefix_pages"] == 8 and r["restore_bytes"] == 8 * 4 * 2048
        assert r["saved"] == {"saving": 8, "resident": 0}
        assert len(r["greedy_tokens"]) == 8
        s = bench.tier.stats()
        assert s["saved_blocks"] == 8
        # 5 restores: the warm runs (whole-block, layer-wise), the suffix-alone set-up and the two
        # restore timings (whole-block, layer-wise).
        assert s["restored_blocks"] == 5 * 8 and s["pinned_slots"] == 0
        # The tiny model's 2 layers, one group each.
        assert r["layer_groups"] == 2
        md = markdown([r])
        assert "| 128 |" in md
        # A figure a CPU cannot measure (the copy beside the suffix, the layer waits) says so.
        assert "nan" not in md.lower() and "n/a (no GPU)" in md, md
    finally:
        bench.close()


def test_a_second_prefix_reuses_the_tier_and_the_cli_writes_json(tmp_path):
    out = tmp_path / "r.json"
    rc = main(["--config", "tiny", "--device", "cpu", "--prefix", "64,128", "--suffix", "16", "--greedy", "4",
               "--repeats", "1", "--warmup", "0", "--json", str(out)])
    assert rc == 0
    import json

    data = json.loads(out.read_text())
    assert [r["prefix_tokens"] for r in data["results"]] == [64, 128]
    assert all(all(r["checks"].values()) for r in data["results"])
    assert data["environment"]["config"] == "tiny" and data["environment"]["arenas"] == 4


def test_the_prefix_promoted_from_an_ssd_tier_gives_bitwise_equal_logits(tmp_path):
    out, ssd = tmp_path / "r.json", tmp_path / "prefix.kvtier"
    rc = main(["--config", "tiny", "--device", "cpu", "--prefix", "64", "--suffix", "16", "--greedy", "4",
               "--repeats", "2", "--warmup", "0", "--no-torch-baselines", "--ssd", str(ssd), "--json", str(out)])
    assert rc == 0
    import json

    data = json.loads(out.read_text())
    (r,) = data["results"]
    ssd_checks = {k: v for k, v in r["checks"].items() if k.startswith("ssd_")}
    assert ssd_checks == {
        "ssd_whole_prefix_promoted": True,
        "ssd_logits_bitwise_equal": True,
        "ssd_greedy_tokens_equal": True,
        "ssd_restored_pages_byte_identical": True,
    }
    assert r["ttft_ms"]["warm_ssd"] > 0 and len(r["samples_ms"]["warm_ssd"]) == 2
    s = data["environment"]["ssd_stats"]
    # 4 pages of 64 tokens, written once, promoted by each of the 2 timed runs.
    assert (s["demoted_blocks"], s["promoted_blocks"], s["promotion_failures"]) == (4, 2 * 4, 0)
    # The prefix's blocks and 8 more: 8,192 B slots (4 arenas of 2,048 B) take 12,288 B on disk.
    assert ssd.stat().st_size == 4096 + (4 + 8) * 12288
