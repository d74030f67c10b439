"""What a memory probe reports (MemorySnapshot) and the interface every probe implements.

The probes themselves live in memory/probe.py (CPU/cgroup, fixed, and the choice of one),
memory/jetson.py and memory/gpu_probes.py; memory/budget.py reads whichever was chosen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of a probe.

    free_bytes is what the daemon may still allocate (the probe decides what that means for
    its device, see each probe's docstring); total_bytes is the size of the pool it comes from.
    details holds the raw figures the decision was made from, so operators (and the /metrics
    endpoint) can see *why* free_bytes is what it is. It is read-only and not compared.
    """

    total_bytes: int
    free_bytes: int
    source: str
    details: Mapping[str, int] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "details", MappingProxyType(dict(self.details)))


@runtime_checkable
class MemoryProbe(Protocol):
    """Anything that can report free device memory. read() must be cheap enough to call
    about once a second and after each model load/unload."""

    name: str

    def read(self) -> MemorySnapshot: ...
