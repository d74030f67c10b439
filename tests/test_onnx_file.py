"""engines/onnx_file.py: a whole ONNX model passes, one cut short anywhere or a file of another
kind under its name is named, against models written by the onnx package itself."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_batcher.engines.onnx_file import onnx_file_problem


def small_model() -> bytes:
    weights = numpy_helper.from_array(np.arange(24, dtype=np.float32).reshape(4, 6), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "small",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 6])], [weights])
    model = helper.make_model(graph, producer_name="test", opset_imports=[helper.make_opsetid("", 17)])
    model.metadata_props.add(key="k", value="v")
    onnx.checker.check_model(model)
    return model.SerializeToString()


def test_whole_models_pass(tmp_path, model_repo):
    path = tmp_path / "m.onnx"
    path.write_bytes(small_model())
    assert onnx_file_problem(path) is None
    assert onnx_file_problem(model_repo / "vibration" / "model.onnx") is None  # as tools/ built it


def test_a_model_cut_short_is_named_unless_only_trailing_metadata_is_lost(tmp_path):
    data = small_model()
    whole = onnx.load_from_string(data)
    path = tmp_path / "m.onnx"
    passed = []
    for cut in range(1, len(data)):
        path.write_bytes(data[:cut])
        if onnx_file_problem(path) is None:
            passed.append(cut)
    # Only a cut between the last top-level fields (metadata_props, after the graph and its
    # opsets) leaves a whole model behind: onnx reads the same graph and opsets from it.
    assert len(passed) <= 1, passed
    for cut in passed:
        left = onnx.load_from_string(data[:cut])
        assert left.graph == whole.graph and left.opset_import == whole.opset_import
        assert not left.metadata_props


@pytest.mark.parametrize("content, expected", [
    (b"<!DOCTYPE html><html>404</html>", "byte 0 holds a protobuf wire type 4 that ONNX never uses"),
    (b"\x00" * 4096, "byte 0 is not a protobuf field (field number 0)"),
    (b"ftrt" + bytes(range(256)), "byte 0 holds a protobuf wire type 6"),  # a TensorRT plan's start
    (b"\x08\x08", "it holds no graph"),  # an ir_version alone
])
def test_files_of_another_kind_are_named(tmp_path, content, expected):
    path = tmp_path / "m.onnx"
    path.write_bytes(content)
    problem = onnx_file_problem(path)
    assert problem is not None and expected in problem, problem


def test_random_bytes_are_never_taken_for_a_model(tmp_path):
    path = tmp_path / "m.onnx"
    for _ in range(200):
        path.write_bytes(os.urandom(512))
        assert onnx_file_problem(path) is not None


@pytest.mark.parametrize("name", ["model.ort", "model.plan", "model.engine"])
def test_files_of_other_formats_are_not_judged_as_onnx(tmp_path, name):
    """ONNX Runtime's .ort format and TensorRT plans are not protobuf ONNX: no verdict on them."""
    path = tmp_path / name
    path.write_bytes(b"ftrt" + bytes(range(256)))
    assert onnx_file_problem(path) is None
