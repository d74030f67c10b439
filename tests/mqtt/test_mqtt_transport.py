"""The MQTT transport in-process: real mosquitto, real Runtime with the demo vibration model."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from edge_batcher.config import MqttSettings, StreamMapping
from edge_batcher.errors import ConfigError
from edge_batcher.protocol import v2
from edge_batcher.transports.mqtt import MqttTransport
from edge_batcher.types import InferRequest
from tests.support.mqtt import INFER, PREFIX, Broker, TestClient, make_tls_files, signal_rows, v2_json, wait_until


def direct(served, rows: np.ndarray) -> dict[str, np.ndarray]:
    lt, runtime = served
    return lt.run(runtime.infer(InferRequest(model="vibration", inputs={"signal": rows}))).outputs


# --------------------------------------------------------------------------- request / response


def test_request_reply_carries_correlation_data_status_and_id(served, start_transport, mqtt_client):
    start_transport()
    client = mqtt_client()
    rows = signal_rows(2)
    client.publish(INFER, v2_json(rows, id="req-1"), correlation=b"\x00corr-1")
    (reply,) = client.collect(1)
    assert reply.topic == client.response_topic
    assert reply.correlation == b"\x00corr-1"
    assert reply.status == "200"
    assert reply.content_type == "application/json"
    body = reply.json()
    assert body["model_name"] == "vibration" and body["id"] == "req-1"
    outputs = {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in body["outputs"]}
    expected = direct(served, rows)
    np.testing.assert_array_equal(outputs["class_id"], expected["class_id"])
    np.testing.assert_allclose(outputs["class_probs"], expected["class_probs"], rtol=1e-5, atol=1e-6)


def test_binary_request_and_reply(served, start_transport, mqtt_client):
    start_transport()
    client = mqtt_client()
    rows = signal_rows(3, seed=1)
    body, header_length = v2.encode_request({"signal": rows}, id="bin-1", binary_inputs=True, binary_outputs=True)
    assert header_length is not None
    client.publish(INFER, body, correlation=b"bin", content_type="application/octet-stream",
                   user_properties=[(v2.HEADER_LENGTH, str(header_length))])
    (reply,) = client.collect(1)
    assert reply.status == "200" and reply.correlation == b"bin"
    assert reply.content_type == "application/octet-stream"
    decoded = v2.decode_response(reply.payload, int(reply.user_properties[v2.HEADER_LENGTH]))
    assert decoded.id == "bin-1"
    expected = direct(served, rows)
    np.testing.assert_array_equal(decoded.outputs["class_id"], expected["class_id"])
    np.testing.assert_allclose(decoded.outputs["anomaly_score"], expected["anomaly_score"], rtol=1e-5, atol=1e-6)


def test_request_without_response_topic_is_answered_on_the_result_topic(start_transport, mqtt_client):
    start_transport()
    client = mqtt_client()
    client.subscribe(f"{PREFIX}/result/+")
    client.publish(INFER, v2_json(signal_rows(1), id="no-rt"), response_topic=None, correlation=b"c")
    (reply,) = client.collect(1)
    assert reply.topic == f"{PREFIX}/result/vibration"
    assert reply.status == "200" and reply.json()["id"] == "no-rt" and reply.correlation == b"c"


@pytest.mark.parametrize("topic, route", [
    (INFER, ("infer", "vibration")),
    (f"{PREFIX}/infer/", ("infer", "")),  # '+' matches an empty level: the model "" is answered 404
    (f"{PREFIX}/infer/vibration/extra", None),
    (f"{PREFIX}/inferx/vibration", None),
    (f"{PREFIX}x/infer/vibration", None),
])
def test_a_request_topic_is_the_infer_filter_and_one_level(served, topic, route):
    _, runtime = served
    transport = MqttTransport(MqttSettings(enabled=True, device_id="testdev"), runtime, source="test")
    assert transport._route(topic) == route


def test_malformed_requests_get_error_replies_and_serving_goes_on(start_transport, mqtt_client):
    transport = start_transport()
    client = mqtt_client()
    good = v2_json(signal_rows(1), id="ok")
    wrong_shape = json.dumps({"id": "shape", "inputs": [
        {"name": "signal", "shape": [1, 100], "datatype": "FP32", "data": [0.0] * 100}]}).encode()
    wrong_type = json.dumps({"id": "dtype", "inputs": [
        {"name": "signal", "shape": [1, 256], "datatype": "INT32", "data": [0] * 256}]}).encode()
    cases = [
        (INFER, b"{not json", {}, "400", "not valid JSON"),
        (INFER, b"", {}, "400", "empty payload"),
        (INFER, wrong_shape, {}, "400", "dimension 1 must be 256"),
        (INFER, wrong_type, {}, "400", "datatype INT32"),
        (f"{PREFIX}/infer/nosuchmodel", good, {}, "404", "unknown model 'nosuchmodel'"),
        (INFER, good, {"content_type": "application/octet-stream"}, "400", v2.HEADER_LENGTH),
    ]
    for i, (topic, payload, kwargs, _, _) in enumerate(cases):
        client.publish(topic, payload, correlation=str(i).encode(), **kwargs)
    replies = {r.correlation: r for r in client.collect(len(cases))}
    for i, (_, _, _, status, words) in enumerate(cases):
        reply = replies[str(i).encode()]
        assert reply.status == status, (i, reply.payload)
        assert words in reply.json()["error"], (i, reply.payload)
    assert replies[b"2"].json()["id"] == "shape"  # the id is echoed even when decoding failed
    assert replies[b"3"].json()["id"] == "dtype"

    client.publish(INFER, good, correlation=b"after")
    (reply,) = client.collect(1)
    assert reply.status == "200" and reply.correlation == b"after"
    assert transport.state == "connected"


def test_overload_answers_429_and_every_request_gets_a_reply(start_transport, mqtt_client):
    transport = start_transport(max_pending=1)
    client = mqtt_client()
    n = 60
    payload = v2_json(signal_rows(1))
    # QoS 0: the broker's flow control (Receive Maximum = max_pending) does not hold these back,
    # so they all arrive at once and the hand-off must shed them.
    for i in range(n):
        client.publish(INFER, payload, correlation=i.to_bytes(2, "big"), qos=0)
    replies = client.collect_correlations({i.to_bytes(2, "big") for i in range(n)}, timeout=20)
    statuses = [r[0].status for r in replies.values()]
    assert statuses.count("429") > 0, statuses
    assert statuses.count("200") > 0, statuses
    assert set(statuses) <= {"200", "429"}
    overloaded = next(r[0] for r in replies.values() if r[0].status == "429")
    assert "overloaded" in overloaded.json()["error"]
    assert transport.stats["rejected"] == statuses.count("429")


def test_shared_subscription_splits_one_topic_across_daemons(start_transport, mqtt_client):
    common = dict(shared_group="workers", topic_prefix="fleet/line1")
    a = start_transport(device_id="a", **common)
    b = start_transport(device_id="b", **common)
    client = mqtt_client()
    n = 40
    payload = v2_json(signal_rows(1))
    for i in range(n):
        client.publish("fleet/line1/infer/vibration", payload, correlation=i.to_bytes(2, "big"))
    replies = client.collect_correlations({i.to_bytes(2, "big") for i in range(n)}, timeout=20)
    assert all(r[0].status == "200" for r in replies.values())
    served_a, served_b = a.stats["answered"], b.stats["answered"]
    assert served_a > 0 and served_b > 0, (served_a, served_b)
    assert served_a + served_b >= n


def test_reconnects_after_the_broker_restarts(served, start_transport, broker, mqtt_client):
    lt, _ = served
    transport = start_transport()
    broker.stop()
    wait_until(lambda: transport.state == "disconnected", 10, "the transport to notice the broker is gone")
    broker.start()  # same port; persistence off: the session is gone, the transport subscribes again
    assert lt.run(transport.wait_connected(15)), "no reconnect"
    client = mqtt_client()
    client.publish(INFER, v2_json(signal_rows(1), id="after-restart"), correlation=b"r")
    (reply,) = client.collect(1)
    assert reply.status == "200" and reply.json()["id"] == "after-restart"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
def test_tls_verifies_the_broker_certificate(served, tmp_path, start_transport, caplog):
    lt, _ = served
    certs = make_tls_files(tmp_path / "tls")
    tls_broker = Broker(tmp_path / "tls-broker", extra=[
        f"cafile {certs['ca.crt']}", f"certfile {certs['server.crt']}", f"keyfile {certs['server.key']}"]).start()
    try:
        # Verification is on by default: without our CA the handshake fails and nothing connects.
        untrusted = start_transport(wait=False, port=tls_broker.port, tls=True)
        assert not lt.run(untrusted.wait_connected(1.5))
        assert "CERTIFICATE_VERIFY_FAILED" in caplog.text
        trusted = start_transport(port=tls_broker.port, tls=True, ca_file=str(certs["ca.crt"]))
        assert trusted.state == "connected"
        client = TestClient(tls_broker.port, tls_ca=str(certs["ca.crt"]))
        try:
            client.publish(INFER, v2_json(signal_rows(1), id="tls"), correlation=b"t")
            (reply,) = client.collect(1)
            assert reply.status == "200" and reply.json()["id"] == "tls"
        finally:
            client.close()
    finally:
        tls_broker.stop()


# --------------------------------------------------------------------------- streams


def test_stream_mappings_substitute_wildcards_and_label_classes(served, start_transport, mqtt_client):
    start_transport(streams=[
        StreamMapping(topic="sensors/+/vibration", model="vibration", output_topic="results/{1}/vibration"),
        StreamMapping(topic="raw/+/+", model="vibration", encoding="raw", output_topic="rawres/{2}/{1}"),
        StreamMapping(topic="plain/#", model="vibration"),
    ])
    client = mqtt_client()
    for filt in ("results/#", "rawres/#", f"{PREFIX}/streams/#"):
        client.subscribe(filt)
    rows = signal_rows(2, seed=3)
    expected = direct(served, rows)
    labels = ["normal", "imbalance", "misalignment", "bearing_fault"]

    client.publish("sensors/pump7/vibration", json.dumps(rows[0].tolist()), response_topic=None)
    (r,) = client.collect(1)
    assert r.topic == "results/pump7/vibration" and r.status == "200"
    body = r.json()
    assert body["topic"] == "sensors/pump7/vibration"
    assert body["outputs"]["class_id"] == int(expected["class_id"][0])  # one row: no batch dimension
    assert body["labels"]["class_id"] == labels[int(expected["class_id"][0])]
    np.testing.assert_allclose(body["outputs"]["class_probs"], expected["class_probs"][0], rtol=1e-5, atol=1e-6)

    client.publish("sensors/fan2/vibration", json.dumps(rows.tolist()), response_topic=None)  # 2-D: two rows
    (r,) = client.collect(1)
    assert r.topic == "results/fan2/vibration"
    assert r.json()["outputs"]["class_id"] == expected["class_id"].tolist()

    client.publish("raw/siteA/motor3", rows.astype("<f4").tobytes(), response_topic=None)
    (r,) = client.collect(1)
    assert r.topic == "rawres/motor3/siteA" and r.status == "200"
    assert r.json()["outputs"]["class_id"] == expected["class_id"].tolist()

    client.publish("plain/a/b", json.dumps(rows[1].tolist()), response_topic=None)
    (r,) = client.collect(1)
    assert r.topic == f"{PREFIX}/streams/vibration/plain/a/b"
    assert r.json()["outputs"]["class_id"] == int(expected["class_id"][1])


def test_stream_errors_go_to_the_output_topic(start_transport, mqtt_client):
    start_transport(streams=[
        StreamMapping(topic="sensors/+/vibration", model="vibration", output_topic="results/{1}"),
        StreamMapping(topic="raw/+", model="vibration", encoding="raw", output_topic="rawres/{1}"),
    ])
    client = mqtt_client()
    client.subscribe("results/#")
    client.subscribe("rawres/#")
    cases = [
        ("sensors/s1/vibration", b"[1, 2, 3", "not JSON"),
        ("sensors/s2/vibration", json.dumps([0.0] * 100).encode(), "256"),
        ("sensors/s3/vibration", json.dumps(["a"] * 256).encode(), "expected numbers"),
        ("sensors/s4/vibration", b"", "empty payload"),
        ("raw/s5", b"\x00" * 1000, "not a whole number of rows"),
    ]
    for topic, payload, _ in cases:
        client.publish(topic, payload, response_topic=None)
    replies = {r.topic: r for r in client.collect(len(cases))}
    for topic, _, words in cases:
        out = f"results/{topic.split('/')[1]}" if topic.startswith("sensors") else "rawres/s5"
        reply = replies[out]
        assert reply.status == "400", reply.payload
        assert words in reply.json()["error"] and reply.json()["topic"] == topic
    client.publish("sensors/ok/vibration", json.dumps(signal_rows(1)[0].tolist()), response_topic=None)
    (r,) = client.collect(1)
    assert r.topic == "results/ok" and r.status == "200"


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("fields, words", [
    ({"qos": 3}, "[mqtt] qos: expected 0, 1 or 2, got 3"),
    ({"port": 70000}, "[mqtt] port"),
    ({"max_queued": 0}, "[mqtt] max_queued"),
    ({"max_pending": 0}, "[mqtt] max_pending"),
    ({"reconnect_min_s": 5.0, "reconnect_max_s": 1.0}, "[mqtt] reconnect_max_s"),
    ({"tls": True, "ca_file": "/nonexistent/ca.pem"}, "[mqtt] ca_file"),
    ({"username": "u", "password_file": "/nonexistent/pw"}, "[mqtt] password_file"),
    ({"shared_group": "a/b"}, "[mqtt] shared_group"),
    ({"topic_prefix": "x/+/y"}, "[mqtt] topic_prefix"),
    ({"streams": [StreamMapping(topic="s/+", model="vibration", encoding="xml")]}, "streams[0] encoding"),
    ({"streams": [StreamMapping(topic="s/+", model="vibration", output_topic="r/{2}")]}, "streams[0] output_topic"),
    ({"streams": [StreamMapping(topic="s/#", model="vibration", output_topic="s/out/{1}")]}, "fed back"),
    ({"streams": [StreamMapping(topic="s/a#", model="vibration")]}, "streams[0] topic"),
])
def test_invalid_settings_name_the_key(served, fields, words):
    _, runtime = served
    with pytest.raises(ConfigError) as exc:
        MqttTransport(MqttSettings(enabled=True, **fields), runtime, source="test.toml")
    assert words in str(exc.value)


@pytest.mark.parametrize("mapping, words", [
    (StreamMapping(topic="s/+", model="nosuch"), "streams[0] model: unknown model 'nosuch'"),
    (StreamMapping(topic="s/+", model="vibration", input="nosuch"), "streams[0] input"),
])
def test_stream_mapping_checked_against_the_loaded_models(served, broker, mapping, words):
    lt, runtime = served
    transport = MqttTransport(MqttSettings(enabled=True, host="127.0.0.1", port=broker.port, streams=[mapping]),
                              runtime)
    with pytest.raises(ConfigError) as exc:
        lt.run(transport.start())
    assert words in str(exc.value)


def test_bench_mqtt_measures_through_the_broker(start_transport, broker):
    from edge_batcher.bench.mqtt_load import bench_mqtt, format_mqtt_report

    start_transport()
    results = bench_mqtt(f"127.0.0.1:{broker.port}", topic_prefix=PREFIX, duration_s=0.5, warmup_s=0.2,
                         concurrency=8, binary=True)
    assert results["completed"] > 0 and results["status"] == {"200": results["completed"]}
    assert results["unanswered"] == 0
    assert 0 < results["latency_ms"]["p50"] <= results["latency_ms"]["p99"]
    assert "req/s" in format_mqtt_report(results)


# --------------------------------------------------------------------------- client identity


def test_the_default_client_id_is_stable_per_socket_and_differs_between_sockets(tmp_path):
    from edge_batcher.config import DaemonConfig
    from edge_batcher.transports.mqtt import default_client_id

    def config(socket: str) -> DaemonConfig:
        c = DaemonConfig()
        c.server.unix_socket = socket
        return c

    a = default_client_id("jetson1", config(str(tmp_path / "a.sock")))
    assert a == default_client_id("jetson1", config(str(tmp_path / "a.sock")))  # a restart finds its session
    assert a != default_client_id("jetson1", config(str(tmp_path / "b.sock")))  # a second daemon does not take it
    assert a.startswith("edge-batcher-jetson1-") and len(a) == len("edge-batcher-jetson1-") + 8


def test_two_clients_with_one_id_are_named_in_the_log(start_transport, caplog):
    caplog.set_level(logging.WARNING, logger="edge_batcher.transports.mqtt")
    first = start_transport(client_id="eb-twin")
    start_transport(client_id="eb-twin", wait=False)
    wait_until(lambda: "'eb-twin'" in caplog.text, 10, "a warning naming the shared client id")
    assert "same client id" in caplog.text or "session taken over" in caplog.text
    assert first.client_id == "eb-twin"
