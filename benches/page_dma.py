"""A layer-wise restore by the copy engines alone, measured against the staged path's alternative.

What it measures (one NVIDIA GPU, torch with CUDA, a driver with ``cuMemcpyBatchAsync``: CUDA
12.8 or later): the Llama-3-8B block shape of ``kvtier.examples.llama_restore`` (32 layers, a K
and a V page per layer, each page 16 tokens x 8 KV heads x 128 x bf16 = 32 KiB, so 2 MiB a block)
restored from a pinned host buffer (blocks back to back, each block's pages in layer order) into
scattered pages of 64 GPU arenas (one per layer and K/V), as

- **one contiguous copy** of the same bytes (the reference rate: copy engine, one transfer), and
- **one ``cuMemcpyBatchAsync`` call per layer**, a 32 KiB copy per page (2 x blocks copies per
  call), with ``flags`` 0 and 1 (``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``): copy engines
  only, no kernel. It prints the copy's rate, how long the calls held the calling thread (the
  median over the same timed runs) and whether the pages arrived (the arenas are zeroed before
  each flag's runs, then 64 blocks are compared byte for byte with the host buffer).

Then a stand-in for a suffix's compute (per layer: attention of 128 queries over the prefix, 32
query heads over 8 KV heads, and a 4096 x 14336 x 4096 MLP pair, bf16) alone, and beside each
copy on a second stream (the compute queued first, then the copy): the GPU time of the compute
itself (timing events around it on its own stream) and the wall time until both are done. Every
time is the median of ``--repeats`` runs after one warm-up.

Usage: ``python benches/page_dma.py --blocks 2032,4096`` (2,032 blocks = 32,512 tokens, 4.26 GB;
4,096 blocks = 65,536 tokens, 8.59 GB; needs that much pinned host memory and about twice that in
GPU memory).
"""

import argparse
import ctypes
import random
import statistics
import time

import torch
import torch.nn.functional as F

PAGE_BYTES = 32 * 1024  # 16 tokens x 8 KV heads x 128 x 2 B
LAYERS = 32
BLOCK_BYTES = LAYERS * 2 * PAGE_BYTES
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_LOCATION_TYPE_HOST = 1, 2


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_hint", MemLocation),
        ("dst_loc_hint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


def batch_copy_fn():
    """``cuMemcpyBatchAsync`` from libcuda: ``(fn, takes_fail_index)``. CUDA 13 drivers export
    the signature without the failure index as ``cuMemcpyBatchAsync_v2``; 12.8 and 12.9 only the
    one with it."""
    cu = ctypes.CDLL("libcuda.so.1")
    u64p, szp = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
    attrs = ctypes.POINTER(MemcpyAttributes)
    try:
        fn = cu.cuMemcpyBatchAsync_v2
        fn.argtypes = [u64p, u64p, szp, ctypes.c_size_t, attrs, szp, ctypes.c_size_t, ctypes.c_void_p]
        fail = False
    except AttributeError:
        fn = cu.cuMemcpyBatchAsync
        fn.argtypes = [u64p, u64p, szp, ctypes.c_size_t, attrs, szp, ctypes.c_size_t, szp, ctypes.c_void_p]
        fail = True
    fn.restype = ctypes.c_int
    return fn, fail


def median_s(fn, repeats: int) -> float:
    """Median wall time of ``fn`` (seconds), the device synchronised before and after each run,
    after one untimed run."""
    out = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i:
            out.append(time.perf_counter() - t)
    return statistics.median(out)


def run(blocks: int, repeats: int) -> None:
    dev = torch.device("cuda")
    batch, takes_fail_index = batch_copy_fn()
    host = torch.empty(blocks * BLOCK_BYTES, dtype=torch.uint8).pin_memory()
    host.view(torch.int64).random_()
    pages = blocks + 64
    arenas = [torch.empty(pages * PAGE_BYTES, dtype=torch.uint8, device=dev) for _ in range(2 * LAYERS)]
    flat = torch.empty(blocks * BLOCK_BYTES, dtype=torch.uint8, device=dev)
    perm = list(range(pages))
    random.Random(1).shuffle(perm)
    dst_page = perm[:blocks]  # scattered, as a paged allocator hands pages out
    hp = host.data_ptr()

    # One (dst, src, size) array per layer: every block's K page, then its V page.
    per_layer = []
    for layer in range(LAYERS):
        n = 2 * blocks
        dst, src, size = (ctypes.c_uint64 * n)(), (ctypes.c_uint64 * n)(), (ctypes.c_size_t * n)()
        for b in range(blocks):
            for kv in range(2):
                i, arena = 2 * b + kv, 2 * layer + kv
                src[i] = hp + b * BLOCK_BYTES + arena * PAGE_BYTES
                dst[i] = arenas[arena].data_ptr() + dst_page[b] * PAGE_BYTES
                size[i] = PAGE_BYTES
        per_layer.append((dst, src, size, n))

    side = torch.cuda.Stream()

    def page_batches(flags: int) -> None:
        attrs = MemcpyAttributes(
            CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            MemLocation(CU_MEM_LOCATION_TYPE_HOST, 0),
            MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, dev.index or 0),
            flags,
        )
        attr_index = (ctypes.c_size_t * 1)(0)
        fail_index = ctypes.c_size_t(0)
        for dst, src, size, n in per_layer:
            tail = (ctypes.byref(fail_index),) if takes_fail_index else ()
            rc = batch(dst, src, size, n, ctypes.byref(attrs), attr_index, 1, *tail, ctypes.c_void_p(side.cuda_stream))
            if rc != 0:
                raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {rc}")

    def contiguous() -> None:
        with torch.cuda.stream(side):
            flat.copy_(host, non_blocking=True)

    gb = blocks * BLOCK_BYTES / 1e9
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; {blocks} blocks ({blocks * 16:,} tokens), {gb:.2f} GB", flush=True)
    t_contiguous = median_s(contiguous, repeats)
    print(f"contiguous copy {t_contiguous * 1e3:.1f} ms = {gb / t_contiguous:.1f} GB/s", flush=True)
    sample = random.Random(2).sample(range(blocks), min(64, blocks))

    def pages_in_place() -> bool:
        return all(
            torch.equal(
                arenas[a][dst_page[b] * PAGE_BYTES : (dst_page[b] + 1) * PAGE_BYTES].cpu(),
                host[b * BLOCK_BYTES + a * PAGE_BYTES : b * BLOCK_BYTES + (a + 1) * PAGE_BYTES],
            )
            for b in sample
            for a in range(2 * LAYERS)
        )

    for flags in (0, 1):
        for a in arenas:
            a.zero_()
        held = []

        def timed_calls() -> None:
            t0 = time.perf_counter()
            page_batches(flags)
            held.append(time.perf_counter() - t0)

        t = median_s(timed_calls, repeats)
        print(
            f"batched 32 KiB pages, flags={flags}: {t * 1e3:.1f} ms = {gb / t:.1f} GB/s "
            f"({t_contiguous / t * 100:.1f}% of the contiguous rate), the calls held the thread "
            f"{statistics.median(held[1:]) * 1e3:.2f} ms; restored pages byte-identical "
            f"({len(sample)} blocks sampled): {pages_in_place()}",
            flush=True,
        )

    ctx = blocks * 16
    q = torch.randn(1, 32, 128, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 8, ctx, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    x = torch.randn(128, 4096, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16)
    w2 = torch.randn(14336, 4096, device=dev, dtype=torch.bfloat16)

    def compute() -> None:
        y = x
        for _ in range(LAYERS):
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1))
            y = (y + o.transpose(1, 2).reshape(128, 4096)) @ w1 @ w2 * 1e-3

    t_alone = median_s(compute, repeats)
    print(f"compute stand-in alone: {t_alone * 1e3:.1f} ms", flush=True)
    for name, copy in (
        ("the contiguous copy", contiguous),
        ("the batched pages, flags=0", lambda: page_batches(0)),
        ("the batched pages, flags=1", lambda: page_batches(1)),
    ):
        spans = []

        def both() -> None:
            # The compute is queued first: the page batches hold this thread until about the end
            # of their copy, so a compute queued after them would run after it, not beside it.
            # The side stream waits only for what came before the compute.
            side.wait_stream(torch.cuda.current_stream())
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            compute()
            e1.record()
            copy()
            spans.append((e0, e1))

        t_both = median_s(both, repeats)
        itself = statistics.median(e0.elapsed_time(e1) for e0, e1 in spans[1:])
        print(
            f"beside {name}: both done {t_both * 1e3:.1f} ms, the compute itself {itself:.1f} ms "
            f"({itself / (t_alone * 1e3):.3f} x alone)",
            flush=True,
        )
    del arenas, flat, host
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", default="2032,4096", help="comma-separated block counts (16 tokens, 2 MiB each)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per figure, after one warm-up (default 5)")
    a = p.parse_args()
    for blocks in (int(b) for b in a.blocks.split(",")):
        if blocks < 1:
            p.error("--blocks: each count must be at least 1")
        run(blocks, a.repeats)


if __name__ == "__main__":
    main()
