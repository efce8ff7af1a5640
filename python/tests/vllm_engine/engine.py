"""Runs a real vLLM engine (the CPU build) on a tiny random Llama for the connector's tests, one
scenario per process (vLLM keeps process-wide state), and prints its findings as one JSON line
``RESULT {...}``.

    python engine.py SCENARIO '{"model": DIR, ...}'

Scenarios: ``plain`` (no connector: the reference tokens), ``roundtrip`` (an in-process pool:
cold, warm, shared prefix, unrelated prompt, perturbed pool), ``client`` (a kvtierd at
``socket``: the prompts in order, with optional faults between them).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

BLOCK = 32  # tokens a block (the CPU backend wants a multiple of 32)


def make_model(path: str) -> None:
    """A 2-layer Llama (hidden 128, 4 heads, 2 KV heads, vocab 1,024), random weights, seed 0."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024, max_position_embeddings=2048)
    LlamaForCausalLM(cfg).save_pretrained(path)


def prompts():
    """A: 200 tokens; B: A's first 128 tokens then others; C: unrelated."""
    a = [(7 * i + 3) % 1000 + 1 for i in range(200)]
    b = a[:128] + [(11 * i + 5) % 1000 + 1 for i in range(72)]
    c = [(13 * i + 9) % 1000 + 1 for i in range(200)]
    return {"A": a, "B": b, "C": c}


def engine(args: dict, connector: dict | None, events_endpoint: str | None = None):
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    events = None
    if events_endpoint is not None:
        events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint, topic="kv")

    ktc = None
    if connector is not None:
        ktc = KVTransferConfig(kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
                               kv_role=connector.get("role", "kv_both"), engine_id=connector.get("engine_id"),
                               kv_connector_extra_config=connector.get("extra", {}))
    return LLM(model=args["model"], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
               max_model_len=1024, kv_cache_memory_bytes=32 << 20, block_size=BLOCK, seed=0,
               kv_transfer_config=ktc, kv_events_config=events)


def run(llm, tokens):
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    return {"tokens": list(out.outputs[0].token_ids), "cached": int(out.num_cached_tokens or 0)}


def settle(llm) -> bool:
    """Empties vLLM's own prefix cache, stepping the engine (a one-token request) until the
    delayed frees of finished saves are done. True once emptied."""
    from vllm import SamplingParams

    for _ in range(100):
        if llm.reset_prefix_cache():
            return True
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(0.05)
    return False


def zero_kv() -> None:
    """Zeroes every block of the engine's KV cache (single-process mode, vLLM's prefix cache
    emptied, no request running): a block a restore leaves out then holds zeros, not the bytes of
    an earlier request that happened to use it. (A restore that only permutes whole blocks of a
    prefix changes no token: RoPE is in the cached keys and attention sums over all of them; the
    seeded bugs of ci/vllm.sh are chosen so that they do.)"""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    for view in get_kv_transfer_group()._worker._views:
        view.zero_()


def scheduler_connector(llm):
    """The scheduler side's connector (single-process mode only)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector


def perturb(llm, tokens) -> int:
    """Overwrites the pool's blocks of ``tokens`` with noise: restores them into host arrays,
    evicts every block, saves the noisy bytes under the same keys. Returns the blocks changed."""
    import numpy as np

    import kvtier
    from kvtier.vllm.keys import RequestKeys

    conn = scheduler_connector(llm)
    planner = conn._planner
    tier = kvtier.connect(planner.socket)
    n = (len(tokens) - 1) // BLOCK
    keys = planner.shards[0].keys(RequestKeys(planner.base, BLOCK).upto(tokens, n))
    arrays = [np.zeros((n, a["bytes_per_page"]), dtype=np.uint8) for a in tier.geometry.arenas]
    rank = tier.attach_host(arrays, layout="pages")
    with tier.query(keys) as lease:
        assert len(lease) == n, (len(lease), n)
        rank.restore(lease, list(range(n))).wait()
    tier.evict(tier.capacity)
    rng = np.random.default_rng(1)
    for a in arrays:
        a[:] = rng.integers(0, 255, size=a.shape, dtype=np.uint8) & 0x3F  # small float32 exponents
    ticket = rank.save(keys, list(range(n)))
    ticket.wait()
    rank.close()
    return len(ticket.saving)


def scenario_plain(args):
    llm = engine(args, None)
    return {name: run(llm, toks) for name, toks in prompts().items()}


def scenario_roundtrip(args):
    p = prompts()
    # One layer group per layer (the tiny model's restores are far under the default's 8 MiB).
    llm = engine(args, {"extra": {"pool": "64MiB", "layer_group_bytes": 1}, "engine_id": args.get("engine_id")})
    out = {"cold_A": run(llm, p["A"])}
    out["settled"] = settle(llm)
    zero_kv()
    out["warm_A"] = run(llm, p["A"])
    settle(llm)
    zero_kv()
    out["B"] = run(llm, p["B"])
    settle(llm)
    out["C"] = run(llm, p["C"])
    settle(llm)
    planner = scheduler_connector(llm)._planner
    out["planner"] = dict(planner.stats)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    out["worker"] = dict(get_kv_transfer_group()._worker.stats)
    out["perturbed_blocks"] = perturb(llm, p["A"])
    settle(llm)
    zero_kv()
    out["perturbed_A"] = run(llm, p["A"])
    return out


def scenario_client(args):
    """A kvtierd client: runs ``args["steps"]``: ``["run", NAME]``, ``["settle"]``,
    ``["kill", PID]`` (SIGKILL the daemon), ``["wait_socket", PATH]``."""
    p = prompts()
    extra = {"socket": args["socket"], "reconnect_s": 0.2}
    extra.update(args.get("extra", {}))
    llm = engine(args, {"extra": extra, "role": args.get("role", "kv_both")})
    out = {"runs": []}
    for step in args["steps"]:
        if step[0] == "run":
            out["runs"].append({"name": step[1], **run(llm, p[step[1]])})
        elif step[0] == "settle":
            out.setdefault("settled", []).append(settle(llm))
        elif step[0] == "kill":
            os.kill(int(step[1]), signal.SIGKILL)
            time.sleep(0.2)
        elif step[0] == "wait_socket":
            deadline = time.time() + 30
            while not os.path.exists(step[1]) and time.time() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)
    return out


def scenario_events(args):
    """Runs A with vLLM's KV event publisher on, a ZMQ subscriber in this process decoding each
    batch with vLLM's own ``KVEventBatch``; returns what the batches said."""
    import threading

    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    endpoint = f"tcp://127.0.0.1:{args['port']}"
    got, stop = [], threading.Event()

    def listen():
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not stop.is_set():
            if sub.poll(100):
                _topic, _seq, payload = sub.recv_multipart()
                for e in decoder.decode(payload).events:
                    if isinstance(e, BlockStored):
                        got.append({"type": "stored", "medium": e.medium, "blocks": len(e.block_hashes),
                                    "tokens": list(e.token_ids), "hashes": [h.hex() if isinstance(h, bytes) else h for h in e.block_hashes]})
                    elif isinstance(e, BlockRemoved):
                        got.append({"type": "removed", "medium": e.medium, "blocks": len(e.block_hashes)})
        sub.close()

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    time.sleep(0.5)
    llm = engine(args, {"extra": {"pool": "64MiB"}}, events_endpoint=endpoint.replace("127.0.0.1", "*"))
    time.sleep(1.0)  # the subscriber joins before the first batch
    p = prompts()
    out = {"A": run(llm, p["A"])}
    settle(llm)
    run(llm, [3, 4])
    time.sleep(1.0)
    stop.set()
    t.join()
    out["events"] = got
    out["prompt_A"] = p["A"]
    return out


if __name__ == "__main__":
    name, args = sys.argv[1], json.loads(sys.argv[2])
    if name == "make_model":
        make_model(args["model"])
        result = {}
    else:
        result = globals()[f"scenario_{name}"](args)
    print("RESULT " + json.dumps(result), flush=True)
