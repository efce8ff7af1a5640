"""kvtier's connector in a real vLLM engine (vLLM's CPU build, a tiny random Llama, greedy
decoding, prompts as token ids). Every output is compared with an engine without the connector:
the tier is a cache and never changes a token."""

from __future__ import annotations

import kvtier

from support import Daemon, run_engine

BLOCK = 32


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
