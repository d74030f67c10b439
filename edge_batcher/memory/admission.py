"""Admission: the scheduler's `fits(size, seq_len)` hook for one model, backed by the budget.

A batch's own cost is its activations (peak, calibrated) plus its KV cache; the model's
weights are resident already (loaded once, see budget.resident). On a device measured at load
(device.py) a measured size costs only its transient bytes: the arena already holds the rest,
counted once as resident. A batch fits when its cost is within what the budget has available
now; batches dispatched reserve their cost until they finish, so concurrent batches are never
admitted against the same free memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .budget import MemoryBudget
from .device import DeviceProfile
from .estimator import Footprint, OnnxFootprintEstimator

log = logging.getLogger(__name__)

MiB = 1 << 20
# After an out-of-memory error the activation estimate was too low: raise it by this factor.
OOM_CALIBRATION_STEP = 1.25


class Admission:
    def __init__(self, model: str, budget: MemoryBudget, footprint: Callable[[int, int | None], Footprint],
                 estimator: OnnxFootprintEstimator | None = None, device: DeviceProfile | None = None):
        self.model = model
        self.budget = budget
        self.line_key = budget.consumer(model)  # this model's runner's place in the budget's line
        self._footprint = footprint
        self.estimator = estimator  # has a settable .calibration when the estimate is an ONNX one
        self.device = device  # measured at load on a device; None: the estimate is the cost

    def footprint(self, size: int, seq_len: int) -> Footprint:
        return self._footprint(size, seq_len or None)

    def batch_bytes(self, size: int, seq_len: int) -> int:
        if self.device is not None:
            transient = self.device.transient(size, seq_len)
            if transient is not None:
                return transient
        f = self.footprint(size, seq_len)
        return f.activations + f.kv_cache

    def fits(self, size: int, seq_len: int) -> bool:
        if self.device is not None and self.device.refuses(size, seq_len):
            return False  # measured at load: it ran out of memory, or the budget could not hold it
        nbytes = self.batch_bytes(size, seq_len)
        # a generator that has waited long enough in the budget's line goes first (budget.py)
        return nbytes <= self.budget.available() and (nbytes == 0 or self.budget.may_take(self.line_key))

    def fits_later(self, size: int, seq_len: int) -> bool:
        """Whether it would fit once every reservation now held (batches in flight, generators'
        KV caches) has come back: a batch that does not fit now waits for them instead of being
        refused."""
        if self.device is not None and self.device.refuses(size, seq_len):
            return False
        return self.batch_bytes(size, seq_len) <= self.budget.capacity()

    def reserve(self, size: int, seq_len: int) -> int:
        nbytes = self.batch_bytes(size, seq_len)
        self.budget.reserve(nbytes)
        return nbytes

    def release(self, nbytes: int) -> None:
        self.budget.release(nbytes)

    def explain(self, size: int, seq_len: int) -> str:
        if self.device is not None and self.device.transient(size, seq_len) is not None:
            return (
                f"a batch of {size}{f' at length {seq_len}' if seq_len else ''} needs "
                f"{self.batch_bytes(size, seq_len) / MiB:.1f} MiB beyond the model's measured device memory "
                f"({self.device.resident / MiB:.1f} MiB resident); the memory budget has "
                f"{self.budget.available() / MiB:.1f} MiB available ({self.budget.reserved / MiB:.1f} MiB "
                "reserved by batches in flight)"
            )
        f = self.footprint(size, seq_len)
        return (
            f"a batch of {size}{f' at length {seq_len}' if seq_len else ''} needs "
            f"{(f.activations + f.kv_cache) / MiB:.1f} MiB (activations {f.activations / MiB:.1f} MiB, "
            f"KV {f.kv_cache / MiB:.1f} MiB); the memory budget has {self.budget.available() / MiB:.1f} MiB "
            f"available ({self.budget.reserved / MiB:.1f} MiB reserved by batches in flight)"
        )

    def raise_calibration(self) -> float | None:
        """The engine ran out of memory: estimates were low. Raises every factor (each length
        bucket's too); returns the new default factor."""
        if self.estimator is None:
            return None
        self.estimator.scale_calibration(OOM_CALIBRATION_STEP)
        return self.estimator.calibration
