"""Triton's shapes without a daemon: the priority scale, statistics counts, the model config and
the gRPC codec's checks (tests/test_triton_tools.py runs the real clients against a daemon)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_batcher.config import BatchingSettings, ModelConfig
from edge_batcher.errors import InvalidInput
from edge_batcher.metrics import Metrics
from edge_batcher.protocol.parameters import priority_parameter, scheduler_level, triton_priority
from edge_batcher.scheduler.policy import BatchPlan, Reason
from edge_batcher.scheduler.stats import RunnerStats
from edge_batcher.transports.triton_config import model_config
from edge_batcher.types import TensorSpec

grpc_codec = pytest.importorskip("edge_batcher.transports.grpc_v2.codec", reason="the grpc extra is not installed")
pb = pytest.importorskip("edge_batcher.transports.grpc_v2.grpc_service_pb2")


@pytest.mark.parametrize(("given", "levels", "level"), [
    (None, 3, None), (0, 3, None),  # the model's default level
    (1, 3, 2), (2, 3, 1), (3, 3, 0),  # 1 is the highest: the scheduler's top level
    (1, 1, 0),
])  # fmt: skip
def test_triton_priorities_map_onto_the_scheduler_levels(given, levels, level) -> None:
    assert scheduler_level(given, levels) == level
    if level is not None:
        assert triton_priority(level, levels) == given


@pytest.mark.parametrize("given", [4, -1, 2**63])
def test_a_priority_beyond_the_models_levels_is_the_clients_mistake(given) -> None:
    expected = rf"parameters.priority {given} is out of range: the model has priority levels 1..3"
    with pytest.raises(InvalidInput, match=expected):
        priority_parameter({"priority": given}, 3)


class _Servable:
    """What model_config reads of a loaded model: its config and declared tensors."""

    def __init__(self, config: ModelConfig, inputs: list[TensorSpec], outputs: list[TensorSpec],
                 cuda_graphs: bool = False):
        self.name, self.config, self.inputs, self.outputs = config.name, config, inputs, outputs
        self.cuda_graphs = cuda_graphs


def test_model_config_is_tritons_message(tmp_path) -> None:
    from google.protobuf import json_format

    from edge_batcher.transports.grpc_v2 import model_config_pb2

    config = ModelConfig(name="m", directory=tmp_path, batching=BatchingSettings(
        preferred_batch_sizes=[2, 4], max_batch_size=6, max_queue_delay_ms=1.5, priority_levels=3,
        default_priority=0, default_timeout_ms=250.0, queue_capacity=99))
    servable = _Servable(config, [TensorSpec("x", "FP32", (-1, 16)), TensorSpec("t", "BYTES", (-1,))],
                         [TensorSpec("y", "INT64", (-1,))])
    body = model_config(servable)
    # Every key is a field of Triton's ModelConfig (parsing refuses unknown ones).
    message = json_format.ParseDict(body, model_config_pb2.ModelConfig())
    assert message.max_batch_size == 6 and message.platform == "onnxruntime_onnx"
    assert [(i.name, model_config_pb2.DataType.Name(i.data_type), list(i.dims)) for i in message.input] == [
        ("x", "TYPE_FP32", [16]), ("t", "TYPE_STRING", [1])]
    assert list(message.output[0].dims) == [1] and list(message.output[0].reshape.shape) == []
    d = message.dynamic_batching
    assert list(d.preferred_batch_size) == [2, 4] and d.max_queue_delay_microseconds == 1500
    # the scheduler's lowest level is Triton's lowest priority (3 of 3)
    assert d.priority_levels == 3 and d.default_priority_level == 3
    queue_policy = d.default_queue_policy
    assert queue_policy.default_timeout_microseconds == 250_000 and queue_policy.max_queue_size == 99
    assert not message.optimization.cuda.graphs


def test_model_config_says_whether_cuda_graphs_replay(tmp_path) -> None:
    """Triton's optimization.cuda.graphs: what the engines do (an "auto" ONNX Runtime model whose
    graphs were refused says false), so an operator can see it without reading the log."""
    from google.protobuf import json_format

    from edge_batcher.transports.grpc_v2 import model_config_pb2

    servable = _Servable(ModelConfig(name="m", directory=tmp_path), [TensorSpec("x", "FP32", (-1, 4))],
                         [TensorSpec("y", "FP32", (-1,))], cuda_graphs=True)
    body = model_config(servable)
    assert body["optimization"] == {"cuda": {"graphs": True}}
    assert json_format.ParseDict(body, model_config_pb2.ModelConfig()).optimization.cuda.graphs


def test_statistics_have_tritons_counts() -> None:
    stats = RunnerStats("m", Metrics())
    # two batches: 3 requests in a batch of 4, then 2 requests in a batch of 2
    for requests, size, seconds, engine in ((3, 4, 0.010, 0.008), (2, 2, 0.004, 0.003)):
        plan = BatchPlan(requests=[], rows=requests, size=size, bucket=0, reason=Reason.FULL)
        stats.record_batch(plan, [0.0] * requests, requests, 0.001, 0.02, seconds, engine)
    body = stats.to_json(0, [])
    s = body["inference_stats"]
    assert body["execution_count"] == 2 and body["inference_count"] == 5
    for key in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert s[key]["count"] == 5, key  # per request, as Triton counts (perf_analyzer checks)
    # each request is charged its batch's whole time
    assert s["compute_infer"]["ns"] == pytest.approx(3 * 8e6 + 2 * 3e6, abs=10)
    assert s["compute_input"]["ns"] == pytest.approx(3 * 2e6 + 2 * 1e6, abs=10)
    for entry in body["batch_stats"]:
        counts = {entry[k]["count"] for k in ("compute_input", "compute_infer", "compute_output")}
        assert counts == {1}
    assert body["execution_ns"] == {"engine": pytest.approx(11e6, abs=10),
                                    "assemble_and_split": pytest.approx(3e6, abs=10)}


def _request(*inputs, raw: list[bytes] | None = None, **parameters) -> object:
    request = pb.ModelInferRequest(model_name="m", id="r1")
    for name, datatype, shape in inputs:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
    if raw is not None:
        request.raw_input_contents.extend(raw)
    for key, value in parameters.items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        else:
            request.parameters[key].int64_param = value
    return request


def test_grpc_raw_and_typed_contents_decode_like_http() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    decoded = grpc_codec.decode_infer_request(_request(("x", "FP32", [2, 3]), raw=[x.tobytes()], priority=1))
    np.testing.assert_array_equal(decoded.inputs["x"], x)
    assert decoded.id == "r1" and decoded.parameters == {"priority": 1}
    typed = _request(("x", "INT32", [3]))
    typed.inputs[0].contents.int_contents.extend([1, 2, 3])
    np.testing.assert_array_equal(grpc_codec.decode_infer_request(typed).inputs["x"], np.array([1, 2, 3], np.int32))
    text = _request(("t", "BYTES", [2]))
    text.inputs[0].contents.bytes_contents.extend([b"a", b"bc"])
    assert list(grpc_codec.decode_infer_request(text).inputs["t"]) == [b"a", b"bc"]


@pytest.mark.parametrize(("request_", "message"), [
    (_request(("x", "FP32", [2, 3]), raw=[b"\0" * 20]), "input 'x'"),
    (_request(("x", "FP32", [2]), ("y", "FP32", [2]), raw=[b"\0" * 8]),
     "raw_input_contents has 1 entries for 2 inputs"),
    (_request(("x", "FP99", [2]), raw=[b"\0" * 8]), "unknown datatype 'FP99'"),
    (_request(("x", "FP32", [2])), "input 'x' has no data"),
    (_request(("x", "FP16", [2])), "FP16 data travels in raw_input_contents only"),
    (_request(("x", "FP32", [1]), ("x", "FP32", [1]), raw=[b"\0" * 4] * 2), "appears twice"),
])  # fmt: skip
def test_grpc_bad_input_is_named(request_, message) -> None:
    with pytest.raises(InvalidInput, match=message):
        grpc_codec.decode_infer_request(request_)


def test_grpc_outputs_travel_raw() -> None:
    outputs = {"y": np.array([[1.5, 2.5]], np.float32), "t": np.array([b"ab"], dtype=object)}
    response = grpc_codec.encode_infer_response("m", "r1", outputs, {"done": True})
    described = [(o.name, o.datatype, list(o.shape)) for o in response.outputs]
    assert described == [("y", "FP32", [1, 2]), ("t", "BYTES", [1])]
    assert np.frombuffer(response.raw_output_contents[0], "<f4").tolist() == [1.5, 2.5]
    assert response.raw_output_contents[1] == b"\x02\x00\x00\x00ab"
    assert response.parameters["done"].bool_param is True


def test_a_daemon_without_grpc_never_imports_grpcio() -> None:
    import subprocess
    import sys

    # (protobuf itself is loaded anyway: onnx uses it)
    code = ("import sys, edge_batcher.daemon, edge_batcher.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'grpc' or 'grpc_v2' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
