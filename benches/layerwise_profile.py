"""Which of the suffix's kernels run slower beside a layer-wise restore: a kernel-level profile.

What it measures (one NVIDIA GPU, torch with CUDA, the kvtier wheel): the random Llama-3-8B of
``kvtier.examples.llama_restore`` (bf16, 16-token pages), a prefix of ``--prefix`` tokens saved
once, then two ways of running the ``--suffix``-token suffix over it, each ``--runs`` times under
``torch.profiler`` (device activity) after one warm-up:

- **suffix alone**: the prefix's pages already restored (the suffix's own compute, nothing beside);
- **layer-wise restore + suffix**: the prefix restored from the tier into other pages with
  ``Rank.restore_layers`` (one readiness per layer), the suffix's forward waiting per layer inside
  its cache's ``update`` (what the example's "warm, layer-wise" column times).

Then, without the profiler, ``--runs`` more runs of each way time the host side: how long the
engine's thread takes to enqueue the suffix's forward (from its start until ``forward`` returns,
before any synchronisation; the layer-wise way's includes the ``restore_layers`` submission, also
timed on its own) against the wall time of the run, and the GPU time the engine's stream stood at
the layer waits (``PagedCache(time_waits=True)``). An enqueue time close to the wall time says the
GPU waited for the host's launches; long waits say it waited for the copy.

It prints each way's wall time per run, the GPU time of the engine's kernels summed over the runs
(everything but kvtier's own copy kernels and the copy engines' memcpys and memsets), the busiest
device activities, and for every engine kernel above 1 ms the ratio of its time beside the restore
to its time alone: a kernel slowed by the copy running beside it shows a ratio above 1. The last
token's logits of the two ways are compared bitwise (the restore brought the prefix's bytes).

Usage: ``python benches/layerwise_profile.py --prefix 65536 [--cuda-option KEY=VALUE ...]`` (at
65,536 tokens it needs about 40 GB of GPU memory: 16 GB of weights and two copies of the prefix's
pages, 8.6 GB each, besides the activations; and a pinned host pool of the prefix's size, 8.6 GB).
``--cuda-option`` passes a copy tuning option to ``Tier.attach_cuda`` (as the Llama example's).
"""

import argparse
import collections
import os
import random
import time

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from kvtier.examples.llama_restore import (  # noqa: E402
    PAGE_TOKENS,
    Bench,
    add_cuda_option_argument,
    cuda_options_from,
)
from kvtier.examples.paged_cache import PagedCache  # noqa: E402


def engine_kernel(name: str) -> bool:
    """True for the engine's own kernels: not kvtier's copy kernels, not memcpys or memsets."""
    return "kvt_" not in name and "Memcpy" not in name and "Memset" not in name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefix", type=int, default=65536, help="prefix tokens (a multiple of 16; default 65536)")
    p.add_argument("--suffix", type=int, default=128, help="suffix tokens (default 128)")
    p.add_argument("--runs", type=int, default=3, help="profiled runs of each way, after one warm-up (default 3)")
    add_cuda_option_argument(p)
    a = p.parse_args()
    cuda_options = cuda_options_from(p, a.cuda_option)
    b = Bench(
        "llama3-8b", max_prefix=a.prefix, suffix=a.suffix, greedy=1, torch_baselines=False, cuda_options=cuda_options
    )
    dev, kv = b.device, b.kv
    pages = a.prefix // PAGE_TOKENS
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, b.cfg.vocab_size, (1, a.prefix + a.suffix), generator=gen)
    id_list = ids[0].tolist()
    ids = ids.to(dev)
    perm = list(range(kv.pages))
    random.Random(1).shuffle(perm)
    cold, warm = perm[:pages], perm[pages : 2 * pages]
    tail = perm[2 * pages : 2 * pages + b.tail_pages]
    stream = torch.cuda.current_stream(dev)
    # The prefix's prefill into the cold pages, saved; restored once whole into the warm pages.
    b._forward(PagedCache(kv, cold + tail), ids[:, : a.prefix], keep=1)
    keys = b._keys(id_list, pages)
    b.rank.save(keys, cold, after_stream=stream).wait()
    with b.tier.query(keys) as lease:
        b.rank.restore(lease, warm, after_stream=stream).wait()
    logits = {}

    host = collections.defaultdict(list)  # label -> [(submit ms, enqueue ms, wait ms)]

    def alone(timed=False):
        c = PagedCache(kv, warm + tail, cached_tokens=a.prefix, time_waits=timed)
        t = time.perf_counter()
        logits["alone"] = b._forward(c, ids[:, a.prefix :], keep=1).logits
        if timed:
            host["alone"].append((0.0, (time.perf_counter() - t) * 1e3, 0.0))

    def layer_wise(timed=False):
        c = PagedCache(kv, warm + tail, cached_tokens=a.prefix, time_waits=timed)
        c.prepare(a.suffix)
        t = time.perf_counter()
        with b.tier.query(keys) as lease:
            h = b.rank.restore_layers(lease, warm, b.cfg.num_hidden_layers, after_stream=stream)
        submit = (time.perf_counter() - t) * 1e3
        c.restore = h
        logits["layer-wise"] = b._forward(c, ids[:, a.prefix :], keep=1).logits
        if timed:
            enqueue = (time.perf_counter() - t) * 1e3
            per_layer = c.wait_ms()
            waits = sum(ms for _, ms in per_layer)
            host["layer-wise"].append((submit, enqueue, waits))
            host["layer waits"] = [ms for _, ms in per_layer]
        h.wait()

    def run(fn, label):
        fn()
        torch.cuda.synchronize()
        walls = []
        with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
            for _ in range(a.runs):
                torch.cuda.synchronize()
                t = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t) * 1e3)
        per = collections.defaultdict(lambda: [0, 0.0])  # full name -> [count, ms]
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name][0] += 1
                per[e.name][1] += e.time_range.elapsed_us() / 1e3
        engine = sum(ms for name, (_, ms) in per.items() if engine_kernel(name))
        print(f"== {label}: wall ms a run {[round(w, 1) for w in walls]}")
        print(f"   engine kernels, GPU time over {a.runs} runs: {engine:.1f} ms")
        for name, (n, ms) in sorted(per.items(), key=lambda kv: -kv[1][1])[:12]:
            print(f"   {ms:9.2f} ms {n:6d}x  {name[:60]}")
        return per

    gpu = torch.cuda.get_device_name(dev)
    print(
        f"{gpu}, torch {torch.__version__}; prefix {a.prefix} tokens, suffix {a.suffix}, {a.runs} runs each;"
        f" cuda_options {cuda_options}"
    )
    alone_k = run(alone, "suffix alone")
    layer_k = run(layer_wise, "layer-wise restore + suffix")
    print("== engine kernels over 1 ms: time beside the layer-wise restore / time alone")
    for name, (_, ms) in sorted(alone_k.items(), key=lambda kv: -kv[1][1]):
        if ms > 1 and engine_kernel(name) and name in layer_k:
            print(f"   {layer_k[name][1] / ms:.3f}  {ms:8.2f} -> {layer_k[name][1]:8.2f} ms  {name[:60]}")
    print(f"== host side, {a.runs} runs each without the profiler (ms a run: wall; submission of the restore;")
    print("   the engine thread's enqueue of the forward, from the start; GPU time at the layer waits)")
    for label, fn in (("alone", alone), ("layer-wise", layer_wise)):
        for _ in range(a.runs):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn(timed=True)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) * 1e3
            submit, enqueue, waits = host[label][-1]
            print(f"   {label:10s} wall {wall:7.1f}  submit {submit:6.1f}  enqueue {enqueue:7.1f}  waits {waits:6.1f}")
    print("   the last layer-wise run's waits, ms per layer: " + " ".join(f"{ms:.1f}" for ms in host["layer waits"]))
    same = torch.equal(logits["alone"], logits["layer-wise"])
    print(f"last token's logits bitwise equal (alone, layer-wise): {same}")


if __name__ == "__main__":
    main()
