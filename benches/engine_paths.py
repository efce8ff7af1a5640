"""The engine's own paths at the batch sizes a scheduler step moves: one process's Python calls
into kvtier, and the same calls through a tier daemon, against one contiguous pinned-host <-> GPU
copy of the same bytes (the link's ceiling), and pegaflow where it is installed.

    python benches/engine_paths.py [--iters 30] [--blocks 1,8,43,128] [--kvtierd PATH] [--json OUT.json]
                                   [--device cuda|cpu] [--layouts glm52,llama3-8b]

Layouts: ``glm52`` (99 arenas, 3,452,160 B a block) and ``llama3-8b`` (64 arenas, 2,097,152 B),
each arena a ``[pages, bytes_per_page]`` CUDA tensor, random scattered page ids. Contenders:

- ``contiguous``: ``host.copy_(dev)`` / ``dev.copy_(host)`` of the batch's bytes, pinned host;
- ``kvtier``: ``Tier`` + ``attach_cuda`` in this process, ``rank.save(...).wait()`` and
  ``query`` + ``rank.restore(...).wait()``;
- ``kvtierd``: the same calls on ``kvtier.connect(socket)``: the daemon at ``--kvtierd PATH``
  (a built ``kvtierd``), else the same server run by ``kvtier.Tier(serve=...)`` in a child process
  (named ``kvtier-serve`` in the output);
- ``pegaflow``: reported as missing unless its package imports (it is not driven here yet).

``--device cpu`` runs the same calls on host tensors (``attach_host``; the "contiguous" copy is one
``torch`` copy of the batch's bytes between two host tensors): no link, so what it shows is the
fixed cost of each call and each round trip, which is what a scheduler step of 1-8 blocks pays.

Where the time goes: each row also gives the medians of the calls' parts: for a save, the
``rank.save`` call (keys checked, slots reserved, the copy submitted; on a connected tier one round
trip) and the wait for the copy; for a restore, ``tier.query`` (a lease: one round trip on a
connected tier), the ``rank.restore`` call and the wait.

Each save is of keys the pool does not hold (fresh keys every round), each restore into other
random pages, and every restored page is compared byte for byte with its source. Times: the
median wall time from the Python call until the bytes are in place; GB/s = 10^9 B / s; ratio =
contiguous time / contender time (1.0 = the link).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import kvtier

PAGES = 512


DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def arenas_for(g):
    return [torch.randint(0, 255, (PAGES, a["bytes_per_page"]), dtype=torch.uint8, device=DEVICE) for a in g.arenas]


def check(arenas, src, dst, what):
    for t in arenas:
        if not torch.equal(t[src], t[dst]):
            raise AssertionError(f"{what}: restored bytes differ")


def med_us(xs):
    return statistics.median(xs) * 1e6


def time_contiguous(block_bytes, n, iters):
    host = torch.empty(n * block_bytes, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    dev = torch.randint(0, 255, (n * block_bytes,), dtype=torch.uint8, device=DEVICE)
    save, load = [], []
    for _ in range(iters + 3):
        sync()
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        sync()
        save.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync()
        load.append(time.perf_counter() - t0)
    return med_us(save[3:]), med_us(load[3:])


def time_tier(tier, rank, arenas, n, iters, rng, what):
    """Median microseconds: (save, restore, {part: median}) over ``iters`` rounds after 3 warm-ups."""
    stream = torch.cuda.current_stream() if DEVICE == "cuda" else None
    save, load = [], []
    parts = {"save_call": [], "save_wait": [], "query": [], "restore_call": [], "restore_wait": []}
    for it in range(iters + 3):
        src = rng.sample(range(PAGES), n)
        keys = [os.urandom(16) for _ in range(n)]
        sync()
        t0 = time.perf_counter()
        ticket = rank.save(keys, src, after_stream=stream)
        t1 = time.perf_counter()
        ticket.wait()
        t2 = time.perf_counter()
        save.append(t2 - t0)
        parts["save_call"].append(t1 - t0)
        parts["save_wait"].append(t2 - t1)
        dst = rng.sample([p for p in range(PAGES) if p not in set(src)], n)
        t0 = time.perf_counter()
        with tier.query(keys) as lease:
            t1 = time.perf_counter()
            assert len(lease) == n, f"{what}: {len(lease)} of {n} blocks resident"
            handle = rank.restore(lease, dst, after_stream=stream)
            t2 = time.perf_counter()
            handle.wait()
            t3 = time.perf_counter()
        load.append(t3 - t0)
        parts["query"].append(t1 - t0)
        parts["restore_call"].append(t2 - t1)
        parts["restore_wait"].append(t3 - t2)
        check(arenas, src, dst, what)
        if it % 8 == 7:
            tier.evict(tier.capacity)
    return med_us(save[3:]), med_us(load[3:]), {k: round(med_us(v[3:]), 1) for k, v in parts.items()}


def start_server(g, pool_bytes, kvtierd, preset):
    path = os.path.join(tempfile.mkdtemp(prefix="kvep-", dir="/tmp"), "kvtierd.sock")
    if kvtierd:
        proc = subprocess.Popen([kvtierd, "--socket", path, "--geometry", preset, "--pool", str(pool_bytes)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        name = "kvtierd"
    else:
        code = ("import kvtier, sys, time; g = kvtier.Geometry.preset(sys.argv[1], %d); "
                "kvtier.Tier(g, int(sys.argv[2]), serve=sys.argv[3]); time.sleep(1e9)" % PAGES)
        proc = subprocess.Popen([sys.executable, "-c", code, preset, str(pool_bytes), path])
        name = "kvtier-serve"
    for _ in range(300):
        try:
            return proc, kvtier.connect(path, g), name
        except kvtier.KvtierError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the {name} server at {path} did not start")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--blocks", default="1,8,43,128")
    ap.add_argument("--kvtierd")
    ap.add_argument("--json")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--layouts", default="glm52,llama3-8b")
    a = ap.parse_args()
    global DEVICE
    DEVICE = a.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("benches/engine_paths.py needs a CUDA GPU (or --device cpu: the calls' fixed costs on host tensors)")
    machine = torch.cuda.get_device_name() if DEVICE == "cuda" else f"CPU ({os.cpu_count()} cores), host tensors"
    sizes = [int(x) for x in a.blocks.split(",")]
    rng = random.Random(0)
    rows, missing = [], []
    try:
        import pegaflow  # noqa: F401

        missing.append("pegaflow: installed, but this bench does not drive it yet")
    except ImportError:
        missing.append("pegaflow: not installed (pip install pegaflow-llm-cu13)")
    print(f"{machine}; " + "; ".join(missing), flush=True)
    for preset in a.layouts.split(","):
        g = kvtier.Geometry.preset(preset, PAGES)
        arenas = arenas_for(g)
        pool = 2 * max(sizes) * g.slot_bytes + (64 << 20)
        tier = kvtier.Tier(g, pool)
        attach = (lambda t: t.attach_cuda(0, arenas, layout="pages")) if DEVICE == "cuda" else \
            (lambda t: t.attach_host(arenas, layout="pages"))
        rank = attach(tier)
        proc, remote, server = start_server(g, pool, a.kvtierd, preset)
        rrank = attach(remote)
        try:
            for n in sizes:
                c_save, c_load = time_contiguous(g.block_bytes, n, a.iters)
                for name, (t, r) in (("kvtier", (tier, rank)), (server, (remote, rrank))):
                    s, l, parts = time_tier(t, r, arenas, n, a.iters, rng, f"{preset} {name} {n}")
                    row = {"layout": preset, "contender": name, "blocks": n, "bytes": n * g.block_bytes,
                           "save_us": s, "restore_us": l, "contig_save_us": c_save, "contig_restore_us": c_load,
                           "save_ratio": c_save / s, "restore_ratio": c_load / l, "parts_us": parts}
                    rows.append(row)
                    gbs = lambda us: n * g.block_bytes / us / 1e3  # noqa: E731
                    print(f"{preset:10} {name:12} {n:4d} blocks  save {s:8.0f} us {gbs(s):5.1f} GB/s ({row['save_ratio']:.2f})"
                          f"  restore {l:8.0f} us {gbs(l):5.1f} GB/s ({row['restore_ratio']:.2f})"
                          f"  contiguous {c_save:.0f} / {c_load:.0f} us", flush=True)
                    print("            parts (us): " + ", ".join(f"{k} {v:.0f}" for k, v in parts.items()), flush=True)
        finally:
            rrank.close()
            rank.close()
            proc.kill()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": machine, "missing": missing, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
