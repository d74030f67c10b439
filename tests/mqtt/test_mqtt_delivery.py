"""At-least-once under load and faults, against a real mosquitto: QoS 1 requests beyond every
bound are served late, never answered 429 or lost; a full inbox, a full outgoing queue and a full
model queue hold requests back instead of dropping them; deadlines still answer 504. The last
tests run `edge-batcher serve` subprocesses through tools/mqtt_faults.py (bursts several times the
daemon's capacity, kill -9 with a 2 s restart, a broker restart)."""

from __future__ import annotations

import importlib.util
import json
import logging
import queue
import re
import shutil
import time
from collections import Counter

import pytest
from paho.mqtt.client import Client
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_batcher.config import DaemonConfig, MqttSettings
from edge_batcher.runtime import Runtime
from edge_batcher.transports.mqtt import MESSAGE_OVERHEAD_BYTES, MqttTransport
from edge_batcher.transports.mqtt.messages import Message
from tests.support.models import ROOT
from tests.support.mqtt import INFER, Broker, TestClient, signal_rows, v2_json, wait_until


def _load_faults_tool():
    spec = importlib.util.spec_from_file_location("mqtt_faults", ROOT / "tools" / "mqtt_faults.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def publish_burst(client, n: int, payload: bytes, qos: int = 1) -> set[bytes]:
    correlations = {i.to_bytes(4, "big") for i in range(n)}
    for i in range(n):
        client.publish(INFER, payload, correlation=i.to_bytes(4, "big"), qos=qos)
    return correlations


def statuses(replies: dict) -> Counter:
    return Counter(copy.status for copies in replies.values() for copy in copies)


# --------------------------------------------------------------------------- in-process transport


def test_a_qos1_burst_far_beyond_max_pending_is_served_not_rejected(start_transport, mqtt_client):
    transport = start_transport(max_pending=2)
    client = mqtt_client()
    wanted = publish_burst(client, 400, v2_json(signal_rows(1)))
    replies = client.collect_correlations(wanted, timeout=60)
    assert statuses(replies) == {"200": sum(len(c) for c in replies.values())}
    assert transport.stats["rejected"] == 0
    # Each message leaves the inbox once its reply was accepted and it was acked: all of them.
    wait_until(lambda: transport.stats["held"] == 0 and transport.stats["held_bytes"] == 0, 10, "an empty inbox")


def test_a_full_inbox_leaves_messages_unacked_and_reconnects_to_fetch_them(start_transport, mqtt_client, caplog):
    # An inbox of ~4 messages: mosquitto 2.0 sends the whole backlog after the first acks
    # (past the Receive Maximum of 2), so most of the burst cannot be held.
    caplog.set_level(logging.INFO, logger="edge_batcher.transports.mqtt")
    transport = start_transport(max_pending=2,
                                max_held_bytes=4 * (len(v2_json(signal_rows(1))) + MESSAGE_OVERHEAD_BYTES))
    client = mqtt_client()
    wanted = publish_burst(client, 300, v2_json(signal_rows(1)))
    replies = client.collect_correlations(wanted, timeout=90)
    stats = transport.stats
    if stats["deferred"] == 0:
        pytest.skip("this broker honoured Receive Maximum: nothing arrived beyond the inbox")
    assert set(statuses(replies)) == {"200"}
    assert stats["refetches"] >= 1, stats
    assert stats["rejected"] == 0
    assert "reconnecting to receive the messages left unacknowledged" in caplog.text


def test_without_a_persistent_session_a_full_inbox_answers_429_instead_of_losing_requests(
        start_transport, mqtt_client):
    """session_expiry_s = 0 (issue 31, row 6): a message left unacked would not come back, since the
    session ends with the connection; so what the inbox cannot hold is answered 429, and acked."""
    payload = v2_json(signal_rows(1))
    transport = start_transport(session_expiry_s=0, max_pending=2,
                                max_held_bytes=4 * (len(payload) + MESSAGE_OVERHEAD_BYTES))
    client = mqtt_client()
    replies = client.collect_correlations(publish_burst(client, 300, payload), timeout=90)
    counts = statuses(replies)
    if transport.stats["rejected"] == 0:
        pytest.skip("this broker honoured Receive Maximum: nothing arrived beyond the inbox")
    assert set(counts) == {"200", "429"}, counts
    assert counts["429"] == transport.stats["rejected"]
    assert transport.stats["deferred"] == 0 and transport.stats["refetches"] == 0
    overloaded = next(c[0] for c in replies.values() if c[0].status == "429")
    assert "session_expiry_s = 0" in overloaded.json()["error"]


def test_without_a_persistent_session_a_stopping_daemon_answers_503(served, start_transport, mqtt_client):
    """session_expiry_s = 0: what reaches a daemon that drains is answered 503, not left unacked for
    a session that ends with its connection."""
    lt, _ = served
    transport = start_transport(session_expiry_s=0)
    client = mqtt_client()
    lt.loop.call_soon_threadsafe(transport.pause)  # what the daemon does when it starts draining
    wait_until(lambda: transport._stopping, 5, "the transport to pause")
    replies = client.collect_correlations(publish_burst(client, 15, v2_json(signal_rows(1))), timeout=20)
    assert statuses(replies) == {"503": 15}
    assert "stopping" in next(iter(replies.values()))[0].json()["error"]


def test_what_the_inbox_holds_outlives_a_broker_crash_that_restored_an_older_save(served, tmp_path, start_transport):
    """mosquitto kill -9 restores its last save (issue 31, row 10): the messages the daemon held
    were not in it, so the broker never sends them again. The daemon used to drop what waited in
    its inbox when the session was resumed, for copies that never came (1,987 of 10,000 requests
    lost at a kill -9 with autosave_interval 1); it answers them from the inbox now."""
    lt, _ = served
    broker = Broker(tmp_path / "persistent", persistence=True, extra=["autosave_interval 3600"]).start()
    replies: queue.Queue[bytes] = queue.Queue()
    collector = Client(CallbackAPIVersion.VERSION2, client_id="crash-collector", protocol=MQTTProtocolVersion.MQTTv5)
    collector.reconnect_delay_set(0.1, 0.5)
    collector.on_message = lambda c, u, msg: replies.put(msg.properties.CorrelationData)
    connect = Properties(PacketTypes.CONNECT)
    connect.SessionExpiryInterval = 600  # saved with the broker: replies wait for it through the crash
    publisher = None
    try:
        lt.run(start_transport(port=broker.port, max_pending=2, client_id="eb-crash-test").stop())
        collector.connect("127.0.0.1", broker.port, clean_start=False, properties=connect)
        collector.loop_start()
        collector.subscribe("test/crash/replies", qos=1)
        wait_until(lambda: collector.is_connected(), 10, "the collector")
        time.sleep(0.5)  # the SUBACK: the subscription must be in the save below
        broker.stop()  # SIGTERM: mosquitto saves both sessions, and no request yet
        broker.start()
        wait_until(lambda: collector.is_connected(), 20, "the collector back")
        publisher = TestClient(broker.port)
        for i in range(1000):  # queued for the daemon, which is away
            publisher.publish(INFER, v2_json(signal_rows(1)), correlation=i.to_bytes(4, "big"),
                              response_topic="test/crash/replies")
        # mosquitto sends a backlog past the Receive Maximum (max_pending) after the first ack.
        transport = start_transport(port=broker.port, max_pending=2, client_id="eb-crash-test")
        wait_until(lambda: transport.stats["held"] >= 200, 30, "messages waiting in the inbox")
        broker.proc.kill()  # a crash: what came after the save is gone from the broker
        broker.proc.wait()
        held = {h.msg.correlation_data for h in list(transport._inbox.waiting)}  # answered only after the crash
        broker.start()
        got: set[bytes] = set()
        deadline = time.monotonic() + 60
        while not held <= got and time.monotonic() < deadline:
            try:
                got.add(replies.get(timeout=1))
            except queue.Empty:
                pass
        assert len(held) >= 100, len(held)
        assert held <= got, f"{len(held - got)} of the {len(held)} messages held at the crash got no reply"
    finally:
        collector.loop_stop()
        if publisher is not None:
            publisher.close()
        broker.stop()


def test_replies_that_paho_cannot_queue_are_retried(start_transport, mqtt_client):
    transport = start_transport(max_pending=16, max_queued=1, max_inflight=1)
    client = mqtt_client()
    wanted = publish_burst(client, 200, v2_json(signal_rows(1)))
    replies = client.collect_correlations(wanted, timeout=60)
    assert set(statuses(replies)) == {"200"}
    assert transport.stats["unacked"] == 0


def test_a_message_that_expires_while_it_waits_gets_504(served, start_transport, mqtt_client):
    """The Message Expiry Interval counts from the message's arrival at the daemon. paho hands
    messages over on the event loop, so a busy loop is simulated at that hand-over: two messages
    arrive (as paho's reader delivers them), then the loop is busy for 1.5 s before taking them."""
    lt, _ = served
    transport = start_transport()
    client = mqtt_client()
    connection = transport._client.connection

    def arrive_then_busy() -> None:
        for correlation, expiry in ((b"short", 1), (b"long", 60)):
            transport._on_message(Message(topic=INFER, payload=v2_json(signal_rows(1)), qos=0, mid=0, dup=False,
                                          connection=connection, response_topic=client.response_topic,
                                          correlation_data=correlation, expiry_s=expiry))
        time.sleep(1.5)  # the daemon is busy: the messages wait to be taken

    lt.loop.call_soon_threadsafe(arrive_then_busy)
    replies = client.collect_correlations({b"short", b"long"}, timeout=20)
    assert replies[b"long"][0].status == "200"
    assert replies[b"short"][0].status == "504"
    assert "message expiry interval of 1 s" in replies[b"short"][0].json()["error"]
    assert transport.stats["expired"] == 1


def test_a_full_model_queue_holds_qos1_back_and_answers_qos0_429(served, mqtt_model_repo, tmp_path, broker,
                                                                mqtt_client):
    lt, _ = served
    repo = tmp_path / "repo"
    shutil.copytree(mqtt_model_repo / "vibration", repo / "vibration")
    toml = repo / "vibration" / "model.toml"
    text, count = re.subn(r"(?m)^queue_capacity = \d+$", "queue_capacity = 2", toml.read_text())
    assert count == 1
    toml.write_text(text)
    config = DaemonConfig()
    config.models.repository = str(repo)
    config.memory.probe = "fixed"
    config.memory.budget_mb = 4096
    runtime = Runtime(config)
    lt.run(runtime.start(), timeout=120)
    settings = MqttSettings(enabled=True, host="127.0.0.1", port=broker.port, client_id="eb-small-queue",
                            device_id="testdev", reconnect_min_s=0.1, reconnect_max_s=0.5, max_pending=64)
    transport = MqttTransport(settings, runtime, source="test")
    try:
        lt.run(transport.start())
        assert lt.run(transport.wait_connected(10))
        client = mqtt_client()
        payload = v2_json(signal_rows(1))
        replies = client.collect_correlations(publish_burst(client, 300, payload), timeout=60)
        assert set(statuses(replies)) == {"200"}
        assert transport.stats["overload_waits"] > 0  # the model's queue was full and they waited
        replies = client.collect_correlations(publish_burst(client, 300, payload, qos=0), timeout=60)
        counts = statuses(replies)
        assert set(counts) <= {"200", "429"} and counts["429"] > 0, counts
        # Waiting for room counts against the request's own timeout: past it, 504.
        body = json.loads(payload)
        body["parameters"] = {"timeout_ms": 15}
        replies = client.collect_correlations(publish_burst(client, 300, json.dumps(body).encode()), timeout=60)
        counts = statuses(replies)
        assert set(counts) <= {"200", "504"} and counts["504"] > 0, counts
    finally:
        lt.run(transport.stop(timeout=2))
        lt.run(runtime.close())


# --------------------------------------------------------------------------- daemon subprocesses


@pytest.fixture(scope="module")
def faults():
    return _load_faults_tool()


@pytest.mark.parametrize("fault", ["none", "kill9", "broker"])
def test_a_burst_at_several_times_capacity_loses_nothing(faults, mqtt_model_repo, tmp_path, fault):
    """3000 requests at 6000/s (the daemon answers ~1000-2500/s here); with a fault a third of the
    way in: the daemon SIGKILLed and restarted 2 s later, or the broker restarted."""
    result = faults.run(requests=3000, rate=6000, fault=fault, restart_after_s=2.0, timeout_s=120,
                        models=mqtt_model_repo, workdir=tmp_path)
    print(faults.format_report(result))
    assert result["unanswered"] == 0, faults.format_report(result)
    assert set(result["statuses"]) == {"200"}, result["statuses"]
    assert not result["broker_dropped"]
    assert result["peak_rss_mb"] < 400, result  # the inbox holds at most max_held_bytes (32 MiB)
