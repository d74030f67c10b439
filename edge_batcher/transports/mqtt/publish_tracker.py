"""PahoClient's record of the replies it waits on: a future per packet identifier, resolved when
paho reports the publish sent (for QoS 1, the broker's PUBACK)."""

from __future__ import annotations

import asyncio
from typing import Any


class PublishTracker:
    """Futures that resolve when paho reports a publish as sent (on_publish). All of it runs on
    the event loop: paho calls back inside the loop's reads and writes.

    paho writes what publish() queued on a later loop turn, so on_publish comes after wait(); a
    mid that completes before anyone waits on it (were paho to write at once) is still
    remembered in `early` and consumed by the waiter. Every mid is either waited on or
    forgotten, so neither table grows.
    """

    def __init__(self) -> None:
        self._waiters: dict[int, asyncio.Future] = {}
        self._early: dict[int, bool] = {}
        self._ignored: set[int] = set()

    def wait(self, loop: asyncio.AbstractEventLoop, mid: int) -> asyncio.Future:
        future = loop.create_future()
        self._ignored.discard(mid)  # a new publish reuses the mid of one that never completed
        ok = self._early.pop(mid, None)
        if ok is None:
            self._waiters[mid] = future
        else:
            future.set_result(ok)
        return future

    def done(self, mid: int, ok: bool) -> None:
        """Called by paho's on_publish."""
        if mid in self._ignored:
            self._ignored.discard(mid)
            return
        future = self._waiters.pop(mid, None)
        if future is None:
            self._early[mid] = ok
        else:
            resolve(future, ok)

    def forget(self, mid: int, pending: bool = True) -> None:
        """Nobody will wait for `mid`; `pending`: its on_publish may still come (ignore it then)."""
        self._waiters.pop(mid, None)
        if self._early.pop(mid, None) is None and pending:
            self._ignored.add(mid)


def resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)
