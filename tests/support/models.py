"""Test model repository: the demo vibration model plus small models built here."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import onnx
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[2]


def build_demo(out: Path) -> dict:
    spec = importlib.util.spec_from_file_location("build_demo_models", ROOT / "tools" / "build_demo_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_vibration(out)


def build_seqsum(out: Path) -> None:
    """x FP32 [batch, seq] -> sum [batch], peak [batch]: zero padding changes neither."""
    d = out / "seqsum"
    d.mkdir(parents=True, exist_ok=True)
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(
        [
            helper.make_node("ReduceSum", ["x", "axes"], ["sum"], keepdims=0),
            helper.make_node("Abs", ["x"], ["absx"]),
            helper.make_node("ReduceMax", ["absx", "axes"], ["peak"], keepdims=0),
        ],
        "seqsum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
        [helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["batch"]),
         helper.make_tensor_value_info("peak", TensorProto.FLOAT, ["batch"])],
        initializer=[axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, d / "model.onnx")
    (d / "model.toml").write_text(
        'backend = "onnxruntime"\n'
        "[batching]\npreferred_batch_sizes = [2, 4, 8]\nmax_queue_delay_ms = 5.0\n"
        '[sequence]\ninputs = ["x"]\naxis = 1\nbuckets = [8, 16, 32]\npad_value = 0.0\n'
    )


def add_vibration_variant(out: Path, name: str, backend: str, batching: str) -> None:
    """The vibration model under another name, served by a test backend with its own batching."""
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(out / "vibration" / "model.onnx", d / "model.onnx")
    (d / "model.toml").write_text(f'backend = "{backend}"\n[batching]\npreferred_batch_sizes = [2, 4, 8]\n{batching}')


def build_repository(out: Path) -> Path:
    build_demo(out)
    build_seqsum(out)
    # Faults injected on purpose (tests/support/faulty_engine.py).
    add_vibration_variant(out, "faulty", "tests.support.faulty_engine:FaultyOnnxEngine",
                          "max_queue_delay_ms = 2.0\npriority_levels = 2\nqueue_capacity = 64\n")
    # Out of memory above 4 rows of real data.
    add_vibration_variant(out, "oomy", "tests.support.faulty_engine:OomAboveFourEngine", "max_queue_delay_ms = 20.0\n")
    return out
