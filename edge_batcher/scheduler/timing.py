"""Execution time per batch size, learned from measured batches.

The policy asks "how long will a batch of size s take?" to decide how long it may still
wait before a deadline and which padding is cheapest. Sizes never measured are interpolated
linearly between measured neighbours (or extrapolated from the nearest), and before any
measurement a prior of `prior_fixed_s + prior_per_row_s * s` is used.
"""

from __future__ import annotations


class ExecTimeModel:
    def __init__(self, *, alpha: float = 0.2, prior_fixed_s: float = 1e-3, prior_per_row_s: float = 1e-4):
        self.alpha = alpha  # EWMA weight of the newest measurement
        self.prior_fixed_s = prior_fixed_s
        self.prior_per_row_s = prior_per_row_s
        self._seconds: dict[int, float] = {}

    def observe(self, size: int, seconds: float) -> None:
        old = self._seconds.get(size)
        self._seconds[size] = seconds if old is None else old + self.alpha * (seconds - old)

    def measured(self) -> dict[int, float]:
        return dict(self._seconds)

    def estimate(self, size: int) -> float:
        known = self._seconds
        if size in known:
            return known[size]
        if not known:
            return self._prior(size)
        below = [s for s in known if s < size]
        above = [s for s in known if s > size]
        if below and above:
            lo, hi = max(below), min(above)
            frac = (size - lo) / (hi - lo)
            return known[lo] + frac * (known[hi] - known[lo])
        nearest = max(below) if below else min(above)
        # Outside the measured range: scale the nearest measurement by the prior's shape, so a
        # smaller size is never estimated cheaper than zero or a larger one cheaper than it.
        return known[nearest] * self._prior(size) / self._prior(nearest)

    def _prior(self, size: int) -> float:
        return self.prior_fixed_s + self.prior_per_row_s * size
