"""The vLLM connector's worker side without vLLM: vLLM's KV layouts as arenas, and whole blocks
saved and restored between tensors laid out exactly as vLLM's backends lay them out (the CPU
backend, CUDA FlashAttention, FlashInfer, MLA), bytes checked. On a machine with CUDA the same
round trips run on GPU tensors."""

from __future__ import annotations

import os
import tempfile
import time

import pytest

torch = pytest.importorskip("torch")

from kvtier.vllm.config import ConnectorConfig  # noqa: E402
from kvtier.vllm.layout import UnsupportedLayoutError, arenas_of  # noqa: E402
from kvtier.vllm.plan import LoadSpec, SaveSpec, StepPlan  # noqa: E402
from kvtier.vllm.worker import WorkerTransfers  # noqa: E402
from kvtier.vllm.keys import RequestKeys, base_namespace  # noqa: E402

BLOCKS, BS, HEADS, HEAD = 64, 16, 2, 32
FACTS = {"model": "test", "block_size": BS}


def cpu_layers(n=2, dtype=torch.float32):
    """The CPU backend: one allocation, a [blocks, kv_heads, block_size, 2*head] view per layer."""
    whole = torch.zeros(n, BLOCKS, HEADS, BS, 2 * HEAD, dtype=dtype)
    return {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(n)}


def flash_layers(n=2, dtype=torch.bfloat16, device="cpu"):
    """CUDA FlashAttention: [2, blocks, block_size, kv_heads, head] per layer."""
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(2, BLOCKS, BS, HEADS, HEAD, dtype=dtype, device=device) for i in range(n)}


def flashinfer_layers(n=2, dtype=torch.bfloat16, device="cpu", hnd=False):
    """FlashInfer: [blocks, 2, block_size, kv_heads, head]; HND keeps heads before tokens in memory."""
    out = {}
    for i in range(n):
        if hnd:
            t = torch.zeros(BLOCKS, 2, HEADS, BS, HEAD, dtype=dtype, device=device).permute(0, 1, 3, 2, 4)
        else:
            t = torch.zeros(BLOCKS, 2, BS, HEADS, HEAD, dtype=dtype, device=device)
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def mla_layers(n=3, device="cpu"):
    """MLA (fp8_ds_mla): [blocks, block_size, 656] bytes per layer."""
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, BS, 656, dtype=torch.uint8, device=device) for i in range(n)}


def test_each_layout_becomes_whole_block_arenas():
    cpu = cpu_layers()
    specs = arenas_of("l0", 0, cpu["model.layers.0.self_attn.attn"], BLOCKS)
    assert [(s.bytes_per_page, s.page_stride, s.offset) for s in specs] == [(HEADS * BS * 2 * HEAD * 4, HEADS * BS * 2 * HEAD * 4, 0)]
    specs = arenas_of("l1", 1, cpu["model.layers.1.self_attn.attn"], BLOCKS)
    assert specs[0].offset == BLOCKS * HEADS * BS * 2 * HEAD * 4  # the second layer's view of the one allocation
    fa = flash_layers()["model.layers.0.self_attn.attn"]
    unit = BS * HEADS * HEAD * 2
    specs = arenas_of("fa", 0, fa, BLOCKS)
    assert [(s.name, s.bytes_per_page, s.page_stride, s.offset) for s in specs] == [
        ("fa.0", unit, unit, 0),
        ("fa.1", unit, unit, BLOCKS * unit),
    ]
    fi = flashinfer_layers()["model.layers.0.self_attn.attn"]
    assert [(s.bytes_per_page, s.page_stride) for s in arenas_of("fi", 0, fi, BLOCKS)] == [(2 * unit, 2 * unit)]
    hnd = flashinfer_layers(hnd=True)["model.layers.0.self_attn.attn"]
    assert [(s.bytes_per_page, s.page_stride) for s in arenas_of("hnd", 0, hnd, BLOCKS)] == [(2 * unit, 2 * unit)]
    mla = mla_layers()["model.layers.0.self_attn.attn"]
    assert [(s.bytes_per_page, s.page_stride) for s in arenas_of("mla", 0, mla, BLOCKS)] == [(BS * 656, BS * 656)]


def test_a_layout_whose_blocks_are_not_contiguous_is_refused():
    # Blocks innermost: a block is one element of every row.
    t = torch.zeros(BS, HEADS, BLOCKS)
    with pytest.raises(UnsupportedLayoutError, match="no dimension of 64 blocks"):
        arenas_of("blocks-last", 0, t, BLOCKS)
    # Tokens outermost still moves whole blocks, as one arena per token row.
    t = torch.zeros(BS, BLOCKS, HEADS, HEAD)
    assert len(arenas_of("tokens-first", 0, t, BLOCKS)) == BS
    # A block with a gap inside (every other head).
    t = torch.zeros(BLOCKS, 2 * HEADS, BS, HEAD)[:, ::2]
    with pytest.raises(UnsupportedLayoutError):
        arenas_of("gapped", 0, t, BLOCKS)
    # Two dimensions that could be the blocks.
    t = torch.zeros(2, 2, BS, HEADS, HEAD)
    with pytest.raises(UnsupportedLayoutError, match="could index the blocks"):
        arenas_of("ambiguous", 0, t, 2)


def fill(layers, block_ids, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    for t in layers.values():
        for b in block_ids:
            view = _block(t, b)
            src = torch.randint(0, 120, view.shape, generator=g, dtype=torch.int32).to(view.dtype)
            view.copy_(src.to(view.device))


def _block(t, b):
    # The block dim is the one of size BLOCKS with the largest stride.
    d = max((d for d in range(t.dim()) if t.shape[d] == BLOCKS), key=lambda d: t.stride(d))
    return t.select(d, b)


def snapshot(layers, block_ids):
    return [_block(t, b).clone().cpu() for t in layers.values() for b in block_ids]


@pytest.mark.parametrize("group_bytes", [1, None], ids=["group-per-layer", "default-groups"])
@pytest.mark.parametrize("layout", ["cpu", "flash", "flashinfer", "mla"])
def test_blocks_saved_and_restored_through_the_worker_keep_their_bytes(layout, group_bytes, tmp_path_factory):
    device = "cuda" if torch.cuda.is_available() and layout != "cpu" else "cpu"
    layers = {"cpu": cpu_layers, "flash": lambda: flash_layers(device=device), "flashinfer": lambda: flashinfer_layers(device=device, hnd=True),
              "mla": lambda: mla_layers(device=device)}[layout]()
    sock = os.path.join(tempfile.mkdtemp(prefix="kvw-", dir="/tmp"), "pool.sock")
    config = ConnectorConfig.from_extra({"pool": "32MiB", **({"layer_group_bytes": group_bytes} if group_bytes else {})})
    w = WorkerTransfers(config, FACTS, BS, 0, 1, sock, serve=True)
    w.register(layers, BLOCKS)
    try:
        src, dst = [3, 17, 18, 40, 63], [0, 5, 6, 7, 22]
        fill(layers, src, seed=1)
        want = snapshot(layers, src)
        tokens = list(range(1, 1 + len(src) * BS + 1))
        keys = RequestKeys(base_namespace(FACTS), BS).upto(tokens, len(src))
        stream = torch.cuda.current_stream() if device == "cuda" else None
        w.save(StepPlan(saves=[SaveSpec("r1", keys, src)]), stream)
        deadline = time.monotonic() + 60
        while not (sending := w.finished({"r1"})[0]) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sending == {"r1"}
        w.start(StepPlan(loads=[LoadSpec("r2", keys, dst)]), stream)
        # As vLLM's forward: a wait before each layer's attention (one per layer group), then
        # the step's end.
        for name in layers:
            w.wait_layer(name, stream)
        w.wait_loads(stream)
        if device == "cuda":
            torch.cuda.synchronize()
        assert w.take_errors() == set()
        assert w.take_loaded() == {"r2"}
        groups = w.layer_groups(len(dst))
        assert groups == (len(layers) if group_bytes == 1 else 1)
        assert (w.stats["layer_waits"], w.stats["layers_unwaited"]) == (groups, 0)
        got = snapshot(layers, dst)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        # A restore of keys the pool does not hold reports its blocks for vLLM to recompute.
        other = RequestKeys(base_namespace(FACTS), BS, b"other").upto(tokens, 2)
        w.start(StepPlan(loads=[LoadSpec("r3", other, [30, 31])]), stream)
        w.wait_loads(stream)
        assert w.take_errors() == {30, 31}
    finally:
        w.close()
