"""What kvtier costs as SGLang HiCache's L3: the host-to-host copy of each page between SGLang's
host pool and the kvtier pool, against a plain torch copy of the same bytes.

HiCache keeps its own host pool (a CPU tensor); an L3 backend moves pages between that tensor and
its store. For kvtier that is one memcpy a page each way (``KvtierStore.batch_set_v1`` into pool
slots, ``batch_get_v1`` back out), plus the key lookup and the lease. The baseline is the cheapest
way torch moves the same pages: a ``copy_`` of each page's K run and V run between the host pool
and a contiguous tensor of as many pages (``torch gather`` for a backup, ``torch scatter`` for a
restore; ``index_select`` / ``index_copy_`` were slower), on one torch thread by default.

The host pool is laid out as SGLang's ``MHATokenToKVPoolHost`` with ``page_first_direct``
(``[2, pages, layers, page_size, heads, head_dim]``), Llama-3-8B's shape by default: 32 layers,
8 KV heads of 128, bf16, 16-token pages: 2 MiB a page. No SGLang needed.

Usage: python benches/sglang_l3.py [--pages 256] [--iters 20] [--batches 1,8,32,128] [--torch-threads 1] [--quick]
Prints one JSON object (``rows``: per batch size, GB/s of each path; GB = 10^9 B) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import types

import torch

import kvtier
from kvtier.sglang import KvtierStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=256, help="pages in SGLang's host pool (default 256)")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per batch size and path (default 20)")
    ap.add_argument("--batches", default="1,8,32,128", help="pages per call (HiCache sends at most 128)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16, help="tokens a page")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch's intra-op threads (default 1, as kvtier's one copy thread a rank; on a shared "
                         "2-core machine 2 threads ran torch's copies 6x slower)")
    ap.add_argument("--quick", action="store_true", help="a smoke pass: 2 layers, 16 pages, 3 iterations")
    a = ap.parse_args()
    if a.quick:
        a.layers, a.pages, a.iters, a.batches = 2, 16, 3, "1,4"
    batches = [int(b) for b in a.batches.split(",")]
    torch.set_num_threads(a.torch_threads)
    if max(batches) * 2 > a.pages:
        ap.error(f"--pages {a.pages} must hold twice the largest batch ({max(batches)})")

    ps = a.page_size
    kv = torch.randn((2, a.pages, a.layers, ps, a.heads, a.head_dim)).to(torch.bfloat16)
    pool = types.SimpleNamespace(kv_buffer=kv, layout="page_first_direct", page_size=ps)
    page_bytes = kv[:, 0].numel() * kv.element_size()
    cfg = types.SimpleNamespace(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        model_name="bench", extra_config={"pool": 2 * max(batches) * (page_bytes + 4096), "policy": "lru"})
    store = KvtierStore(cfg, {})
    store.register_mem_pool_host(pool)
    flat = kv.view(2, a.pages, -1)

    def idx(pages):
        return torch.cat([torch.arange(p * ps, (p + 1) * ps) for p in pages])

    # Touch every slot of the kvtier pool once (a pool is mapped, not prefaulted): the timed saves
    # then land in slots freed by eviction, as in a server that has run a while.
    cap = store._tier.capacity
    for start in range(0, cap + max(batches), max(batches)):
        n = min(max(batches), a.pages)
        assert all(store.batch_set_v1([f"warm-{start}-{i}" for i in range(n)], idx(range(n))))

    rows = []
    serial = 0
    for b in batches:
        src, dst = list(range(b)), list(range(a.pages - b, a.pages))
        staged = torch.empty((2, b, flat.shape[2]), dtype=kv.dtype)
        times = {"kvtier_set": [], "kvtier_get": [], "torch_gather": [], "torch_scatter": []}
        for it in range(a.iters + 1):
            keys = [f"{serial}-{i}" for i in range(b)]  # new keys: every set really copies
            serial += 1
            t0 = time.perf_counter()
            ok = store.batch_set_v1(keys, idx(src))
            t1 = time.perf_counter()
            got = store.batch_get_v1(keys, idx(dst))
            t2 = time.perf_counter()
            for j, p in enumerate(src):
                staged[0, j].copy_(flat[0, p])
                staged[1, j].copy_(flat[1, p])
            t3 = time.perf_counter()
            for j, p in enumerate(dst):
                flat[0, p].copy_(staged[0, j])
                flat[1, p].copy_(staged[1, j])
            t4 = time.perf_counter()
            assert all(ok) and all(got), (ok, got)
            if it == 0:  # warm-up; check the bytes once
                assert torch.equal(flat[:, dst].view(torch.uint8), flat[:, src].view(torch.uint8))
                continue
            for k, t in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[k].append(t)
        row = {"batch_pages": b, "batch_bytes": b * page_bytes}
        for k, ts in times.items():
            med = sorted(ts)[len(ts) // 2]
            row[f"{k}_us"] = round(med * 1e6, 1)
            row[f"{k}_gbps"] = round(b * page_bytes / med / 1e9, 2)
        rows.append(row)

    out = {
        "bench": "sglang_l3", "kvtier": kvtier.__version__, "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "machine": platform.machine(),
        "layout": "page_first_direct", "page_bytes": page_bytes, "page_tokens": ps, "layers": a.layers,
        "host_pool_pages": a.pages, "iters": a.iters, "stat": "median", "rows": rows, "stats": store.stats,
    }
    print(json.dumps(out))
    print(f"\npage = {page_bytes:,} B ({a.layers} layers x 2 x {ps} tokens x {a.heads} x {a.head_dim} x bf16); "
          f"GB/s (10^9 B/s), median of {a.iters}")
    print(f"{'pages':>6} {'kvtier set':>11} {'torch gather':>13} {'kvtier get':>11} {'torch scatter':>14}")
    for r in rows:
        print(f"{r['batch_pages']:>6} {r['kvtier_set_gbps']:>11.2f} {r['torch_gather_gbps']:>13.2f} "
              f"{r['kvtier_get_gbps']:>11.2f} {r['torch_scatter_gbps']:>14.2f}")
    store.close()


if __name__ == "__main__":
    main()
