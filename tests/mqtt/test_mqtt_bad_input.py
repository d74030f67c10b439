"""The v2 decoder's limits over MQTT (issue 14): payloads that used to crash it (a reply of 500,
or none) and a NaN deadline (504) get a 400 reply naming the problem, and serving goes on."""

from __future__ import annotations

import json

from tests.support.mqtt import INFER, signal_rows, v2_json


def test_values_shapes_and_deadlines_the_decoder_cannot_hold_get_400_replies(start_transport, mqtt_client):
    transport = start_transport()
    client = mqtt_client()

    def request(inputs=None, **extra) -> bytes:
        inputs = inputs or [{"name": "signal", "shape": [1, 256], "datatype": "FP32", "data": [0.0] * 256}]
        return json.dumps({"inputs": inputs, **extra}).encode()

    cases = [
        (request([{"name": "signal", "shape": [1], "datatype": "FP32", "data": [10**400]}]),
         "input 'signal': data for FP32 has an integer too large for any floating-point number"),
        (request([{"name": "signal", "shape": [1] * 65, "datatype": "FP32", "data": [0.5]}]),
         "input 'signal': shape has 65 dimensions"),
        (request(parameters={"timeout_ms": float("nan")}),
         "parameters.timeout_ms must be a finite number >= 0, got nan"),
        (request(parameters={"timeout": float("inf")}), "parameters.timeout must be a finite number >= 0"),
    ]
    for i, (payload, _) in enumerate(cases):
        client.publish(INFER, payload, correlation=str(i).encode())
    replies = {r.correlation: r for r in client.collect(len(cases))}
    for i, (_, words) in enumerate(cases):
        reply = replies[str(i).encode()]
        assert reply.status == "400", (i, reply.payload)
        assert words in reply.json()["error"], (i, reply.payload)

    client.publish(INFER, v2_json(signal_rows(1)), correlation=b"after")
    (reply,) = client.collect(1)
    assert reply.status == "200" and reply.correlation == b"after"
    assert transport.state == "connected"
