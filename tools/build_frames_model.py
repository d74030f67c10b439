#!/usr/bin/env python3
"""A cheap camera-frame model for transport tests and benchmarks (no training, no model hub):
`frames` UINT8 [N, 480, 640, 3] -> `brightness` FP32 [N] and `channel_mean` FP32 [N, 3], the mean
byte values of a grid of every STRIDE-th pixel (16: 30 x 40 pixels of a 640x480 frame). Its
compute is a few microseconds per frame, so what a benchmark measures is the transport. The
shape follows issue 30's vision model (`--height`, `--width` change it).

Usage: python tools/build_frames_model.py OUT_DIR [--name frames] [--height 480] [--width 640]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import onnx
from onnx import TensorProto, helper

STRIDE = 16
MODEL_TOML = """# A cheap frame model built by tools/build_frames_model.py: the transport dominates its requests.
backend = "onnxruntime"
description = "Frame brightness: uint8 camera frames -> mean byte value, overall and per channel"

[onnxruntime]
execution_providers = ["CPUExecutionProvider"]
intra_op_threads = 1

[batching]
preferred_batch_sizes = [2, 4, 8]
max_queue_delay_ms = {delay_ms}
dispatch_when_idle = {when_idle}
default_timeout_ms = 10000
queue_capacity = 256
"""


def build(out: Path, name: str = "frames", height: int = 480, width: int = 640, delay_ms: float = 2.0,
          dispatch_when_idle: bool = True) -> Path:
    """The model in out/name. Tests of batching pass dispatch_when_idle=False, so that requests
    sent together wait delay_ms for each other even when the first finds the model idle."""
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    graph = helper.make_graph(
        [
            helper.make_node("Slice", ["frames", "starts", "ends", "image_axes", "steps"], ["grid"]),
            helper.make_node("Cast", ["grid"], ["pixels"], to=TensorProto.FLOAT),
            helper.make_node("ReduceMean", ["pixels", "image_axes"], ["channel_mean"], keepdims=0),
            helper.make_node("ReduceMean", ["channel_mean", "channel_axis"], ["brightness"], keepdims=0),
        ],
        name,
        [helper.make_tensor_value_info("frames", TensorProto.UINT8, ["batch", height, width, 3])],
        [helper.make_tensor_value_info("brightness", TensorProto.FLOAT, ["batch"]),
         helper.make_tensor_value_info("channel_mean", TensorProto.FLOAT, ["batch", 3])],
        initializer=[helper.make_tensor("image_axes", TensorProto.INT64, [2], [1, 2]),
                     helper.make_tensor("starts", TensorProto.INT64, [2], [0, 0]),
                     helper.make_tensor("ends", TensorProto.INT64, [2], [height, width]),
                     helper.make_tensor("steps", TensorProto.INT64, [2], [STRIDE, STRIDE]),
                     helper.make_tensor("channel_axis", TensorProto.INT64, [1], [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, d / "model.onnx")
    (d / "model.toml").write_text(MODEL_TOML.format(delay_ms=delay_ms, when_idle=str(dispatch_when_idle).lower()))
    return d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the model repository to add it to")
    parser.add_argument("--name", default="frames")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=640)
    args = parser.parse_args()
    print(build(args.out, args.name, args.height, args.width))


if __name__ == "__main__":
    main()
