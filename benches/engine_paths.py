"""The engine's own paths at the batch sizes a scheduler step moves: one process's Python calls
into kvtier, and the same calls through a tier daemon, against one contiguous pinned-host <-> GPU
copy of the same bytes (the link's ceiling), and pegaflow where it is installed.

    python benches/engine_paths.py [--iters 30] [--blocks 1,8,43,128] [--kvtierd PATH] [--json OUT.json]
                                   [--device cuda|cpu] [--layouts glm52,llama3-8b] [--pool-gib 8]
                                   [--pega-pool 8gb]

Layouts: ``glm52`` (99 arenas, 3,452,160 B a block) and ``llama3-8b`` (64 arenas, 2,097,152 B),
each arena a ``[pages, bytes_per_page]`` CUDA tensor, random scattered page ids. Contenders:

- ``contiguous``: ``host.copy_(dev)`` / ``dev.copy_(host)`` of the batch's bytes, pinned host;
- ``kvtier``: ``Tier`` + ``attach_cuda`` in this process, ``rank.save(...).wait()`` and
  ``query`` + ``rank.restore(...).wait()``;
- ``kvtierd``: the same calls on ``kvtier.connect(socket)``: the daemon at ``--kvtierd PATH``
  (a built ``kvtierd``), else the same server run by ``kvtier.Tier(serve=...)`` in a child process
  (named ``kvtier-serve`` in the output);
- ``pegaflow``: where ``pegaflow`` (PyPI ``pegaflow-llm-cu13``) imports, its bundled gRPC server
  (``pegaflow-server-py``, started here on a free local port with a pinned pool of ``--pega-pool``
  after kvtier's rows of a layout, and stopped before the next)
  with the same arenas registered through CUDA IPC as one layer each, configured as its vLLM
  connector configures it: ``transfer_backend="kernel"`` and ``page_first=True`` for the MLA
  layout (GLM-5.2), ``"direct"`` and layer-first for the others. Save: one ``save`` RPC (its vLLM
  connector frees the engine's blocks when it returns); restore: ``query_prefetch`` until ready (the lease), ``load``,
  then spinning on the ``PyLoadState`` flag until it reports success. Not installed, or failing
  to start, it is reported as missing with the reason.

``--device cpu`` runs the same calls on host tensors (``attach_host``; the "contiguous" copy is one
``torch`` copy of the batch's bytes between two host tensors): no link, so what it shows is the
fixed cost of each call and each round trip, which is what a scheduler step of 1-8 blocks pays.

Where the time goes: each row also gives the medians of the calls' parts: for a save, the
``rank.save`` call (keys checked, slots reserved, the copy submitted; on a connected tier one round
trip) and the wait for the copy; for a restore, ``tier.query`` (a lease: one round trip on a
connected tier), the ``rank.restore`` call and the wait.

The pools (in process and the daemon's) hold ``--pool-gib`` GiB, as an engine's would: the default
policy replays a sample of its references in miniature caches of 512 slots, so a pool of fewer
than 512 slots (what 2 x 128 blocks would need) replays every reference, and its query and save
calls then cost several times what they cost on a real pool.

Each save is of keys the pool does not hold (fresh keys every round), each restore into other
random pages, and every restored page is compared byte for byte with its source. Times: the
median wall time from the Python call until the bytes are in place; GB/s = 10^9 B / s; ratio =
contiguous time / contender time (1.0 = the link).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import socket
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


class Pegaflow:
    """pegaflow's bundled server and its gRPC client, driven through the calls its vLLM connector
    makes (``register_context_batch``, ``save``, ``query_prefetch``, ``load`` with a
    ``PyLoadState``). Raises ``RuntimeError`` with the reason when it cannot start."""

    def __init__(self, pool):
        import sysconfig

        from pegaflow import _bin_utils
        from pegaflow.pegaflow import EngineRpcClient

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = _bin_utils.binary_env()
        env["PYTHONHOME"] = sys.base_prefix
        env["PYO3_PYTHON"] = sys.executable
        libdir = sysconfig.get_config_var("LIBDIR")
        if libdir:
            env["LD_LIBRARY_PATH"] = libdir + ":" + env.get("LD_LIBRARY_PATH", "")
        self.log = tempfile.NamedTemporaryFile(prefix="pegaflow-server-", suffix=".log", delete=False)
        binary = _bin_utils.find_binary("pegaflow-server-py")
        self.proc = subprocess.Popen([binary, "--addr", f"127.0.0.1:{port}", "--pool-size", pool, "--devices", "0"],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd="/tmp")
        self.endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pegaflow-server-py exited with {self.proc.returncode}: {self.tail()}")
            try:
                self.client = EngineRpcClient(self.endpoint)
                if self.client.health()[0]:
                    return
            except Exception as e:  # noqa: BLE001 (the server is still starting)
                last = e
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"pegaflow-server-py did not answer within 120 s ({last}): {self.tail()}")

    def tail(self):
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return f.read()[-2000:].decode(errors="replace")

    def register(self, instance, arenas, mla):
        from pegaflow.ipc_wrapper import CudaIPCWrapper

        self.instance, self.layers = instance, [f"layer.{i}" for i in range(len(arenas))]
        ok, msg = self.client.register_context_batch(
            instance, instance, 0, 0, 1, 1, 0, self.layers,
            [pickle.dumps(CudaIPCWrapper(t)) for t in arenas],
            [t.shape[0] for t in arenas], [t.stride(0) * t.element_size() for t in arenas],
            [0] * len(arenas), [1] * len(arenas), "kernel" if mla else "direct", bool(mla))
        if not ok:
            raise RuntimeError(f"pegaflow register_context_batch: {msg}")

    def close(self):
        self.proc.kill()
        self.proc.wait()


def time_pegaflow(pf, arenas, n, iters, rng, what):
    """Median microseconds (save, restore, {part: median}) through pegaflow, as ``time_tier``."""
    from pegaflow.pegaflow import PyLoadState, QueryReady

    save, load = [], []
    parts = {"save_call": [], "query": [], "load_call": [], "load_wait": []}
    for it in range(iters + 3):
        src = rng.sample(range(PAGES), n)
        hashes = [os.urandom(32) for _ in range(n)]
        sync()
        t0 = time.perf_counter()
        ok, msg = pf.client.save(pf.instance, 0, 0, 0, [(name, src, hashes) for name in pf.layers])
        t1 = time.perf_counter()
        if not ok:
            raise RuntimeError(f"{what}: pegaflow save: {msg}")
        save.append(t1 - t0)
        parts["save_call"].append(t1 - t0)
        dst = rng.sample([p for p in range(PAGES) if p not in set(src)], n)
        t0 = time.perf_counter()
        deadline = t0 + 10
        while True:
            q = pf.client.query_prefetch(pf.instance, hashes, f"bench-{it}")
            if isinstance(q, QueryReady) and q.num_hit_blocks == n:
                break
            if isinstance(q, QueryReady) and q.lease:
                pf.client.release(q.lease)
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{what}: pegaflow holds {getattr(q, 'num_hit_blocks', 0)} of {n} saved blocks after 10 s")
        t1 = time.perf_counter()
        state = PyLoadState()
        ok, msg = pf.client.load(pf.instance, 0, 0, state.shm_name(), [pf.layers], [(q.lease, [dst])])
        t2 = time.perf_counter()
        if not ok:
            raise RuntimeError(f"{what}: pegaflow load: {msg}")
        while not state.is_ready():
            pass
        t3 = time.perf_counter()
        if state.get_state() != 1:
            raise RuntimeError(f"{what}: pegaflow load failed (state {state.get_state()})")
        load.append(t3 - t0)
        parts["query"].append(t1 - t0)
        parts["load_call"].append(t2 - t1)
        parts["load_wait"].append(t3 - t2)
        check(arenas, src, dst, what)
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
    ap.add_argument("--pool-gib", type=float, default=8.0, help="kvtier's pools, GiB (2^30 B)")
    ap.add_argument("--pega-pool", default="8gb", help="pegaflow's pinned pool (its own size syntax)")
    ap.add_argument("--cuda-options", type=json.loads, default=None,
                    help='kvtier\'s copy tuning as JSON, passed to attach_cuda: e.g. \'{"batched_copies": false}\'')
    a = ap.parse_args()
    global DEVICE
    DEVICE = a.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("benches/engine_paths.py needs a CUDA GPU (or --device cpu: the calls' fixed costs on host tensors)")
    machine = torch.cuda.get_device_name() if DEVICE == "cuda" else f"CPU ({os.cpu_count()} cores), host tensors"
    sizes = [int(x) for x in a.blocks.split(",")]
    rng = random.Random(0)
    rows, missing, pega_version = [], [], None
    if DEVICE != "cuda":
        missing.append("pegaflow: needs CUDA tensors (not run with --device cpu)")
    else:
        try:
            import pegaflow

            pega_version = pegaflow.__version__
        except ImportError:
            missing.append("pegaflow: not installed (pip install pegaflow-llm-cu13)")
    print(f"{machine}; " + ("; ".join(missing) or "every contender installed"), flush=True)

    def record(preset, g, name, n, contig, result):
        (c_save, c_load), (s, l, parts) = contig, result
        row = {"layout": preset, "contender": name, "blocks": n, "bytes": n * g.block_bytes,
               "save_us": s, "restore_us": l, "contig_save_us": c_save, "contig_restore_us": c_load,
               "save_ratio": c_save / s, "restore_ratio": c_load / l, "parts_us": parts}
        rows.append(row)
        gbs = lambda us: n * g.block_bytes / us / 1e3  # noqa: E731
        print(f"{preset:10} {name:12} {n:4d} blocks  save {s:8.0f} us {gbs(s):5.1f} GB/s ({row['save_ratio']:.2f})"
              f"  restore {l:8.0f} us {gbs(l):5.1f} GB/s ({row['restore_ratio']:.2f})"
              f"  contiguous {c_save:.0f} / {c_load:.0f} us", flush=True)
        print("            parts (us): " + ", ".join(f"{k} {v:.0f}" for k, v in parts.items()), flush=True)

    def dump():
        if a.json:  # after each layout too: what has run so far, should a later one fail
            with open(a.json, "w") as f:
                json.dump({"device": machine, "missing": missing, "rows": rows}, f, indent=1)

    for preset in a.layouts.split(","):
        g = kvtier.Geometry.preset(preset, PAGES)
        arenas = arenas_for(g)
        contig = {n: time_contiguous(g.block_bytes, n, a.iters) for n in sizes}
        # kvtier's rows first, with no other server running; then pegaflow's, its server started
        # for them and stopped after.
        pool = max(int(a.pool_gib * (1 << 30)), 2 * max(sizes) * g.slot_bytes + (64 << 20))
        tier = kvtier.Tier(g, pool)
        attach = (lambda t: t.attach_cuda(0, arenas, layout="pages", cuda_options=a.cuda_options)) if DEVICE == "cuda" else \
            (lambda t: t.attach_host(arenas, layout="pages"))
        rank = attach(tier)
        proc, remote, server = start_server(g, pool, a.kvtierd, preset)
        rrank = attach(remote)
        try:
            for n in sizes:
                for name, (t, r) in (("kvtier", (tier, rank)), (server, (remote, rrank))):
                    record(preset, g, name, n, contig[n], time_tier(t, r, arenas, n, a.iters, rng, f"{preset} {name} {n}"))
        finally:
            rrank.close()
            rank.close()
            proc.kill()
            dump()
        if pega_version is None:
            continue
        try:
            pf = Pegaflow(a.pega_pool)
        except Exception as e:  # noqa: BLE001 (a contender that fails is reported, not fatal)
            missing.append(f"pegaflow ({preset}): did not start: {type(e).__name__}: {e}")
            print(missing[-1], flush=True)
            continue
        print(f"pegaflow {pega_version}: server at {pf.endpoint}, pool {a.pega_pool}", flush=True)
        try:
            pf.register(f"kvtier-bench-{preset}", arenas, mla=preset == "glm52")
            for n in sizes:
                what = f"{preset} pegaflow {n}"
                record(preset, g, "pegaflow", n, contig[n], time_pegaflow(pf, arenas, n, a.iters, rng, what))
        except Exception as e:  # noqa: BLE001 (AssertionError: restored bytes differ)
            missing.append(f"pegaflow ({preset}): {type(e).__name__}: {e}")
            print(missing[-1], flush=True)
        finally:
            pf.close()
            dump()
    dump()

if __name__ == "__main__":
    main()
