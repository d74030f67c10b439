"""The memory budget the scheduler plans batches against.

A probe says what the device has free; the budget turns that into what the scheduler may
*plan* with:

    available = min(fixed_bytes - resident - reserved,
                    free - reserve_fraction * total - headroom_bytes - (reserved - visible))

* reserve_fraction and headroom_bytes keep a margin for what no estimate sees (allocator
  rounding and fragmentation, CUDA/cuDNN workspaces, other processes growing, the kernel).
* fixed_bytes caps what the daemon itself uses, model weights included, for operators sharing
  the device with other services. resident is the weights of the loaded models: they count
  against fixed_bytes only, because the probe's free memory already reflects them.
* reserved is the memory promised to batches in flight: a batch that has been admitted but
  whose allocations the probe does not show yet must not be admitted twice against the same
  free memory. While a running batch's memory *is* visible to the probe it is counted twice
  (in free and in reserved) until release(); that errs on the safe side and lasts one batch.
* visible is the part of the reservations that is allocated and that the probe's free figure
  already shows: a generator's KV cache in host memory, reserved for as long as its sequences
  run (seconds to minutes, not one batch), where counting it twice left nothing for the other
  models while the memory was there (docs/memory.md). Only a probe that reads host memory
  (`sees_host_memory`: cpu, jetson) shows it; the fixed cap counts every reservation whole.

Consumers that wait for memory others hold (an engine model whose smallest batch does not fit
now, a generator whose next sequence does not) stand in a line. A generator takes memory only
when nobody has waited longer (`try_reserve(waiter=)`), so admitting a sequence whenever one
leaves cannot keep an engine model waiting until its requests expire; an engine model's batch
gives way only to someone who has waited PRIORITY_AFTER_S (`may_take`), so engine batches back
to back cannot starve a generator either, and an ordinary wait stalls nobody. A release wakes
those in the line (`on_memory_back`), and the waits are counted for the metrics (`line_report`)
(docs/memory.md, "The line").

Reading the probe costs a file read or a driver call, so available() caches the snapshot and
re-reads at most every refresh_interval_s; refresh() forces a read after known load changes.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..errors import ConfigError
from .probe import MemoryProbe, MemorySnapshot

MiB = 1 << 20
# A place in the line not renewed for this long is gone: a model unloaded (or a loop stalled)
# while it waited must not hold everyone else back. Waiters renew every ~20 ms.
WAIT_LEASE_S = 2.0
# A consumer that has waited this long goes before engine batches too (they hold memory for one
# batch; a generator's wait for what they keep taking back to back would never end).
PRIORITY_AFTER_S = 1.0
_KEY_SEPARATOR = "\x00"  # in consumer(): never in a model's name (a directory's)


class MemoryBudget:
    """Bytes the scheduler may plan with; thread-safe (the runner releases from its threads)."""

    def __init__(
        self,
        probe: MemoryProbe,
        *,
        reserve_fraction: float = 0.1,
        headroom_bytes: int = 256 * MiB,
        fixed_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        refresh_interval_s: float = 1.0,
    ):
        if not callable(getattr(probe, "read", None)):
            raise ConfigError(f"probe must have a read() method, got {probe!r}")
        if (
            isinstance(reserve_fraction, bool)
            or not isinstance(reserve_fraction, (int, float))
            or not 0.0 <= reserve_fraction < 1.0
        ):
            raise ConfigError(f"reserve_fraction must be in [0, 1), got {reserve_fraction!r}")
        if (
            isinstance(headroom_bytes, bool)
            or not isinstance(headroom_bytes, int)
            or headroom_bytes < 0
        ):
            raise ConfigError(f"headroom_bytes must be an integer >= 0, got {headroom_bytes!r}")
        if fixed_bytes is not None and (
            isinstance(fixed_bytes, bool) or not isinstance(fixed_bytes, int) or fixed_bytes <= 0
        ):
            raise ConfigError(f"fixed_bytes must be an integer > 0 or None, got {fixed_bytes!r}")
        if not callable(clock):
            raise ConfigError(f"clock must be callable, got {clock!r}")
        if (
            isinstance(refresh_interval_s, bool)
            or not isinstance(refresh_interval_s, (int, float))
            or not math.isfinite(refresh_interval_s)
            or refresh_interval_s < 0
        ):
            raise ConfigError(
                f"refresh_interval_s must be a finite number >= 0, got {refresh_interval_s!r}"
            )
        self.probe = probe
        self.reserve_fraction = float(reserve_fraction)
        self.headroom_bytes = headroom_bytes
        self.fixed_bytes = fixed_bytes
        self.refresh_interval_s = float(refresh_interval_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._reserved = 0
        self._visible = 0  # of _reserved: allocated, and shown by the probe's free figure
        self.resident = 0  # weights of loaded models (see the module docstring)
        self._consumers = 0  # line keys handed out (consumer())
        self._line: dict[str, tuple[float, float]] = {}  # consumer -> (waiting since, renewed at)
        self._wakers: dict[str, Callable[[], None]] = {}  # consumer -> called when memory comes back
        self._waits: dict[str, int] = {}  # consumer -> places it took in the line, ever
        self._waited_s: dict[str, float] = {}  # consumer -> seconds in the line, places ended
        self.snapshot: MemorySnapshot | None = None

    # -- reading ------------------------------------------------------------------------------

    def refresh(self) -> MemorySnapshot:
        """Read the probe now. Call after each load change (model load/unload, batch start/end)
        so the next decision does not use a figure from before the change."""
        with self._lock:
            return self._read()

    def _read(self) -> MemorySnapshot:
        snapshot = self.probe.read()
        self.snapshot = snapshot
        self._read_at = self._clock()
        return snapshot

    def _current(self) -> MemorySnapshot:
        if (
            self.snapshot is None
            or self._read_at is None
            or self._clock() - self._read_at >= self.refresh_interval_s
        ):
            return self._read()
        return self.snapshot

    def overdrawn(self) -> bool:
        """True when what is free (or the fixed cap, less what is resident) is below the margins:
        memory is held beyond what the budget allows, by growth no measurement saw."""
        with self._lock:
            return self._unreserved(self._current(), 0, 0) < 0

    def _unreserved(self, snapshot: MemorySnapshot, reserved: int, visible: int) -> int:
        """What is left after the margins and `reserved`, of which the probe's free figure shows
        `visible` already (with both 0: what the budget has at all)."""
        live = (snapshot.free_bytes - int(self.reserve_fraction * snapshot.total_bytes) - self.headroom_bytes
                - (reserved - visible))
        if self.fixed_bytes is not None:
            return min(live, self.fixed_bytes - self.resident - reserved)
        return live

    def capacity(self) -> int:
        """Bytes a batch could have once every reservation has come back, their memory freed:
        the most it could ever be given while the rest of the device stays as it is (whether a
        reservation's memory is allocated yet is not known, so it counts as freed: a batch or a
        sequence is refused as never fitting only when even that could not hold it). Never
        negative."""
        with self._lock:
            return max(0, self._capacity())

    def _capacity(self) -> int:  # under self._lock
        return self._unreserved(self._current(), 0, self._reserved)

    def available(self) -> int:
        """Bytes a new batch may use now: never negative. Re-reads the probe only when the
        cached snapshot is refresh_interval_s old, so it is cheap on the hot path."""
        with self._lock:
            return self._available()

    def _available(self) -> int:  # under self._lock
        return max(0, self._unreserved(self._current(), self._reserved, self._visible))

    @property
    def sees_host_memory(self) -> bool:
        """Whether the probe's free figure falls when this process allocates host memory."""
        return getattr(self.probe, "name", "") in ("cpu", "jetson")

    @property
    def visible(self) -> int:
        return self._visible

    def set_visible(self, delta: int) -> None:
        """Of the reservations, `delta` more (or, negative, fewer) bytes are allocated where the
        probe sees them. Call after refresh() when they grow (the probe must show them first) and
        before it when they shrink: in between they are counted twice, which errs on the safe
        side."""
        with self._lock:
            if not 0 <= self._visible + delta <= self._reserved:
                raise ValueError(f"visible bytes would be {self._visible + delta}, outside 0 .. the "
                                 f"{self._reserved} bytes reserved")
            self._visible += delta

    # -- in-flight reservations ---------------------------------------------------------------

    @property
    def reserved(self) -> int:
        """Bytes currently promised to batches in flight."""
        return self._reserved

    def reserve(self, nbytes: int) -> None:
        """Promise nbytes to a batch being admitted; subtracted from available() until released."""
        _check_nbytes(nbytes)
        with self._lock:
            self._reserved += nbytes

    def try_reserve(self, nbytes: int, waiter: str | None = None, keeps: int = 0) -> bool:
        """Check-and-reserve in one step: reserve nbytes only if they fit available().

        Two threads that each call available() and then reserve() could both admit against
        the same free memory; this does both under one lock. With `waiter`, also only when no
        other consumer has waited for memory longer; refused, the waiter keeps (or takes) its
        place in the line if nbytes would fit once the others' reservations came back (it holds
        `keeps` of them itself: waiting for its own, it stands in nobody's way); granted, it
        leaves the line.
        """
        _check_nbytes(nbytes)
        wakers: list[Callable[[], None]] = []
        with self._lock:
            granted = nbytes <= self._available() and (waiter is None or self._first(waiter))
            if granted:
                self._reserved += nbytes
            if waiter is not None:
                if not granted and nbytes <= self._capacity() - keeps:
                    self._wait(waiter)
                else:
                    wakers = self._leave(waiter)
        for wake in wakers:
            wake()
        return granted

    # -- the line of consumers waiting for memory ---------------------------------------------

    def consumer(self, model: str) -> str:
        """A key of its own in the line for one consumer of `model`'s (a runner, a decode loop):
        while a model is reloaded its old and new versions both consume, and one leaving the
        line must not take the other's place. line_report() counts by model."""
        with self._lock:
            self._consumers += 1
            return f"{model}{_KEY_SEPARATOR}{self._consumers}"

    def wait_in_line(self, name: str) -> None:
        """`name` waits for memory others hold: take a place in the line, or renew it."""
        with self._lock:
            self._wait(name)

    def leave_line(self, name: str) -> None:
        """`name` no longer waits (it got its memory, or has nothing left to run)."""
        if name in self._line:
            with self._lock:
                wakers = self._leave(name)
            for wake in wakers:
                wake()

    def first_in_line(self, name: str) -> bool:
        """Whether `name` may take memory now: no other consumer has waited longer (one not
        waiting at all comes after everyone who is)."""
        if not self._line:
            return True  # the usual case, without the lock
        with self._lock:
            return self._first(name)

    def may_take(self, name: str) -> bool:
        """Whether an engine model's batch may take memory now: nobody who has waited longer than
        it has waited PRIORITY_AFTER_S (a shorter wait does not hold engine batches back)."""
        if not self._line:
            return True
        with self._lock:
            return self._first(name, PRIORITY_AFTER_S)

    def on_memory_back(self, name: str, wake: Callable[[], None]) -> None:
        """Have `wake` called (on the calling thread, outside the lock: it must only hand off)
        whenever, while `name` stands in the line, a reservation comes back or someone ahead of
        it leaves the line. Waiters also look again on their own: memory freed outside the
        budget is announced by nobody."""
        with self._lock:
            self._wakers[name] = wake

    def forget_waker(self, name: str, wake: Callable[[], None]) -> None:
        """Undo on_memory_back(name, wake), unless another waker was registered for `name` since
        (a consumer keyed by a plain name, not by consumer())."""
        with self._lock:
            if self._wakers.get(name) == wake:
                del self._wakers[name]

    def line_report(self) -> dict[str, tuple[bool, int, float]]:
        """Per model whose consumers ever waited: (one in the line now, waits begun, seconds
        waited), summed over its consumers. A wait counts until its last renewal while it lasts,
        until it ended once it has (monotonic: these feed Prometheus counters)."""
        with self._lock:
            now = self._clock()
            report: dict[str, tuple[bool, int, float]] = {}
            for key, count in self._waits.items():
                place = self._line.get(key)
                live = place is not None and now - place[1] <= WAIT_LEASE_S
                current = place[1] - place[0] if place is not None else 0.0
                model = key.partition(_KEY_SEPARATOR)[0]
                was = report.get(model, (False, 0, 0.0))
                report[model] = (was[0] or live, was[1] + count, was[2] + self._waited_s.get(key, 0.0) + current)
            return report

    def _wait(self, name: str) -> None:  # under self._lock
        now = self._clock()
        place = self._line.get(name)
        if place is not None and now - place[1] <= WAIT_LEASE_S:
            self._line[name] = (place[0], now)
            return
        if place is not None:  # lapsed: it waited until its last renewal
            self._waited_s[name] = self._waited_s.get(name, 0.0) + place[1] - place[0]
        self._waits[name] = self._waits.get(name, 0) + 1
        self._line[name] = (now, now)

    def _leave(self, name: str) -> list[Callable[[], None]]:  # under self._lock
        """Take `name`'s place out of the line; the wakers of those still in it, to be called
        once the lock is released (whoever was behind it may be first now)."""
        place = self._line.pop(name, None)
        if place is None:
            return []
        now = self._clock()
        end = now if now - place[1] <= WAIT_LEASE_S else place[1]
        self._waited_s[name] = self._waited_s.get(name, 0.0) + end - place[0]
        return self._wakers_in_line()

    def _wakers_in_line(self) -> list[Callable[[], None]]:  # under self._lock
        return [self._wakers[n] for n in self._line if n in self._wakers]

    def _first(self, name: str, waited_at_least: float = 0.0) -> bool:  # under self._lock
        """No other live place is older than `name`'s and at least `waited_at_least` old."""
        now = self._clock()
        waiting = {n: since for n, (since, renewed) in self._line.items() if now - renewed <= WAIT_LEASE_S}
        mine = waiting.get(name, math.inf)
        return not any(since < mine and now - since >= waited_at_least for n, since in waiting.items() if n != name)

    def release(self, nbytes: int) -> None:
        """Give back bytes reserved for a batch that finished (or failed)."""
        _check_nbytes(nbytes)
        with self._lock:
            if nbytes > self._reserved - self._visible:
                raise ValueError(
                    f"release({nbytes}) exceeds the {self._reserved - self._visible} bytes reserved and not "
                    "visible: a batch was released twice or never reserved, or its visible part is still marked"
                )
            self._reserved -= nbytes
            wakers = self._wakers_in_line() if self._line else []
        for wake in wakers:
            wake()

    @contextmanager
    def reservation(self, nbytes: int) -> Iterator[None]:
        """``with budget.reservation(n): run_batch()`` reserves n and always releases it."""
        self.reserve(nbytes)
        try:
            yield
        finally:
            self.release(nbytes)


def _check_nbytes(nbytes: object) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an integer >= 0, got {nbytes!r}")
