"""Helpers for the tests against a real vLLM engine (vLLM's CPU build, ``ci/vllm.sh``).

Each engine runs in a process of its own (``engine.py``): vLLM keeps process-wide state; a
``kvtierd`` for the tests that share one (``KVTIERD_BIN``, or ``target/release/kvtierd``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE = os.path.join(HERE, "engine.py")


def run_engine(scenario: str, args: dict, *, single_process: bool = True, timeout: float = 420, env: dict | None = None):
    """Runs ``engine.py SCENARIO ARGS`` and returns its RESULT. ``single_process``: the engine
    core in the calling process (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); False is vLLM's
    default, the scheduler and the worker in separate processes."""
    e = dict(os.environ)
    e["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if single_process else "1"
    e.update(env or {})
    proc = subprocess.run([sys.executable, ENGINE, scenario, json.dumps(args)], capture_output=True, text=True,
                          timeout=timeout, env=e)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"engine.py {scenario} exited {proc.returncode} without a result:\n"
                         f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


def kvtierd_bin() -> str:
    path = os.environ.get("KVTIERD_BIN") or shutil.which("kvtierd")
    if path is None:
        root = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(root, "target"))
        path = os.path.join(target, "release", "kvtierd")
    if not os.path.exists(path):
        pytest.fail(f"no kvtierd at {path}: build it (cargo build --release -p kvtierd) or set KVTIERD_BIN")
    return path


# The tiny model's blocks on the CPU backend: per layer [2 KV heads, 32 tokens, 2 x 32 dims] x 4 B.
DAEMON_GEOMETRY = ["--model", "vllm", "--page-tokens", "32", "--arena", "L0:16384", "--arena", "L1:16384"]


class Daemon:
    """A kvtierd on a socket in a private directory, for one test."""

    def __init__(self, sock_dir: str, pool: str = "64MiB", extra: list | None = None, name: str = "kvtierd.sock"):
        self.socket = os.path.join(sock_dir, name)
        self.args = [kvtierd_bin(), "--socket", self.socket, *DAEMON_GEOMETRY, "--pool", pool, "--backing", "plain",
                     *(extra or [])]
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 30
        while time.time() < deadline:
            if os.path.exists(self.socket):
                try:
                    import kvtier

                    kvtier.connect(self.socket)
                    return
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
            if self.proc.poll() is not None:
                raise AssertionError(f"kvtierd exited {self.proc.returncode}: {self.proc.stdout.read()}")
            time.sleep(0.1)
        raise AssertionError("kvtierd did not start listening in 30 s")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


