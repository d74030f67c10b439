"""A peer's answer is brought to the local model's shapes and datatypes, or refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from edge_batcher.offload.client import PeerError
from edge_batcher.offload.conform import conform_outputs
from edge_batcher.types import TensorSpec

SPECS = [
    TensorSpec("class_probs", "FP32", (-1, 4)),
    TensorSpec("class_id", "INT64", (-1,)),
    TensorSpec("tokens", "FP32", (-1, -1, 8)),
    TensorSpec("text", "BYTES", (-1,)),
]


def conform(outputs, rows=3):
    return conform_outputs(outputs, SPECS, rows, "edge-server", "m")


def test_mlserver_s_trailing_unit_dimension_is_dropped():
    probs = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = conform({"class_probs": probs, "class_id": np.array([[2], [0], [1]], np.int64)})
    assert got["class_id"].shape == (3,) and got["class_id"].tolist() == [2, 0, 1]
    assert got["class_probs"] is probs  # already right: untouched


def test_a_missing_unit_dimension_is_added_and_dynamic_dims_are_kept():
    got = conform({"tokens": np.ones((3, 5, 8), np.float32)})
    assert got["tokens"].shape == (3, 5, 8)
    spec = [TensorSpec("score", "FP32", (-1, 1))]
    assert conform_outputs({"score": np.ones(3, np.float32)}, spec, 3, "p", "m")["score"].shape == (3, 1)


def test_datatypes_are_cast_within_their_kind_only():
    got = conform({"class_id": np.array([1, 2, 3], np.int32), "class_probs": np.ones((3, 4), np.float16)})
    assert got["class_id"].dtype == np.int64 and got["class_probs"].dtype == np.float32
    with pytest.raises(PeerError, match=r"output 'class_id': datatype float32 where the model answers INT64"):
        conform({"class_id": np.array([1.0, 2.0, 3.0], np.float32)})


def test_bytes_and_undeclared_outputs_pass_as_they_are():
    text = np.array([b"a", b"b", b"c"], dtype=object)
    extra = np.zeros((3, 2))
    got = conform({"text": text, "extra": extra})
    assert got["text"] is text and got["extra"] is extra


@pytest.mark.parametrize("outputs, detail", [
    ({"class_probs": np.ones((3, 5), np.float32)}, r"shape \[3, 5\] where the model answers \[3, 4\]"),
    ({"class_probs": np.ones((3, 2, 2), np.float32)}, r"shape \[3, 2, 2\] where the model answers \[3, 4\]"),
    ({"class_id": np.ones(2, np.int64)}, r"shape \[2\] for a request of 3 row\(s\)"),
    ({"tokens": np.ones((3, 5, 4), np.float32)}, r"shape \[3, 5, 4\] where the model answers \[3, -1, 8\]"),
])
def test_a_real_mismatch_is_an_error_naming_the_peer_model_and_output(outputs, detail):
    with pytest.raises(PeerError, match=r"peer edge-server: model 'm' output '\w+': " + detail) as info:
        conform(outputs)
    assert "the peer's model does not match this one" in info.value.message
    assert info.value.breaker_failure is False  # the peer answered; its model is the problem


# --------------------------------------------------------------------------- declared specs vs a peer's metadata

from edge_batcher.offload.conform import spec_mismatches  # noqa: E402

INPUTS = [TensorSpec("signal", "FP32", (-1, 256))]
OUTPUTS = [TensorSpec("class_id", "INT64", (-1,)), TensorSpec("anomaly_score", "FP32", (-1,))]


def metadata(inputs=(("signal", "FP32", [-1, 256]),),
             outputs=(("class_id", "INT64", [-1]), ("anomaly_score", "FP32", [-1]))):
    def tensors(entries):
        return [{"name": n, "datatype": d, "shape": s} for n, d, s in entries]

    return {"name": "vibration", "inputs": tensors(inputs), "outputs": tensors(outputs)}


def test_agreeing_metadata_has_no_mismatch_up_to_unit_dims_and_castable_outputs():
    assert spec_mismatches(INPUTS, OUTPUTS, metadata()) == []
    # MLServer-style [n, 1] and a TensorRT-style INT32 class id conform: not mismatches.
    mlserver_style = metadata(outputs=(("class_id", "INT32", [-1, 1]), ("anomaly_score", "FP32", [-1, 1])))
    assert spec_mismatches(INPUTS, OUTPUTS, mlserver_style) == []
    # A peer that describes no tensors (MLServer custom runtimes) cannot be checked.
    assert spec_mismatches(INPUTS, OUTPUTS, {"name": "vibration", "inputs": [], "outputs": []}) == []


def test_every_disagreement_is_named():
    problems = spec_mismatches(INPUTS, OUTPUTS, metadata(
        inputs=(("signal", "FP16", [-1, 128]),),
        outputs=(("class_id", "FP32", [-1]),),
    ))
    assert problems == [
        "input 'signal' is FP16 there, FP32 here",
        "input 'signal' has shape [-1, 128] there, [-1, 256] here",
        "output 'class_id' is FP32 there, INT64 here",
        "output 'anomaly_score' is missing (the peer's outputs: class_id)",
    ]
