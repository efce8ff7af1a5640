"""A connection to the pool that comes back by itself.

The tier is a cache: a daemon that is not running yet, dies or restarts must never fail a request,
and must never hold the engine's scheduler or a worker's step for long. :class:`PoolLink` opens
the pool on first use (on the caller's thread: an engine starting next to its daemon finds it at
once), drops it on any :class:`DisconnectedError`, and tries again at most every ``reconnect_s``
seconds on a thread of its own; the call that starts an attempt waits for it at most ``wait_s``
seconds, and calls while it is still connecting do not wait (a daemon that accepts the connection
but does not answer, stopped or overloaded, costs the caller ``wait_s`` once per ``reconnect_s``,
never the connection's own timeout). In between, callers see
``None`` and go on without the tier (a miss, a save skipped).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from ..errors import DisconnectedError, KvtierError

__all__ = ["PoolLink", "RECONNECT_WAIT_S"]

log = logging.getLogger("kvtier.vllm")

#: How long a caller waits for a reconnection attempt before going on without the pool
#: (seconds). A local daemon answers a connection in well under a millisecond.
RECONNECT_WAIT_S = 0.05


class PoolLink:
    """``open()`` makes the pool handle (a ``kvtier.Tier``, or whatever the caller builds on it,
    such as a tier with an attached rank); ``get()`` returns it or None while it cannot be had.
    ``get()`` and ``failed()`` are called from one thread (the scheduler's, or a worker's)."""

    def __init__(self, what: str, open: Callable[[], Any], reconnect_s: float, wait_s: float = RECONNECT_WAIT_S):
        self._what = what
        self._open = open
        self._reconnect_s = reconnect_s
        self._wait_s = wait_s
        self._value: Optional[Any] = None
        self._next_try = 0.0
        self._warned = False
        self._tried = False  # the first open ran (inline)
        self._attempt: Optional[_Attempt] = None  # a reconnection in flight on its own thread
        #: Times the pool was (re)opened and lost, for the connector's stats.
        self.opened = 0
        self.lost = 0

    def get(self) -> Optional[Any]:
        if self._value is not None:
            return self._value
        if self._attempt is not None:  # still connecting: a look, no wait
            return self._collect(self._attempt.wait(0))
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + self._reconnect_s
        if not self._tried:
            self._tried = True
            attempt = _Attempt(self._open, inline=True)
        else:
            attempt = self._attempt = _Attempt(self._open, inline=False)
        return self._collect(attempt.wait(self._wait_s))

    def _collect(self, attempt: Optional["_Attempt"]) -> Optional[Any]:
        if attempt is None:  # still connecting
            return None
        self._attempt = None
        if attempt.error is not None:
            if not isinstance(attempt.error, KvtierError):
                raise attempt.error  # a fault of ours on the reconnecting thread: the caller sees it
            if not self._warned:
                log.warning("kvtier: %s unavailable, running without it until it is: %s", self._what, attempt.error)
                self._warned = True
            return None
        self._value = attempt.value
        self.opened += 1
        if self._warned:
            log.warning("kvtier: %s available again", self._what)
            self._warned = False
        return self._value

    def failed(self, error: BaseException) -> None:
        """Reports an error from a call on the handle: a lost daemon drops the handle (tried
        again later); any other error leaves it."""
        if isinstance(error, DisconnectedError) and self._value is not None:
            log.warning("kvtier: lost %s: %s", self._what, error)
            self._value = None
            self.lost += 1
            self._warned = True
            self._next_try = time.monotonic() + self._reconnect_s

    def close(self) -> None:
        self._value = None
        self._attempt = None


class _Attempt:
    """One call of ``open``: inline, or on a daemon thread the caller may stop waiting for."""

    def __init__(self, open: Callable[[], Any], inline: bool):
        self.value: Optional[Any] = None
        self.error: Optional[BaseException] = None
        self._done = threading.Event()
        if inline:
            try:
                self.value = open()
            except KvtierError as e:  # anything else is a fault of ours: the caller sees it
                self.error = e
            self._done.set()
        else:
            threading.Thread(target=self._run, args=(open,), name="kvtier-reconnect", daemon=True).start()

    def _run(self, open: Callable[[], Any]) -> None:
        try:
            self.value = open()
        except KvtierError as e:
            self.error = e
        except BaseException as e:  # noqa: BLE001 - reported to the caller's thread, never lost
            self.error = e
        finally:
            self._done.set()

    def wait(self, timeout: float) -> Optional["_Attempt"]:
        """Self once the attempt is over (within ``timeout`` seconds), else None."""
        return self if self._done.wait(timeout) else None
