"""The bytes of request bodies and messages held at once, one budget for every transport: HTTP bodies
(`http_body.py`) and gRPC messages (`grpc_v2/edge.py`) each hold a `Charge` of their bytes from the
moment their number is known until the handler is done with them (decoded tensors may be views of
them), and a charge that would take the total over `max_inflight_bytes` is refused with 503 naming
the setting. A large gRPC message is charged once all of it has arrived (its window is opened only
when the call's turn comes), so at most `receive_slots` of them (max_inflight_bytes //
max_body_bytes, at least one) are received at once, a call waiting its turn within its body
deadline: such messages and the charged bytes together stay under 2 x max_inflight_bytes. After a
large body is released, glibc's `malloc_trim` runs on a thread: decoding a JSON body of megabytes
allocates several times its size in short-lived objects, whose pages glibc would otherwise keep for
good.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from ..errors import Unavailable
from ..memory.heap import malloc_trim

# Bodies from this size up trigger a malloc_trim once no large body is in progress any more.
TRIM_AFTER_BYTES = 1024 * 1024


class BodyBudget:
    def __init__(self, *, max_body_bytes: int, max_inflight_bytes: int, timeout_s: float):
        self.max_body_bytes = max_body_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.timeout_s = timeout_s  # body_timeout_s: the time a client has to send a whole body or message
        self.held = 0  # bytes charged to bodies in progress
        self.rejected_total = 0
        self.large_in_progress = 0  # bodies of TRIM_AFTER_BYTES or more being read or used
        self.trim = malloc_trim()
        self.receive_slots = max(1, max_inflight_bytes // max_body_bytes)
        self.receiving = 0  # messages of unknown size being received
        self._slot_waiters: deque[asyncio.Future[None]] = deque()

    def charge(self) -> Charge:
        return Charge(self)

    @contextmanager
    def holding(self, n: int, what: str) -> Iterator[None]:
        """Charge `n` bytes already received for as long as the block runs (503 when over)."""
        charge = Charge(self)
        try:
            charge.add(n, what)
            yield
        finally:
            charge.release()

    @asynccontextmanager
    async def receive_slot(self, wait_s: float) -> AsyncIterator[None]:
        """One of the `receive_slots` for a message whose size is unknown until it has arrived;
        waits its turn (first come, first served) up to `wait_s`, else 503."""
        await self._acquire_slot(wait_s)
        try:
            yield
        finally:
            self._release_slot()

    async def _acquire_slot(self, wait_s: float) -> None:
        if self.receiving < self.receive_slots and not self._slot_waiters:
            self.receiving += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        try:
            await asyncio.wait((waiter,), timeout=max(wait_s, 0.0))
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release_slot()  # handed over just as the caller went away: pass it on
            waiter.cancel()
            raise
        if not waiter.done():
            waiter.cancel()  # _release_slot skips it
            self.rejected_total += 1
            raise Unavailable(
                f"server busy: {self.receiving} messages of unknown size are being received at once, the most "
                f"max_inflight_body_bytes {self.max_inflight_bytes} allows at max_body_bytes {self.max_body_bytes} "
                "each, and none finished in time; retry later"
            )

    def _release_slot(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to the next caller in line
                return
        self.receiving -= 1


class Charge:
    """The bytes one body holds against its BodyBudget."""

    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.bytes = 0
        self.large = False

    def add(self, n: int, what: str) -> None:
        b = self.budget
        if b.held + n > b.max_inflight_bytes:
            b.rejected_total += 1
            raise Unavailable(
                f"server busy: request bodies in progress hold {b.held} bytes and {what} would exceed "
                f"max_inflight_body_bytes {b.max_inflight_bytes}; retry later"
            )
        b.held += n
        self.bytes += n
        if not self.large and self.bytes >= TRIM_AFTER_BYTES:
            self.large = True
            b.large_in_progress += 1

    def release(self) -> None:
        b = self.budget
        b.held -= self.bytes
        self.bytes = 0
        if self.large:
            self.large = False
            b.large_in_progress -= 1
            if b.large_in_progress == 0 and b.trim is not None:
                # The last large body is gone: hand its freed pages back, on a thread (it walks the
                # heap) and on the next loop turn, once an error leaving the handler has let go of
                # the frames that still reference the decoded tensors.
                loop = asyncio.get_running_loop()
                loop.call_soon(loop.run_in_executor, None, b.trim, 0)
