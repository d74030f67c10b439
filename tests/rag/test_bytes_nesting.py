"""Issue 31 row 16: BYTES data nested 100 levels deep with shape [1] was flattened and answered
200. JSON data must be flat or nested exactly as its shape: anything else is a 400 naming the
tensor, over HTTP and MQTT (the same decoder), and the daemon keeps serving."""

from __future__ import annotations

import json

from tests.support import rawhttp
from tests.support.mqtt import MOSQUITTO, Broker, TestClient, wait_mqtt

PREFIX = "edge-batcher/nesting"


def request(shape: list[int], data: list) -> bytes:
    return json.dumps({"inputs": [{"name": "text", "shape": shape, "datatype": "BYTES", "data": data}]}).encode()


def nested(value, levels: int):
    for _ in range(levels):
        value = [value]
    return value


def test_bytes_data_nested_otherwise_than_its_shape_is_a_400_on_http_and_mqtt(start_daemon, tmp_path):
    broker = Broker(tmp_path / "broker").start() if MOSQUITTO else None
    try:
        mqtt_config = (f'[mqtt]\nenabled = true\nhost = "127.0.0.1"\nport = {broker.port}\ntopic_prefix = "{PREFIX}"\n'
                       if broker else "")
        daemon = start_daemon('[models]\nload = ["minilm"]\n' + mqtt_config)
        deep = request([1], nested("a bearing fault", 100))
        status, body = rawhttp.request(daemon.socket, "POST", "/v2/models/minilm/infer", deep)
        assert status == 400, body
        assert body["error"] == ("input 'text': data is nested deeper than shape [1]; "
                                 "send it flat or nested as the shape")
        good = request([2], ["a bearing fault", "misalignment"])  # minilm's text is [batch]: flat is its nesting
        status, body = rawhttp.request(daemon.socket, "POST", "/v2/models/minilm/infer", good)
        assert status == 200 and body["outputs"][0]["shape"] == [2, 384], body
        if broker is not None:
            wait_mqtt(daemon)
            client = TestClient(broker.port)
            try:
                client.publish(f"{PREFIX}/infer/minilm", deep, correlation=b"deep")
                (reply,) = client.collect(1, timeout=30)
            finally:
                client.close()
            assert reply.status == "400" and "data is nested deeper than shape [1]" in reply.json()["error"]
    finally:
        if broker is not None:
            broker.stop()
    assert "Traceback" not in daemon.log_text()
