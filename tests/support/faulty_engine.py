"""A test-only backend: the real ONNX Runtime engine plus faults injected on purpose.

Clearly a test double, used as `backend = "tests.support.faulty_engine:FaultyOnnxEngine"` in
a test model.toml. It runs the real model; only batches carrying a sentinel value misbehave:
  -999 anywhere in the batch: infer() raises (an engine failure);
  -500 anywhere in the batch: infer() sleeps 0.5 s first (a slow batch, to build a queue);
  -2000: it sleeps 2 s (a queue built by slow clients, e.g. a thread and a connection each);
  -3000: it waits until the file named by the environment variable FAULTY_ENGINE_RELEASE
         exists (at most 60 s): a queue that the test builds at its own pace, then releases.

LeakyEngine (another test double) instead keeps LEAK_BYTES of memory, touched, for every batch
carrying -777: memory that serving takes and no measurement at load saw; -776 takes the same
until the file named by FAULTY_ENGINE_RELEASE exists (at most 60 s), then gives it back to the
system: a transient peak.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np

from edge_batcher.engines.onnxruntime import OnnxRuntimeEngine

FAIL = -999.0
SLOW = -500.0
VERY_SLOW = -2000.0
HELD = -3000.0
RELEASE_ENV = "FAULTY_ENGINE_RELEASE"
LEAK = -777.0
LEAK_BYTES = 48 << 20
TRANSIENT_LEAK = -776.0


class FaultyOnnxEngine(OnnxRuntimeEngine):
    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in inputs.values()])
        if np.any(values == FAIL):
            raise RuntimeError("injected fault: sentinel -999 in the batch")
        if np.any(values == SLOW):
            time.sleep(0.5)
        elif np.any(values == VERY_SLOW):
            time.sleep(2.0)
        elif np.any(values == HELD):
            release = Path(os.environ.get(RELEASE_ENV, "/nonexistent"))
            deadline = time.monotonic() + 60
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().infer(inputs)


class OomAboveFourEngine(OnnxRuntimeEngine):
    """Runs the real model but reports out-of-memory for batches larger than 4 rows of real
    data, like a device whose memory filled up after start-up (warm-up's all-zero batches
    still pass, so every size is warmed)."""

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from edge_batcher.errors import OutOfMemory

        first = next(iter(inputs.values()))
        if first.shape[0] > 4 and np.any(first):
            raise OutOfMemory(f"injected out-of-memory: batch of {first.shape[0]} rows (this test engine allows 4)")
        return super().infer(inputs)


class LeakyEngine(OnnxRuntimeEngine):
    kept: list[np.ndarray] = []

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if any(np.any(np.asarray(v) == LEAK) for v in inputs.values()):
            self.kept.append(np.ones(LEAK_BYTES, np.uint8))  # ones: every page touched, resident
        if any(np.any(np.asarray(v) == TRANSIENT_LEAK) for v in inputs.values()):
            pages = mmap.mmap(-1, LEAK_BYTES)  # a mapping of its own: closing it unmaps the pages
            pages.write(b"\1" * LEAK_BYTES)
            threading.Thread(target=_close_when_released, args=(pages,), daemon=True).start()
        return super().infer(inputs)


def _close_when_released(pages: mmap.mmap) -> None:
    release = Path(os.environ.get(RELEASE_ENV, "/nonexistent"))
    deadline = time.monotonic() + 60
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    pages.close()
