"""What the two region registries share (regions.py: system shared memory; cuda_regions.py:
CUDA): regions by name under one lock, the limits on their count and bytes, one namespace with
the other kind (as in Triton, a request names a region without saying which kind), unregister
(one, or all; an unknown name is a no-op, as in Triton), status, and the reference count by which
a region unregistered while requests use it is closed when the last one lets go.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ..errors import InvalidInput, Overloaded

MAX_KEY_LENGTH = 255  # NAME_MAX


@dataclass(frozen=True)
class RegionLimits:
    max_regions: int = 32
    max_bytes: int = 1 << 30  # the byte_size of every region registered, together
    allowed_uids: frozenset[int] = frozenset()  # besides the daemon's own user


class Held(Protocol):
    """A registered region as the registry keeps it."""

    name: str
    byte_size: int
    users: int  # requests holding it now
    registered: bool

    @property
    def unused(self) -> bool: ...  # unregistered, and nothing holds it any more

    def status(self) -> dict[str, object]: ...


R = TypeVar("R", bound=Held)


class NamedRegions(ABC, Generic[R]):
    """Regions of one kind by name; subclasses register them and say how one is closed."""

    kind = "shared memory"  # how messages name this registry's regions
    holding = "map"  # what registering does to them, in the limit's message

    def __init__(self, limits: RegionLimits | None = None, other_names: Callable[[str], bool] = lambda name: False):
        self.limits = limits or RegionLimits()
        self.other_names = other_names  # is a name taken by the other kind's registry (link_namespaces)
        self._regions: dict[str, R] = {}
        self._lock = threading.Lock()

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._regions

    def _check_room(self, name: str, byte_size: int) -> None:
        """InvalidInput for a name taken, Overloaded beyond the limits; the lock held."""
        if name in self._regions or self.other_names(name):
            raise InvalidInput(f"shared memory region {name!r} is already registered; unregister it first")
        if len(self._regions) >= self.limits.max_regions:
            raise Overloaded(f"{len(self._regions)} {self.kind} regions are registered, the most "
                             "[server] shm_max_regions allows; unregister one first")
        held = sum(r.byte_size for r in self._regions.values())
        if held + byte_size > self.limits.max_bytes:
            raise Overloaded(f"registering {byte_size} bytes would {self.holding} {held + byte_size} bytes of "
                             f"{self.kind}, more than [server] shm_max_bytes ({self.limits.max_bytes})")

    def _add(self, region: R) -> None:
        """Keep a region opened outside the lock, checking the room again (another registration may
        have come in meanwhile); closed again when there is none."""
        try:
            with self._lock:
                self._check_room(region.name, region.byte_size)
                self._regions[region.name] = region
        except (InvalidInput, Overloaded):
            self._close(region)  # the lock let go first: closing may call CUDA
            raise

    def unregister(self, name: str | None = None) -> None:
        """Unregister one region (name; unknown is a no-op, as in Triton) or every one (None)."""
        with self._lock:
            names = list(self._regions) if name is None else [name] if name in self._regions else []
            gone = [self._regions.pop(n) for n in names]
            for region in gone:
                region.registered = False
            closing = [r for r in gone if r.unused]
        for region in closing:
            self._close(region)

    def status(self, name: str | None = None) -> list[dict[str, object]]:
        with self._lock:
            if name is None:
                return [r.status() for _, r in sorted(self._regions.items())]
            region = self._regions.get(name)
        if region is None:
            raise InvalidInput(f"no {self.kind} region {name!r} is registered")
        return [region.status()]

    def acquire(self, name: str, where: str) -> R | None:
        """The region `name`, held by the caller until release(); None when none of this kind has that name."""
        with self._lock:
            region = self._regions.get(name)
            if region is not None:
                region.users += 1
            return region

    def release(self, region: R) -> None:
        with self._lock:
            region.users -= 1
            close = region.unused
        if close:
            self._close_unused(region)

    @abstractmethod
    def _close(self, region: R) -> None:
        """Unmap or close one region no request holds any more."""

    def _close_unused(self, region: R) -> None:
        """The last holder let go of an unregistered region (perhaps on the event loop)."""
        self._close(region)


def check_name(name: object) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_KEY_LENGTH or "/" in name:
        raise InvalidInput(f"shared memory region name must be a non-empty string without '/', got {name!r}")
