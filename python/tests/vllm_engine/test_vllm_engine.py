"""kvtier's connector in a real vLLM engine (vLLM's CPU build, a tiny random Llama, greedy
decoding, prompts as token ids). Every output is compared with an engine without the connector:
the tier is a cache and never changes a token."""

from __future__ import annotations

import os

import kvtier

from support import Daemon, run_engine

BLOCK = 32
LAYERS = 2  # the test model's decoder layers (engine.py's tiny Llama)


def test_a_prefix_comes_back_from_the_pool_with_the_same_tokens(model_dir, reference):
    r = run_engine("roundtrip", {"model": model_dir})
    assert r["cold_A"] == {"tokens": reference["A"]["tokens"], "cached": 0}
    assert r["settled"], "vLLM's prefix cache could not be emptied"
    # vLLM's own prefix cache is empty: the 6 full blocks before A's last token come from kvtier.
    assert r["warm_A"] == {"tokens": reference["A"]["tokens"], "cached": 6 * BLOCK}
    # B shares A's first 128 tokens (4 blocks): those blocks only.
    assert r["B"] == {"tokens": reference["B"]["tokens"], "cached": 4 * BLOCK}
    assert r["C"] == {"tokens": reference["C"]["tokens"], "cached": 0}
    assert r["planner"]["load_orders"] == 2 and r["planner"]["saved_requests"] >= 3
    # Layer-wise restores: the forward waited for each of the model's layers before its
    # attention (vLLM calls wait_for_layer_load), never reading a layer it had not waited for.
    assert r["worker"]["restored_blocks"] == 10
    assert r["worker"]["layer_waits"] == 2 * LAYERS and r["worker"]["layers_unwaited"] == 0
    # Control: noise written into the pool's blocks of A changes A's tokens (the KV is used).
    assert r["perturbed_blocks"] == 6
    assert r["perturbed_A"]["cached"] == 6 * BLOCK
    assert r["perturbed_A"]["tokens"] != reference["A"]["tokens"]


def test_two_engine_processes_share_one_kvtierd(model_dir, reference, daemon):
    # vLLM's default mode: the scheduler and the worker in separate processes.
    first = run_engine("client", {"model": model_dir, "socket": daemon.socket, "steps": [["run", "A"], ["settle"]]},
                       single_process=False)
    assert first["runs"][0]["tokens"] == reference["A"]["tokens"]
    second = run_engine("client", {"model": model_dir, "socket": daemon.socket, "steps": [["run", "A"], ["run", "C"]]},
                        single_process=False)
    a, c = second["runs"]
    assert a == {"name": "A", "tokens": reference["A"]["tokens"], "cached": 6 * BLOCK}
    assert c == {"name": "C", "tokens": reference["C"]["tokens"], "cached": 0}
    stats = kvtier.connect(daemon.socket).stats()
    assert stats["ready_slots"] >= 6 and stats["restored_blocks"] >= 6


def test_async_loads_restore_the_same_prefix(model_dir, reference, daemon):
    # "load": "async": the request waits a step while its blocks come back (finished_recving).
    steps = [["run", "A"], ["settle"], ["run", "A"], ["run", "B"]]
    r = run_engine("client", {"model": model_dir, "socket": daemon.socket, "steps": steps, "extra": {"load": "async"}})
    cold, warm, b = r["runs"]
    assert cold["tokens"] == warm["tokens"] == reference["A"]["tokens"]
    assert warm["cached"] == 6 * BLOCK
    assert b["tokens"] == reference["B"]["tokens"]


def test_a_daemon_killed_mid_run_changes_no_token(model_dir, reference, sock_dir):
    d = Daemon(sock_dir)
    try:
        steps = [["run", "A"], ["settle"], ["kill", d.pid], ["run", "A"], ["run", "B"], ["run", "C"]]
        r = run_engine("client", {"model": model_dir, "socket": d.socket, "steps": steps})
    finally:
        d.stop()
    for run in r["runs"]:
        assert run["tokens"] == reference[run["name"]]["tokens"], run
    # vLLM's own prefix cache was emptied before the kill, and the daemon is gone: A is a miss.
    assert r["runs"][1]["cached"] == 0


def test_a_restarted_daemon_is_found_again(model_dir, reference, sock_dir):
    d = Daemon(sock_dir)
    try:
        d.stop()
        # The engine starts with no daemon, runs A (a miss, no save), then the daemon comes back.
        steps = [["run", "A"], ["settle"], ["wait_socket", d.socket], ["run", "A"], ["settle"], ["run", "A"]]
        import threading

        threading.Timer(2.0, d.start).start()
        r = run_engine("client", {"model": model_dir, "socket": d.socket, "steps": steps})
    finally:
        d.stop()
    assert [run["tokens"] for run in r["runs"]] == [reference["A"]["tokens"]] * 3
    assert r["runs"][-1]["cached"] == 6 * BLOCK


def test_a_full_pool_changes_no_token(model_dir, reference, sock_dir):
    # A pool of 3 slots: A's 6 blocks never all fit; what is saved is a prefix.
    d = Daemon(sock_dir, pool=str(3 * 32768))
    try:
        steps = [["run", "A"], ["settle"], ["run", "A"], ["run", "C"], ["settle"], ["run", "B"]]
        r = run_engine("client", {"model": model_dir, "socket": d.socket, "steps": steps})
    finally:
        d.stop()
    for run in r["runs"]:
        assert run["tokens"] == reference[run["name"]]["tokens"], run
        assert run["cached"] <= 3 * BLOCK


def test_a_failed_restore_is_recomputed(model_dir, reference, daemon):
    # Every restore is reported failed after its copy (KVTIER_VLLM_FAULT): vLLM recomputes.
    steps = [["run", "A"], ["settle"], ["run", "A"], ["run", "B"]]
    r = run_engine("client", {"model": model_dir, "socket": daemon.socket, "steps": steps},
                   env={"KVTIER_VLLM_FAULT": "restore-fails"})
    for run in r["runs"]:
        assert run["tokens"] == reference[run["name"]]["tokens"], run


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_decode_engine_gets_the_prefill_engines_blocks_through_peers(model_dir, reference, sock_dir):
    # Two instances: a prefill engine on daemon P (which serves its pool to peers), a decode engine
    # on daemon D (which reads its misses from P through NIXL). The daemons need kvtierd built with
    # the feature `nixl` and the NIXL runtime (ci/nixl.sh) in the environment.
    port = free_port()
    secret = os.path.join(sock_dir, "peer.secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(os.urandom(32))
    p = Daemon(sock_dir, name="p.sock", extra=["--peer-listen", f"127.0.0.1:{port}", "--peer-secret-file", secret])
    d = None
    try:
        d = Daemon(sock_dir, name="d.sock", extra=["--peer", f"127.0.0.1:{port}", "--peer-secret-file", secret])
        prefill = run_engine("client", {"model": model_dir, "socket": p.socket, "role": "kv_producer",
                                        "steps": [["run", "A"], ["settle"]]})
        assert prefill["runs"][0]["tokens"] == reference["A"]["tokens"]
        assert kvtier.connect(p.socket).stats()["ready_slots"] >= 6
        assert kvtier.connect(d.socket).stats()["ready_slots"] == 0
        decode = run_engine("client", {"model": model_dir, "socket": d.socket, "role": "kv_consumer",
                                       "steps": [["run", "A"], ["run", "C"]]})
        a, c = decode["runs"]
        assert a == {"name": "A", "tokens": reference["A"]["tokens"], "cached": 6 * BLOCK}
        assert c == {"name": "C", "tokens": reference["C"]["tokens"], "cached": 0}
        # The decode side saves nothing (kv_consumer): its 6 blocks came from the prefill's pool.
        assert kvtier.connect(d.socket).stats()["ready_slots"] == 6
    finally:
        if d is not None:
            d.stop()
        p.stop()


def test_kv_events_announce_the_pools_blocks_in_vllms_format(model_dir, reference):
    r = run_engine("events", {"model": model_dir, "port": free_port()})
    assert r["A"]["tokens"] == reference["A"]["tokens"]
    cpu = [e for e in r["events"] if e["type"] == "stored" and e["medium"] == "CPU"]
    gpu = [e for e in r["events"] if e["type"] == "stored" and e["medium"] in ("GPU", None)]
    # One BlockStored for the pool: A's 6 full blocks computed before it finished (its 200 prompt
    # tokens and 11 of its 12 generated ones: 211 tokens, 6 blocks of 32), under the engine's
    # own block hashes, which vLLM's GPU events use too.
    assert len(cpu) == 1, r["events"]
    assert cpu[0]["blocks"] == 6 and cpu[0]["tokens"] == r["prompt_A"][: 6 * BLOCK]
    gpu_hashes = {h for e in gpu for h in e["hashes"]}
    assert set(cpu[0]["hashes"]) <= gpu_hashes


def test_the_daemons_kv_events_announce_its_pool_to_a_vllm_subscriber(model_dir, reference, sock_dir):
    # kvtierd --kv-events: what the pool stores and evicts, whichever engine saved it, decoded by a
    # ZMQ subscriber with vLLM's own KVEventBatch; the announced hashes are the pool's keys.
    import time

    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    port = free_port()
    d = Daemon(sock_dir, extra=["--kv-events", f"tcp://127.0.0.1:{port}", "--kv-events-topic", "kvtier"])
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kvtier")
    sub.connect(f"tcp://127.0.0.1:{port}")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    batches = []

    def drain(until, timeout=30.0):
        deadline = time.time() + timeout
        while not until() and time.time() < deadline:
            if sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                batches.append((topic, int.from_bytes(seq, "big"), decoder.decode(payload)))

    def hashes(kind, medium):
        return [h for _, _, b in batches for e in b.events if isinstance(e, kind) and e.medium == medium
                for h in e.block_hashes]

    try:
        time.sleep(0.5)  # the subscription reaches the daemon before the engine saves anything
        r = run_engine("client", {"model": model_dir, "socket": d.socket, "steps": [["run", "A"], ["settle"]]})
        assert r["runs"][0]["tokens"] == reference["A"]["tokens"]
        tier = kvtier.connect(d.socket)
        drain(lambda: len(hashes(BlockStored, "CPU")) >= 6)
        stored = hashes(BlockStored, "CPU")
        # A's 6 full blocks, each announced once, under the keys the pool serves them by.
        assert len(stored) == len(set(stored)) == 6 == tier.stats()["ready_slots"]
        assert all(isinstance(h, bytes) and len(h) == 16 for h in stored)
        with tier.query(stored) as lease:
            assert len(lease) == 6
        assert all(e.block_size == BLOCK for _, _, b in batches for e in b.events if isinstance(e, BlockStored))
        assert tier.evict(tier.capacity) == 6
        drain(lambda: len(hashes(BlockRemoved, "CPU")) >= 6)
        assert sorted(hashes(BlockRemoved, "CPU")) == sorted(stored), "every eviction is announced"
        assert [t for t, _, _ in batches] == [b"kvtier"] * len(batches)
        assert [s for _, s, _ in batches] == list(range(len(batches))), "sequence numbers from 0, no gap"
    finally:
        sub.close(linger=0)
        d.stop()


def test_a_secret_kv_event_socket_serves_pyzmq_subscribers_that_give_it_only(sock_dir):
    # --kv-events-secret-file: pyzmq's own PLAIN client against the daemon's socket (no engine).
    import time

    import msgspec
    import numpy as np
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    secret = os.path.join(sock_dir, "events.secret")
    with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(b"a-kv-event-secret-of-some-length\n")
    port = free_port()
    d = Daemon(sock_dir, extra=["--kv-events", f"tcp://127.0.0.1:{port}", "--kv-events-secret-file", secret])
    ctx = zmq.Context.instance()

    def subscriber(password):
        s = ctx.socket(zmq.SUB)
        s.plain_username, s.plain_password = b"kvtier", password
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(f"tcp://127.0.0.1:{port}")
        return s

    good, bad = subscriber(b"a-kv-event-secret-of-some-length"), subscriber(b"a-guess-that-is-not-the-secret")
    try:
        time.sleep(0.5)
        tier = kvtier.connect(d.socket)
        arrays = [np.random.default_rng(0).integers(0, 255, (4, a["bytes_per_page"]), dtype=np.uint8)
                  for a in tier.geometry.arenas]
        rank = tier.attach_host(arrays, layout="pages")
        keys = [bytes([i]) * 16 for i in range(1, 4)]
        rank.save(keys, [0, 1, 2]).wait()
        assert good.poll(30_000), "the subscriber with the secret gets the batch"
        _topic, seq, payload = good.recv_multipart()
        batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
        stored = [h for e in batch.events if isinstance(e, BlockStored) for h in e.block_hashes]
        assert int.from_bytes(seq, "big") == 0 and sorted(stored) == sorted(keys)
        assert not bad.poll(1_000), "the one without it gets nothing"
        rank.close()
    finally:
        good.close(linger=0)
        bad.close(linger=0)
        d.stop()
