"""A connection to the pool that comes back by itself.

The tier is a cache: a daemon that is not running yet, dies or restarts must never fail a request.
:class:`PoolLink` opens the pool on first use, drops it on any :class:`DisconnectedError`, and
tries again at most every ``reconnect_s`` seconds; in between, callers see ``None`` and go on
without the tier (a miss, a save skipped).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from ..errors import DisconnectedError, KvtierError

__all__ = ["PoolLink"]

log = logging.getLogger("kvtier.vllm")


class PoolLink:
    """``open()`` makes the pool handle (a ``kvtier.Tier``, or whatever the caller builds on it,
    such as a tier with an attached rank); ``get()`` returns it or None while it cannot be had."""

    def __init__(self, what: str, open: Callable[[], Any], reconnect_s: float):
        self._what = what
        self._open = open
        self._reconnect_s = reconnect_s
        self._value: Optional[Any] = None
        self._next_try = 0.0
        self._warned = False
        #: Times the pool was (re)opened and lost, for the connector's stats.
        self.opened = 0
        self.lost = 0

    def get(self) -> Optional[Any]:
        if self._value is not None:
            return self._value
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + self._reconnect_s
        try:
            self._value = self._open()
        except KvtierError as e:
            if not self._warned:
                log.warning("kvtier: %s unavailable, running without it until it is: %s", self._what, e)
                self._warned = True
            return None
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
