"""PahoClient's record of the replies it waits on: a future per packet identifier, resolved when
paho reports the publish sent (for QoS 1, the broker's PUBACK), or failed with ReplyRefused when
the broker refused it (a reason code of 0x80 or more: resending would not help); and the request
each answers (its reply topic and Correlation Data), so that the replies to one request, sent
again after each reconnect, are given up together."""

from __future__ import annotations

import asyncio
from typing import Any

from .undeliverable import ReplyRefused

ReplyKey = tuple[str, bytes | None]  # a reply's topic and Correlation Data: the request it answers


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
        self._keys: dict[int, ReplyKey] = {}  # of the waiters
        self._early: dict[int, ReplyRefused | None] = {}
        self._ignored: set[int] = set()

    def wait(self, loop: asyncio.AbstractEventLoop, mid: int, key: ReplyKey) -> asyncio.Future:
        """A future for `mid`: True once sent; ReplyRefused when the broker refused it."""
        future = loop.create_future()
        self._ignored.discard(mid)  # a new publish reuses the mid of one that never completed
        if mid in self._early:
            _settle(future, self._early.pop(mid))
        else:
            self._waiters[mid] = future
            self._keys[mid] = key
        return future

    def key_of(self, mid: int) -> ReplyKey | None:
        """The request `mid` answers (its reply topic and Correlation Data), while waited on."""
        return self._keys.get(mid)

    def same_request(self, mid: int) -> list[int]:
        """The mids waited on that answer the same request as `mid` (itself included, if waited on)."""
        key = self._keys.get(mid)
        return [m for m, k in self._keys.items() if k == key] if key is not None else []

    def done(self, mid: int, refused: ReplyRefused | None = None) -> None:
        """Called by paho's on_publish (`refused`: the broker's failure reason code)."""
        if mid in self._ignored:
            self._ignored.discard(mid)
            return
        future = self._waiters.pop(mid, None)
        self._keys.pop(mid, None)
        if future is None:
            self._early[mid] = refused
        else:
            _settle(future, refused)

    def forget(self, mid: int, pending: bool = True) -> None:
        """Nobody will wait for `mid`; `pending`: its on_publish may still come (ignore it then)."""
        self._waiters.pop(mid, None)
        self._keys.pop(mid, None)
        if mid not in self._early and pending:
            self._ignored.add(mid)
        self._early.pop(mid, None)


def _settle(future: asyncio.Future, refused: ReplyRefused | None) -> None:
    if refused is None:
        resolve(future, True)
    elif not future.done():
        future.set_exception(refused)


def resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)
