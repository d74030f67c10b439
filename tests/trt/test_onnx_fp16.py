"""The --fp16 conversion for strongly typed TensorRT (engines/onnx_fp16.py), checked with ONNX Runtime:
the converted model runs, keeps FP32 inputs/outputs, and gives FP16-close (not identical) answers."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edge_batcher.engines.onnx_fp16 import convert_to_fp16
from edge_batcher.errors import ConfigError


def run(path, x):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {"signal": x})))


def test_the_demo_model_converts_and_stays_close(model_repo, tmp_path):
    source, target = model_repo / "vibration" / "model.onnx", tmp_path / "model.fp16.onnx"
    counts = convert_to_fp16(source, target)
    assert counts["initializers"] > 0 and counts["io_casts"] == 3  # one input, two float outputs
    model = onnx.load(str(target))
    assert {v.name: v.type.tensor_type.elem_type for v in model.graph.input} == {"signal": TensorProto.FLOAT}
    assert all(i.data_type != TensorProto.FLOAT for i in model.graph.initializer)
    x = np.random.default_rng(1).normal(0.0, 0.7, size=(8, 256)).astype(np.float32)
    ref, got = run(source, x), run(target, x)
    for name in ("class_probs", "anomaly_score"):
        assert got[name].dtype == np.float32
        np.testing.assert_allclose(got[name], ref[name], atol=2e-2, rtol=2e-2)
    assert not all(np.array_equal(got[n], ref[n]) for n in ("class_probs", "anomaly_score"))  # really FP16
    assert np.mean(got["class_id"] == ref["class_id"]) >= 0.75


def test_a_converted_model_is_not_converted_twice(model_repo, tmp_path):
    convert_to_fp16(model_repo / "vibration" / "model.onnx", tmp_path / "a.onnx")
    with pytest.raises(ConfigError, match="already has FP16 initializers.*without --fp16"):
        convert_to_fp16(tmp_path / "a.onnx", tmp_path / "b.onnx")


def test_values_beyond_fp16_range_are_refused(tmp_path):
    big = helper.make_tensor("big", TensorProto.FLOAT, [1], [1e6])
    graph = helper.make_graph([helper.make_node("Mul", ["signal", "big"], ["y"])], "g",
                              [helper.make_tensor_value_info("signal", TensorProto.FLOAT, ["N", 1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])], [big])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    with pytest.raises(ConfigError, match="beyond FP16's range.*modelopt.onnx.autocast"):
        convert_to_fp16(tmp_path / "m.onnx", tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()
