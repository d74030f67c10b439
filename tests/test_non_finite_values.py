"""Issue 31 row 11: NaN and Infinity in sensor inputs were accepted on every door, and replies
carried bare `NaN` (invalid JSON for strict parsers) or class_id 0, "normal": a broken sensor
reported healthy. Now a floating-point input holding one is a 400 naming it (unless the model's
model.toml sets allow_non_finite_inputs), on HTTP (JSON and binary), gRPC and MQTT sensor
streams; and no reply is ever anything but strict JSON: an output holding one is a 500 naming
the model and the output when asked for as JSON, and travels exactly in binary.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from edge_batcher.protocol import v2
from tests.support import rawhttp
from tests.support.mqtt import TestClient, signal_rows, wait_mqtt

grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the dev extra")
pytest.importorskip("edge_batcher.transports.grpc_v2.server", reason="the grpc extra is not installed")
from tritonclient.utils import InferenceServerException  # noqa: E402

INFER = "/v2/models/{}/infer"


def strict_json(data: bytes):
    """json.loads that refuses NaN and Infinity, as JavaScript's JSON.parse and most parsers do."""
    def refuse(token):
        raise AssertionError(f"not strict JSON: {token} in {data[:200]!r}")
    return json.loads(data, parse_constant=refuse)


def v2_body(rows: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "signal", "shape": list(rows.shape), "datatype": "FP32",
                                   "data": rows.ravel().tolist()}]}).encode()  # json writes NaN/Infinity tokens


def post(daemon, model: str, body: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    conn = rawhttp.UnixConnection(str(daemon.socket))
    try:
        conn.request("POST", INFER.format(model), body=body, headers=headers or {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.fixture
def repo(model_repo, tmp_path):
    """vibration as built, and vibration_nan: the same model with allow_non_finite_inputs = true."""
    out = tmp_path / "engines"
    shutil.copytree(model_repo / "vibration", out / "vibration")
    shutil.copytree(model_repo / "vibration", out / "vibration_nan")
    toml = out / "vibration_nan" / "model.toml"
    toml.write_text("allow_non_finite_inputs = true\n" + toml.read_text())
    return out


def test_nan_and_infinity_are_refused_on_every_door_and_replies_stay_strict_json(start_daemon, repo, broker,
                                                                                 tmp_path):
    grpc_socket = tmp_path / "grpc.sock"
    daemon = start_daemon(
        f'[server]\ngrpc = ["unix:{grpc_socket}"]\n'
        f'[mqtt]\nenabled = true\nhost = "127.0.0.1"\nport = {broker.port}\n'
        '[[mqtt.streams]]\ntopic = "sensors/+/vibration"\nmodel = "vibration"\noutput_topic = "results/{1}"\n'
        '[[mqtt.streams]]\ntopic = "raw/+"\nmodel = "vibration"\nencoding = "raw"\noutput_topic = "rawres/{1}"\n'
        '[[mqtt.streams]]\ntopic = "lenient/+"\nmodel = "vibration_nan"\noutput_topic = "lenientres/{1}"\n',
        repo=repo)
    wait_mqtt(daemon)
    rows = signal_rows(2, seed=5)
    nan_rows, inf_rows = rows.copy(), rows.copy()
    nan_rows[1, 17] = np.nan
    inf_rows[0, 3], inf_rows[1, 0] = np.inf, -np.inf
    refused = "model 'vibration' takes finite numbers only"

    # HTTP, JSON: the NaN / Infinity tokens are read, then refused by the model's input check.
    status, body = post(daemon, "vibration", v2_body(nan_rows))
    assert status == 400, body
    assert strict_json(body)["error"] == (
        "input 'signal': 1 of 512 values are NaN or Infinity (or beyond FP32's range, +-3.403e+38; the first at "
        "[1, 17]); model 'vibration' takes finite numbers only (a broken sensor sends these): "
        "allow_non_finite_inputs = true in its model.toml accepts them")
    status, body = post(daemon, "vibration", v2_body(inf_rows))
    assert status == 400 and "2 of 512 values are NaN or Infinity" in strict_json(body)["error"]
    assert "the first at [0, 3]" in strict_json(body)["error"]
    beyond = rows.tolist()
    beyond[0][5] = 1e39  # no FP32 holds it: read as Infinity, refused as such
    status, body = post(daemon, "vibration", json.dumps({"inputs": [{"name": "signal", "shape": [2, 256],
                                                                     "datatype": "FP32", "data": beyond}]}).encode())
    assert status == 400 and "1 of 512 values are NaN or Infinity (or beyond FP32's range" in strict_json(body)["error"]
    # HTTP, binary: the same check, whatever the encoding.
    binary_body, header_length = v2.encode_request({"signal": nan_rows}, binary_outputs=False)
    status, body = post(daemon, "vibration", binary_body, {"Content-Type": v2.BINARY_CONTENT_TYPE,
                                                           v2.HEADER_LENGTH: str(header_length)})
    assert status == 400 and refused in strict_json(body)["error"]
    status, body = post(daemon, "vibration", v2_body(rows))
    assert status == 200 and strict_json(body)["outputs"]  # and everyone else is still served

    # gRPC
    grpc = grpcclient.InferenceServerClient(f"unix:{grpc_socket}")
    try:
        tensor = grpcclient.InferInput("signal", list(nan_rows.shape), "FP32")
        tensor.set_data_from_numpy(nan_rows)
        with pytest.raises(InferenceServerException) as info:
            grpc.infer("vibration", [tensor])
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and refused in info.value.message()
    finally:
        grpc.close()

    # MQTT sensor streams, JSON and raw: a 400 on the stream's output topic.
    mqtt = TestClient(broker.port)
    try:
        for topic in ("results/#", "rawres/#", "lenientres/#"):
            mqtt.subscribe(topic)
        mqtt.publish("sensors/pump7/vibration", json.dumps(nan_rows[1].tolist()), response_topic=None)
        (reply,) = mqtt.collect(1, timeout=30)
        assert reply.topic == "results/pump7" and reply.status == "400"
        assert "1 of 256 values are NaN or Infinity" in strict_json(reply.payload)["error"]
        assert "the first at [0, 17]" in strict_json(reply.payload)["error"]
        mqtt.publish("raw/motor3", inf_rows.astype("<f4").tobytes(), response_topic=None)
        (reply,) = mqtt.collect(1, timeout=30)
        assert reply.topic == "rawres/motor3" and reply.status == "400"
        assert refused in strict_json(reply.payload)["error"]

        # A model that takes them: its NaN outputs are a 500 naming model and output, in strict JSON.
        mqtt.publish("lenient/pump7", json.dumps(nan_rows[1].tolist()), response_topic=None)
        (reply,) = mqtt.collect(1, timeout=30)
        assert reply.topic == "lenientres/pump7" and reply.status == "500", reply
        assert "model 'vibration_nan': output 'class_probs' holds 4 NaN or Infinity values, which a JSON result " \
               "cannot carry" in strict_json(reply.payload)["error"]
    finally:
        mqtt.close()

    # The same over HTTP: JSON refuses with a 500 that says how to get them; binary carries them.
    status, body = post(daemon, "vibration_nan", v2_body(nan_rows))
    assert status == 500
    assert strict_json(body)["error"].startswith(
        "model 'vibration_nan': its response cannot be sent: output 'class_probs' holds 4 NaN or Infinity values, "
        "which JSON cannot carry: ask for it binary (binary_data_output)")
    request = json.loads(v2_body(nan_rows))
    request["parameters"] = {"binary_data_output": True}
    conn = rawhttp.UnixConnection(str(daemon.socket))
    try:
        conn.request("POST", INFER.format("vibration_nan"), body=json.dumps(request))
        resp = conn.getresponse()
        status, body, header_length = resp.status, resp.read(), resp.getheader(v2.HEADER_LENGTH)
    finally:
        conn.close()
    assert status == 200
    strict_json(body[:int(header_length)])
    outputs = v2.decode_response(body, int(header_length)).outputs
    assert np.isnan(outputs["class_probs"][1]).all() and np.isfinite(outputs["class_probs"][0]).all()

    log = daemon.log_text()
    assert "Traceback" not in log, log[-3000:]
