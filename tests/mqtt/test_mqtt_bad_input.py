"""The v2 decoder's limits over MQTT (issue 14): payloads that used to crash it (a reply of 500,
or none) and a NaN deadline (504) get a 400 reply naming the problem, and serving goes on."""

from __future__ import annotations

import json

from edge_batcher.config import StreamMapping
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


def test_a_payload_over_max_body_bytes_is_answered_413_without_being_parsed(served, start_transport, mqtt_client):
    """The limit of every transport's edge, [server] max_body_bytes, holds over MQTT too (issue 31):
    a larger request or stream reading gets 413 and is acked, instead of being parsed on the event
    loop (a 16 MiB JSON array held it for about half a second)."""
    _, runtime = served
    limit = runtime.config.server.max_body_bytes
    transport = start_transport(streams=[StreamMapping(topic="sensors/+/big", model="vibration",
                                                       output_topic="results/{1}")])
    client = mqtt_client()
    client.subscribe("results/#")
    big = b"[" + b"0," * (limit // 2) + b"0]"  # limit + 3 bytes of valid JSON
    client.publish(INFER, big, correlation=b"big")
    client.publish("sensors/s1/big", big, response_topic=None)
    replies = {r.topic: r for r in client.collect(2, timeout=60)}
    request, reading = replies[client.response_topic], replies["results/s1"]
    for reply in (request, reading):
        assert reply.status == "413", reply.payload[:200]
        assert f"payload too large: {limit + 3} bytes, limit is {limit} bytes ([server] max_body_bytes)" \
            in reply.json()["error"]
    assert request.correlation == b"big" and reading.json()["topic"] == "sensors/s1/big"
    assert transport.stats["rejected"] == 2 and transport.stats["requests"] == 0

    client.publish(INFER, v2_json(signal_rows(1)), correlation=b"after")
    (reply,) = client.collect(1)
    assert reply.status == "200" and reply.correlation == b"after"
