"""A test-only backend: the real ONNX Runtime engine plus faults injected on purpose.

Clearly a test double, used as `backend = "tests.support.faulty_engine:FaultyOnnxEngine"` in
a test model.toml. It runs the real model; only batches carrying a sentinel value misbehave:
  -999 anywhere in the batch: infer() raises (an engine failure);
  -500 anywhere in the batch: infer() sleeps 0.5 s first (a slow batch, to build a queue).
"""

from __future__ import annotations

import time

import numpy as np

from edge_batcher.engines.onnxruntime import OnnxRuntimeEngine

FAIL = -999.0
SLOW = -500.0


class FaultyOnnxEngine(OnnxRuntimeEngine):
    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in inputs.values()])
        if np.any(values == FAIL):
            raise RuntimeError("injected fault: sentinel -999 in the batch")
        if np.any(values == SLOW):
            time.sleep(0.5)
        return super().infer(inputs)
