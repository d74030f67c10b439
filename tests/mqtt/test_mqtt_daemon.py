"""The daemon with MQTT enabled, as a real `edge-batcher serve` subprocess: readiness, crash
recovery with a persistent session (SIGKILL mid-burst), graceful drain (SIGTERM mid-burst)."""

from __future__ import annotations

import json
import signal
import threading
import time

import numpy as np

from tests.support.mqtt import Broker, TestClient, wait_mqtt, wait_until

N_BURST = 200


def config_text(repo, port: int, **mqtt) -> str:
    fields = {"enabled": True, "host": "127.0.0.1", "port": port, "client_id": "eb-daemon-test",
              "device_id": "dut", "reconnect_min_s": 0.1, "reconnect_max_s": 1.0, "keepalive_s": 5, **mqtt}
    lines = ["[server]", "drain_timeout_s = 10", "[models]", f'repository = "{repo}"',
             "[memory]", 'probe = "fixed"', "budget_mb = 4096", "[mqtt]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    return "\n".join(lines) + "\n"


def request_payload(i: int) -> bytes:
    rng = np.random.default_rng(i)
    data = (0.5 * rng.standard_normal(256)).astype(np.float32).tolist()
    return json.dumps({"id": f"req-{i}", "inputs": [{"name": "signal", "shape": [1, 256], "datatype": "FP32",
                                                     "data": data}]}).encode()


def publish_burst(client, n: int, spacing_s: float) -> threading.Thread:
    """Publish n QoS 1 requests from a thread, `spacing_s` apart, so the daemon is hit mid-burst."""
    payloads = [request_payload(i) for i in range(n)]

    def run():
        for i, payload in enumerate(payloads):
            client.publish("edge-batcher/dut/infer/vibration", payload, correlation=i.to_bytes(2, "big"))
            time.sleep(spacing_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def check_all_answered(client, n: int, timeout: float) -> dict:
    replies = client.collect_correlations({i.to_bytes(2, "big") for i in range(n)}, timeout=timeout)
    for corr, copies in replies.items():
        i = int.from_bytes(corr, "big")
        for reply in copies:  # duplicates are allowed; each must be a full answer to *this* request
            assert reply.status == "200", reply.payload
            assert reply.json()["id"] == f"req-{i}"
    return replies


def test_ready_reports_mqtt_state_and_the_socket_serves_while_the_broker_is_away(
        mqtt_model_repo, tmp_path, daemon_process):
    broker = Broker(tmp_path / "broker")  # not started yet: the daemon starts without it
    d = daemon_process("d", config_text(mqtt_model_repo, broker.port)).start()
    body = wait_mqtt(d, "disconnected")
    assert body["ready"] is True and body["models"] == ["vibration"]  # ready: the Unix socket serves
    # "disconnected" is also the state before the first attempt ends: its failure is logged after.
    wait_until(lambda: "not reachable" in d.log_text(), 10, "the failed connection attempt in the log")
    broker.start()
    client = None
    try:
        wait_mqtt(d, "connected", timeout=20)
        client = TestClient(broker.port)
        client.publish("edge-batcher/dut/infer/vibration", request_payload(7), correlation=b"late")
        (reply,) = client.collect(1)
        assert reply.status == "200" and reply.json()["id"] == "req-7"
    finally:
        if client is not None:
            client.close()
        broker.stop()
    wait_mqtt(d, "disconnected", timeout=20)


def test_sigkill_mid_burst_loses_no_request(mqtt_model_repo, broker, daemon_process, mqtt_client):
    cfg = config_text(mqtt_model_repo, broker.port)
    first = daemon_process("first", cfg).start()
    wait_mqtt(first, "connected")
    client = mqtt_client()
    publisher = publish_burst(client, N_BURST, spacing_s=0.004)
    wait_until(lambda: client.messages.qsize() >= 25, 20, "the first replies")
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    answered_before = client.messages.qsize()
    assert answered_before < N_BURST, "the burst finished before the kill: nothing was tested"

    second = daemon_process("second", cfg).start()  # same client id: resumes the broker's session
    replies = check_all_answered(client, N_BURST, timeout=40)
    publisher.join(10)
    assert "resumed session" in second.log_text()
    duplicates = sum(len(c) - 1 for c in replies.values())
    print(f"answered before the kill: {answered_before}; duplicates: {duplicates}")


def test_sigterm_drains_in_flight_and_leaves_the_rest_for_the_next_daemon(
        mqtt_model_repo, broker, daemon_process, mqtt_client):
    cfg = config_text(mqtt_model_repo, broker.port, client_id="eb-drain-test")
    first = daemon_process("first", cfg).start()
    wait_mqtt(first, "connected")
    client = mqtt_client()
    publisher = publish_burst(client, N_BURST, spacing_s=0.004)
    wait_until(lambda: client.messages.qsize() >= 25, 20, "the first replies")
    assert first.stop(signal.SIGTERM) == 0  # graceful: exit status 0
    assert client.messages.qsize() < N_BURST, "the burst finished before SIGTERM: nothing was tested"
    assert "MQTT: stopped" in first.log_text()

    daemon_process("second", cfg).start()
    check_all_answered(client, N_BURST, timeout=40)
    publisher.join(10)


def test_ready_says_disabled_without_mqtt(mqtt_model_repo, daemon_process):
    cfg = f'[models]\nrepository = "{mqtt_model_repo}"\n[memory]\nprobe = "fixed"\nbudget_mb = 4096\n'
    d = daemon_process("plain", cfg).start()
    body = wait_mqtt(d, "disabled")
    assert body["ready"] is True


def test_two_daemons_with_default_client_ids_share_a_broker(mqtt_model_repo, broker, daemon_process):
    """The service and a bench on one host: each default id is derived from its socket path."""
    cfg = config_text(mqtt_model_repo, broker.port).replace('client_id = "eb-daemon-test"\n', "")
    assert "client_id" not in cfg
    a = daemon_process("a", cfg).start()
    b = daemon_process("b", cfg).start()
    wait_mqtt(a, "connected")
    wait_mqtt(b, "connected")
    time.sleep(2)  # with one shared id they would evict each other about once a second
    for d in (a, b):
        assert wait_mqtt(d, "connected")["mqtt"] == "connected"
        assert "lost" not in d.log_text(), d.log_text()
    ids = [d.log_text().split(" as ", 1)[1].split(" ", 1)[0] for d in (a, b)]
    assert ids[0] != ids[1] and all(i.startswith("edge-batcher-dut-") for i in ids), ids
