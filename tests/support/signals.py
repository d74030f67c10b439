"""Vibration-like windows for requests to the demo model (shaft tone + noise)."""

from __future__ import annotations

import numpy as np

SIGNAL_LEN = 256


def windows(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(SIGNAL_LEN) / 2560.0
    freq = rng.uniform(20, 40, size=(n, 1))
    amp = rng.uniform(0.2, 2.0, size=(n, 1))
    x = amp * np.sin(2 * np.pi * freq * t) + 0.05 * rng.standard_normal((n, SIGNAL_LEN))
    return x.astype(np.float32)
