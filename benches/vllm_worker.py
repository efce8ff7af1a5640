"""The vLLM connector's worker path on a GPU: blocks restored (and saved) by
``kvtier.vllm.worker.WorkerTransfers`` between a pinned in-process pool and KV tensors laid out
as vLLM's CUDA backends lay them out, against one contiguous pinned-host <-> device copy of the
same bytes (the link's ceiling), at 1, 8, 43 and 128 blocks on random scattered block ids. Every
restore is checked byte for byte.

    python benches/vllm_worker.py [--iters 20] [--json OUT.json] [--layer-group-bytes N]

Layouts: ``llama3-8b-flash`` (FlashAttention, 32 layers, [2, blocks, 16, 8, 128] bf16: 64 arenas
of 32,768 B a block) and ``glm52-mla`` (MLA, 78 layers, [blocks, 64, 656] fp8 bytes: 78 arenas of
41,984 B). GB/s = 10^9 B over the median wall time from the call until the bytes are in place
(a CUDA synchronize); ratio = contiguous time / kvtier time. A restore runs as vLLM runs it:
``start``, ``wait_layer`` before each layer (one stream wait per layer group), ``wait_loads``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from engine_paths import time_contiguous  # benches/engine_paths.py: the contiguous ceiling
from kvtier.vllm.config import ConnectorConfig
from kvtier.vllm.keys import RequestKeys, base_namespace
from kvtier.vllm.plan import LoadSpec, SaveSpec, StepPlan
from kvtier.vllm.worker import WorkerTransfers

SIZES = (1, 8, 43, 128)


def layouts(blocks: int):
    return {
        "llama3-8b-flash": (16, lambda: {f"model.layers.{i}.self_attn.attn": torch.empty(2, blocks, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for i in range(32)}),
        "glm52-mla": (64, lambda: {f"model.layers.{i}.self_attn.attn": torch.empty(blocks, 64, 656, dtype=torch.uint8, device="cuda") for i in range(78)}),
    }


def block_view(t, b):
    d = 1 if t.dim() == 5 else 0
    return t.select(d, b)


def same_bytes(a, b):
    """Byte equality (random bytes read as bf16 hold NaNs, which torch.equal calls unequal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def median_s(samples):
    return statistics.median(samples)


def run_layout(name, block_size, make, blocks, iters, rng, group_bytes=None):
    layers = make()
    for t in layers.values():
        t.view(torch.uint8).random_(0, 255) if t.dtype != torch.uint8 else t.random_(0, 255)
    facts = {"model": name, "block_size": block_size}
    sock = os.path.join(tempfile.mkdtemp(prefix="kvb-", dir="/tmp"), "pool.sock")
    extra = {"pool": "2GiB", **({"layer_group_bytes": group_bytes} if group_bytes else {})}
    w = WorkerTransfers(ConnectorConfig.from_extra(extra), facts, block_size, 0, 1, sock, serve=True)
    w.register(layers, blocks)
    block_bytes = w.geometry.block_bytes
    stream = torch.cuda.current_stream()
    rows = []
    ns = base_namespace(facts)
    for n in SIZES:
        src = rng.sample(range(blocks), n)
        keys = RequestKeys(ns, block_size, f"{n}".encode()).upto(list(range(n * block_size + 1)), n)
        want = [block_view(t, b).clone() for t in layers.values() for b in src]
        # save
        save_s = []
        for it in range(iters + 2):
            w._tier.evict(w._tier.capacity)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            w.save(StepPlan(saves=[SaveSpec(f"s{it}", keys, src)]), stream)
            while not w.finished({f"s{it}"})[0]:
                pass
            save_s.append(time.perf_counter() - t0)
        load_s = []
        for it in range(iters + 2):
            dst = rng.sample(range(blocks), n)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            w.start(StepPlan(loads=[LoadSpec(f"l{it}", keys, dst)]), stream)
            for layer in layers:  # as vLLM's forward: a wait before each layer's attention
                w.wait_layer(layer, stream)
            w.wait_loads(stream)
            torch.cuda.synchronize()
            load_s.append(time.perf_counter() - t0)
            assert not w.take_errors()
            got = [block_view(t, b) for t in layers.values() for b in dst]
            assert all(same_bytes(a, b) for a, b in zip(want, got)), f"{name}: restored bytes differ at {n} blocks"
        # the ceiling: one contiguous copy of the same bytes each way
        contig_d2h_us, contig_h2d_us = time_contiguous(block_bytes, n, iters)
        size = n * block_bytes
        r = {
            "layout": name, "blocks": n, "bytes": size,
            "save_us": median_s(save_s[2:]) * 1e6, "restore_us": median_s(load_s[2:]) * 1e6,
            "contig_d2h_us": contig_d2h_us, "contig_h2d_us": contig_h2d_us, "layer_groups": w.layer_groups(n),
        }
        r["save_gbs"] = size / r["save_us"] / 1e3
        r["restore_gbs"] = size / r["restore_us"] / 1e3
        r["save_ratio"] = r["contig_d2h_us"] / r["save_us"]
        r["restore_ratio"] = r["contig_h2d_us"] / r["restore_us"]
        rows.append(r)
        print(f"{name:16} {n:4d} blocks {size/1e6:8.1f} MB  save {r['save_us']:8.0f} us {r['save_gbs']:5.1f} GB/s ({r['save_ratio']:.2f})"
              f"  restore {r['restore_us']:8.0f} us {r['restore_gbs']:5.1f} GB/s ({r['restore_ratio']:.2f})"
              f"  contiguous {r['contig_d2h_us']:.0f} / {r['contig_h2d_us']:.0f} us  ({r['layer_groups']} layer groups)",
              flush=True)
    w.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=1024, help="blocks per layer tensor")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--layer-group-bytes", type=int, default=None,
                    help="the connector's layer_group_bytes (default: its own, 8 MiB; 1: one group per layer)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benches/vllm_worker.py needs a CUDA GPU")
    import random

    rng = random.Random(0)
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, (bs, make) in layouts(a.blocks).items():
        rows += run_layout(name, bs, make, a.blocks, a.iters, rng, a.layer_group_bytes)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
