"""A Unix-socket relay between kvtier clients and a tier daemon, run by Python threads.

Every byte a client sends to the daemon or receives from it passes through Python code here
(file descriptors too: the pool's memfd that the daemon's welcome carries). So a call on a
connected tier can get its reply only while the thread that made it has released the GIL: a call
that holds the GIL across a daemon round trip through this relay waits until the client's reply
timeout and fails with ``DisconnectedError``. That makes the relay a GIL-release detector with no
timing in it.

``hold()`` stops forwarding client requests: the next request that arrives sets ``held`` and waits
until ``let_go()``, so a test knows that a thread is inside a round trip (holding whatever kvtier
holds across it, with the GIL released) and can act while it is there.
"""

from __future__ import annotations

import os
import socket
import threading


class Relay:
    def __init__(self, upstream: str, path: str) -> None:
        self.upstream = upstream
        self.path = path
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()
        self.after = 0
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def hold(self, after: int = 0) -> None:
        """Hold the next client request (and every later one) until ``let_go()``; with ``after``,
        forward that many requests first (each a request the client writes at once and whose reply
        it waits for before it writes the next, so one read each)."""
        self.after = after
        self.held.clear()
        self.gate.clear()

    def let_go(self) -> None:
        self.gate.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            daemon = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            daemon.connect(self.upstream)
            threading.Thread(target=self._pump, args=(client, daemon, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(daemon, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while True:
                data, fds, _flags, _addr = socket.recv_fds(src, 1 << 16, 4)
                if not data:
                    break
                if requests and not self.gate.is_set():
                    if self.after > 0:
                        self.after -= 1
                    else:
                        self.held.set()
                        self.gate.wait()
                try:
                    if fds:
                        sent = socket.send_fds(dst, [data], fds)
                        if sent < len(data):
                            dst.sendall(data[sent:])
                    else:
                        dst.sendall(data)
                finally:
                    for fd in fds:
                        os.close(fd)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
