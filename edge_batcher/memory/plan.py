"""The daemon's memory plan, per meter, and the watch that holds the memory in use to it.

Every meter that measures models (memory/device.py: the GPU's probe, or "process" for the
daemon's resident memory) has a plan: what it read when the daemon started, plus the resident
memory of every model measured with it, plus what else the daemon holds at ready (services,
transports, Python: counted once, then part of the plan), plus batches in flight. The daemon
publishes it (`edge_batcher_memory_planned_bytes`), and `check` compares it with the meters now
and then while serving: growth beyond it is what no measurement at load saw. It is logged at
WARNING with the models that ran since the last look and counted into the plan, so the budget
and the figures stay true; growth of the daemon's own memory that later goes (the process's
resident size falls back) is taken out of the plan again (docs/memory.md, "The plan under
traffic").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .device import memory_in_use
from .snapshot import MemoryProbe

log = logging.getLogger(__name__)

MiB = 1 << 20
# Growth beyond the plan below this is noise (the driver's 2 MiB steps, RSS counters batched per CPU).
NOISE_BYTES = 4 * MiB


@dataclass(frozen=True)
class Overrun:
    meter: str
    used: int
    planned: int

    @property
    def excess(self) -> int:
        return self.used - self.planned


@dataclass(frozen=True)
class GivenBack:
    meter: str
    used: int
    planned: int
    amount: int  # of the growth counted earlier, what the meter no longer shows


class MemoryPlan:
    def __init__(self, probe: MemoryProbe):
        self.probe = probe
        self.at_start: dict[str, int] = {}
        self.other: dict[str, int] = {}  # held beyond the models: counted at ready, and growth seen since
        self.grown: dict[str, int] = {}  # of `other`, the growth seen since ready

    def start(self) -> None:
        """Read every meter before any model loads."""
        self.at_start = memory_in_use(self.probe)
        self.other = {meter: 0 for meter in self.at_start}
        self.grown = {meter: 0 for meter in self.at_start}

    def settle(self, residents: dict[str, int]) -> None:
        """At ready: what the meters read beyond the start and the models is counted as the
        daemon's own (services' state, transports, Python objects); logged once."""
        now = memory_in_use(self.probe)
        for meter, used in now.items():
            self.other[meter] = used - self.at_start.get(meter, used) - residents.get(meter, 0)
        log.info("memory plan at ready: %s", "; ".join(
            f"{meter} {now[meter] / MiB:.0f} MiB = {self.at_start[meter] / MiB:.0f} at start + "
            f"{residents.get(meter, 0) / MiB:.0f} models + {self.other[meter] / MiB:.0f} other"
            for meter in now))

    def planned(self, residents: dict[str, int], reserved: int = 0) -> dict[str, int]:
        """What each meter should read now by the plan."""
        return {meter: start + self.other.get(meter, 0) + residents.get(meter, 0) + reserved
                for meter, start in self.at_start.items()}

    def check(self, residents: dict[str, int], reserved: int, tolerance: dict[str, int]) -> list[Overrun]:
        """The meters named in `tolerance` that read more than the plan by more than their
        tolerance (at least NOISE_BYTES): each is counted into the plan (the next check compares
        with it) and returned for the caller to log with what ran."""
        now = memory_in_use(self.probe)
        overruns = []
        for meter, planned in self.planned(residents, reserved).items():
            used = now.get(meter)
            if used is not None and meter in tolerance and used - planned > max(NOISE_BYTES, tolerance[meter]):
                overruns.append(Overrun(meter, used, planned))
                self.other[meter] += used - planned
                self.grown[meter] = self.grown.get(meter, 0) + used - planned
        return overruns

    def given_back(self, residents: dict[str, int], reserved: int, meters: set[str]) -> list[GivenBack]:
        """The meters in `meters` that read less than the plan by more than NOISE_BYTES while it
        counts growth seen since ready: as much of that growth as the meter no longer shows
        leaves the plan (never what was counted at ready), and is returned for the caller to
        give back to the budget. Only for meters that read this process alone: on a device's
        meter, memory another process frees would look like ours going."""
        now = memory_in_use(self.probe)
        returned = []
        for meter, planned in self.planned(residents, reserved).items():
            used = now.get(meter)
            grown = self.grown.get(meter, 0)
            if used is None or meter not in meters or not grown or planned - used <= NOISE_BYTES:
                continue
            amount = min(grown, planned - used)
            returned.append(GivenBack(meter, used, planned, amount))
            self.other[meter] -= amount
            self.grown[meter] = grown - amount
        return returned
