"""What tools/build_frames_model.py's `frames` model answers, computed in numpy, for the shared
memory tests over HTTP and gRPC."""

from __future__ import annotations

import numpy as np

from tests.support.models import _tool

STRIDE = _tool("build_frames_model").STRIDE


def _grid(x: np.ndarray) -> np.ndarray:
    """The pixels the frames model reads (every STRIDE-th)."""
    return x[:, ::STRIDE, ::STRIDE, :].astype(np.float64)


def expected_brightness(x: np.ndarray) -> np.ndarray:
    return _grid(x).mean(axis=(1, 2, 3))


def expected_channel_mean(x: np.ndarray) -> np.ndarray:
    return _grid(x).mean(axis=(1, 2))
