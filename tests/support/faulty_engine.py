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

HeavyLoadEngine (a third) takes LOAD_BYTES of memory, touched, as its load's own and holds it,
the load taking LOAD_SECONDS: a model whose load takes long enough for the memory watch to look
meanwhile. Its subclass LeavesMemoryEngine keeps those pages when closed, as an allocator keeps
much of what an unloaded model freed. HeapLoadEngine (a fourth) holds as much in the C heap,
in blocks of 64 KiB (below glibc's mmap threshold), and frees it when closed: glibc keeps those
pages in the process until malloc_trim.
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


LOAD_BYTES = 48 << 20
LOAD_SECONDS = 1.0


class HeavyLoadEngine(OnnxRuntimeEngine):
    def load(self) -> None:
        super().load()
        self._pages = mmap.mmap(-1, LOAD_BYTES)  # a mapping of its own: closing it unmaps the pages
        self._pages.write(b"\1" * LOAD_BYTES)
        time.sleep(LOAD_SECONDS)

    def close(self) -> None:
        super().close()
        if hasattr(self, "_pages"):
            self._pages.close()


class LeavesMemoryEngine(HeavyLoadEngine):
    left: list[mmap.mmap] = []

    def close(self) -> None:
        OnnxRuntimeEngine.close(self)
        if hasattr(self, "_pages"):
            self.left.append(self._pages)


HEAP_BLOCK = 64 << 10
_heap_pins: list[bytearray] = []  # one small block after each load's: the heap's top stays above them


class HeapLoadEngine(OnnxRuntimeEngine):
    def load(self) -> None:
        super().load()
        self._blocks = [bytearray(b"\1") * HEAP_BLOCK for _ in range(LOAD_BYTES // HEAP_BLOCK)]
        _heap_pins.append(bytearray(b"\1") * 1024)

    def close(self) -> None:
        super().close()
        self._blocks = []
