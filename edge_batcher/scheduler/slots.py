"""Which engine instance takes a model's next local batch, and how long until one is free.

Each instance has BATCHES_IN_FLIGHT_PER_INSTANCE slots: the next batch waits in the worker's
queue while the current one runs, so the engine thread never idles through a round trip to
the event loop. A batch goes to the free instance expected to finish its work first (from
the learned execution times); the wait estimate feeds the policy's offload decision. Runs on
the event loop only; no locks.
"""

from __future__ import annotations

from collections import deque

BATCHES_IN_FLIGHT_PER_INSTANCE = 2


class InstanceSlots:
    def __init__(self, instances: int):
        self.instances = instances
        self.free: list[int] = []  # an instance once per free slot; none until open()
        self._busy_until = [0.0] * instances  # when each instance's dispatched work should end
        self._dispatched: list[deque[float]] = [deque() for _ in range(instances)]  # dispatch times in flight

    def open(self) -> None:
        """Every slot free: the model starts serving."""
        self.free = [i for _ in range(BATCHES_IN_FLIGHT_PER_INSTANCE) for i in range(self.instances)]

    def take(self, now: float, seconds: float) -> int:
        """A free slot for a batch dispatched now and expected to run `seconds`: its instance."""
        instance = min(self.free, key=lambda i: self._busy_until[i])
        self.free.remove(instance)
        self._busy_until[instance] = max(now, self._busy_until[instance]) + seconds
        self._dispatched[instance].append(now)
        return instance

    def give_back(self, instance: int) -> None:
        """A batch that held a slot of `instance` finished."""
        self.free.append(instance)
        self._dispatched[instance].popleft()
        if self.free.count(instance) == BATCHES_IN_FLIGHT_PER_INSTANCE:
            self._busy_until[instance] = 0.0  # idle: nothing of its estimate is left

    def wait_s(self, now: float) -> float:
        """Estimated wait before a batch dispatched now would start on an instance.

        From the learned execution times; but when an instance's work has overrun its
        estimate (a stuck or suddenly slow engine), assume it needs as long again as it has
        already run, rather than trusting an estimate that has proven wrong."""
        def wait(i: int) -> float:
            expected = self._busy_until[i] - now
            if expected <= 0 and self._dispatched[i]:
                return now - self._dispatched[i][0]
            return max(0.0, expected)

        return min(wait(i) for i in (self.free or range(self.instances)))
