#!/usr/bin/env python3
"""Build a TensorRT plan from an ONNX model: one optimization profile per preferred batch size.

Same as `edge-batcher build-engine`; see edge_batcher/engines/trt_build.py and docs/tensorrt.md.
Run it on the device that will serve the model (plans are tied to the TensorRT version and GPU).

    python tools/build_engine.py engines/vibration/model.onnx --fp16
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from edge_batcher.engines.trt_build import build_engine_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(build_engine_main(sys.argv[1:]))
