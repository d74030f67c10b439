"""Replies that cannot be delivered (issue 31, rows 4 and 14), against a real mosquitto that drops
the connection of a client whose PUBLISH it refuses: with `max_queued_messages 0`, mosquitto 2.0
answers a refused QoS 1 publish (a `$SYS/...` or `$share/...` topic, or one its ACL denies) with
PUBACK 0x87 and then disconnects. A request whose Response Topic no broker takes is answered 400
on the result topic; one whose reply the broker refuses is acknowledged and dropped, counted and
logged once per topic per minute, never redelivered forever; the daemon keeps serving."""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from edge_batcher.config import StreamMapping
from tests.support.mqtt import INFER, PREFIX, Broker, TestClient, signal_rows, v2_json, wait_until

RESULT = f"{PREFIX}/result/vibration"
GOOD = 60


@pytest.fixture
def refusing_broker(tmp_path):
    """mosquitto that refuses publishes to forbidden/# (and, as always, $SYS/# and $share/#) and
    drops the connection of the client that tried."""
    acl = tmp_path / "acl"
    acl.write_text("topic deny forbidden/#\ntopic readwrite #\n")
    broker = Broker(tmp_path / "refusing", extra=["max_queued_messages 0", f"acl_file {acl}"]).start()
    yield broker
    broker.stop()


@pytest.fixture
def client_of(refusing_broker):
    clients: list[TestClient] = []

    def make() -> TestClient:
        client = TestClient(refusing_broker.port)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def publish_good(client: TestClient, n: int = GOOD) -> set[bytes]:
    payload = v2_json(signal_rows(1))
    for i in range(n):
        client.publish(INFER, payload, correlation=f"good-{i}".encode())
    return {f"good-{i}".encode() for i in range(n)}


def assert_all_200(replies: dict, wanted: set[bytes]) -> None:
    assert all(copy.status == "200" for c in wanted for copy in replies[c]), replies


def connections_lost(caplog) -> int:
    return sum("connection to" in r.getMessage() and "lost" in r.getMessage() for r in caplog.records)


def test_a_response_topic_no_broker_takes_is_answered_400_on_the_result_topic(
        refusing_broker, start_transport, client_of, caplog):
    caplog.set_level(logging.INFO, logger="edge_batcher.transports.mqtt")
    transport = start_transport(port=refusing_broker.port)
    client = client_of()
    client.subscribe(f"{PREFIX}/result/+")
    bad_topics = ["$SYS/x", "$share/g/x", "replies/+/x", "replies/#"]
    for i, topic in enumerate(bad_topics):
        client.publish(INFER, v2_json(signal_rows(1), id=f"bad-{i}"), correlation=f"bad-{i}".encode(),
                       response_topic=topic)
    wanted = publish_good(client)
    bad = {f"bad-{i}".encode() for i in range(len(bad_topics))}
    replies = client.collect_correlations(wanted | bad, timeout=60)
    assert_all_200(replies, wanted)
    for i, topic in enumerate(bad_topics):
        (reply,) = replies[f"bad-{i}".encode()]
        assert reply.topic == RESULT and reply.status == "400", reply
        assert f"Response Topic {topic!r}" in reply.json()["error"], reply.payload
    assert connections_lost(caplog) == 0  # nothing was published where the broker would refuse it
    assert transport.stats["undeliverable"] == 0 and transport.stats["errors"] == len(bad_topics)


def test_a_request_whose_reply_the_broker_refuses_is_acked_and_does_not_survive_a_restart(
        refusing_broker, start_transport, client_of, served, caplog):
    lt, _ = served
    caplog.set_level(logging.INFO, logger="edge_batcher.transports.mqtt")
    cid = "eb-poison-test"
    # A persistent session without the daemon: the broker queues the poison first, then good ones.
    lt.run(start_transport(port=refusing_broker.port, client_id=cid).stop())
    client = client_of()
    client.publish(INFER, v2_json(signal_rows(1), id="poison"), correlation=b"poison", response_topic="forbidden/x")
    wanted = publish_good(client)

    restarted = start_transport(port=refusing_broker.port, client_id=cid)
    replies = client.collect_correlations(wanted, timeout=60)
    assert_all_200(replies, wanted)
    wait_until(lambda: restarted.stats["undeliverable"] >= 1, 20, "the poison to be acked and dropped")
    assert connections_lost(caplog) <= 2, caplog.text  # before: one per reconnect, forever
    wait_until(lambda: restarted.stats["held"] == 0, 20, "every message answered")
    lt.run(restarted.stop())

    again = start_transport(port=refusing_broker.port, client_id=cid)
    client.publish(INFER, v2_json(signal_rows(1), id="marker"), correlation=b"marker")
    (reply,) = client.collect_correlations({b"marker"}, timeout=30)[b"marker"]
    assert reply.status == "200"
    # The broker sends what a session holds before anything new: the poison is no longer in it.
    assert again.stats["undeliverable"] == 0 and again.stats["requests"] >= 1, again.stats


def test_many_requests_to_a_refused_topic_cost_one_disconnect_and_one_log_line(
        refusing_broker, start_transport, client_of, served, caplog):
    caplog.set_level(logging.INFO, logger="edge_batcher.transports.mqtt")
    transport = start_transport(port=refusing_broker.port)
    client = client_of()
    n_poison = 30
    for i in range(n_poison):
        client.publish(INFER, v2_json(signal_rows(1), id=f"p{i}"), correlation=f"p{i}".encode(),
                       response_topic="forbidden/x")
    wanted = publish_good(client)
    replies = client.collect_correlations(wanted, timeout=60)
    assert_all_200(replies, wanted)
    wait_until(lambda: transport.stats["undeliverable"] >= n_poison, 30, "every poison acked and dropped")
    assert connections_lost(caplog) <= 2, caplog.text
    said = [r for r in caplog.records if "'forbidden/x'" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert "Not authorized" in said[0].getMessage() and "acknowledged and dropped" in said[0].getMessage()
    _, runtime = served
    assert runtime.metrics.mqtt_undeliverable_total.get(reason="broker_refused") >= 1


def test_a_stream_output_topic_no_broker_takes_is_dropped_and_logged_once(start_transport, mqtt_client, caplog):
    caplog.set_level(logging.INFO, logger="edge_batcher.transports.mqtt")
    # '+' matches a level starting with '$' when it is not the first: a/$x/v -> $x/out.
    transport = start_transport(streams=[StreamMapping(topic="a/+/v", model="vibration", output_topic="{1}/out")])
    client = mqtt_client()
    reading = str(signal_rows(1)[0].tolist())
    for _ in range(5):
        client.publish("a/$x/v", reading, response_topic=None)
    wait_until(lambda: transport.stats["undeliverable"] == 5, 30, "five readings dropped")
    said = [r for r in caplog.records if "'$x/out'" in r.getMessage()]
    assert len(said) == 1 and "starts with '$'" in said[0].getMessage()
    client.subscribe("ok/+")
    client.publish("a/ok/v", reading, response_topic=None)  # the stream still serves
    (reply,) = client.collect(1)
    assert reply.topic == "ok/out" and reply.status == "200"


def test_an_overloaded_qos0_request_with_a_wildcard_response_topic_logs_no_traceback(
        start_transport, mqtt_client, caplog):
    caplog.set_level(logging.INFO, logger="edge_batcher.transports.mqtt")
    transport = start_transport(max_pending=1)
    client = mqtt_client()
    client.subscribe(f"{PREFIX}/result/+")
    n = 60
    payload = v2_json(signal_rows(1))
    for i in range(n):
        client.publish(INFER, payload, correlation=i.to_bytes(2, "big"), qos=0, response_topic="replies/+")
    replies = client.collect_correlations({i.to_bytes(2, "big") for i in range(n)}, timeout=30)
    assert all(r[0].topic == RESULT and r[0].status == "400" for r in replies.values()), replies
    assert transport.stats["rejected"] > 0  # some met a full inbox: answered at the hand-off
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


class SilentlyRefusingProxy:
    """Between the daemon and mosquitto: forwards everything, but closes the connection, without a
    PUBACK or reason code, when the daemon publishes to a topic under `refused` (as some brokers'
    ACLs do). Real sockets both ways; it reads the MQTT framing of what the daemon sends."""

    def __init__(self, broker_port: int, refused: str = "forbidden/"):
        self.broker_port = broker_port
        self.refused = refused.encode()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed_for_refusal = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                daemon_side, _ = self.listener.accept()
            except OSError:
                return
            broker_side = socket.create_connection(("127.0.0.1", self.broker_port))
            threading.Thread(target=self._upstream, args=(daemon_side, broker_side), daemon=True).start()
            threading.Thread(target=self._downstream, args=(broker_side, daemon_side), daemon=True).start()

    def _upstream(self, src: socket.socket, dst: socket.socket) -> None:
        buffer = b""
        try:
            while data := src.recv(65536):
                buffer += data
                while (packet := _one_packet(buffer)) is not None:
                    buffer = buffer[len(packet):]
                    if self._refuses(packet):
                        self.closed_for_refusal += 1
                        return
                    dst.sendall(packet)
        except OSError:
            pass
        finally:
            _close(src, dst)

    def _downstream(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src, dst)

    def _refuses(self, packet: bytes) -> bool:
        if packet[0] >> 4 != 3:  # not a PUBLISH
            return False
        start = 1
        while packet[start] & 0x80:  # the remaining length's bytes
            start += 1
        start += 1
        length = int.from_bytes(packet[start:start + 2], "big")
        return packet[start + 2:start + 2 + length].startswith(self.refused)

    def close(self) -> None:
        self.listener.close()


def _one_packet(buffer: bytes) -> bytes | None:
    """The first whole MQTT packet in `buffer`, or None."""
    length, shift, pos = 0, 0, 1
    while True:
        if pos >= len(buffer):
            return None
        byte = buffer[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            break
        shift += 7
    end = pos + length
    return buffer[:end] if len(buffer) >= end else None


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


def test_a_reply_the_broker_silently_disconnects_for_is_given_up(broker, start_transport, mqtt_client, served, caplog):
    lt, _ = served
    caplog.set_level(logging.INFO, logger="edge_batcher.transports.mqtt")
    proxy = SilentlyRefusingProxy(broker.port)
    try:
        cid = "eb-silent-test"
        transport = start_transport(port=proxy.port, client_id=cid)
        client = mqtt_client()
        client.publish(INFER, v2_json(signal_rows(1), id="poison"), correlation=b"poison",
                       response_topic="forbidden/x")
        wanted = publish_good(client)
        replies = client.collect_correlations(wanted, timeout=60)
        assert_all_200(replies, wanted)
        wait_until(lambda: transport.stats["undeliverable"] >= 1, 30, "the poison given up")
        assert proxy.closed_for_refusal >= 1
        said = [r.getMessage() for r in caplog.records if "'forbidden/x'" in r.getMessage()]
        assert said and "closed the connection each of the last 2 times" in said[0], said
        assert connections_lost(caplog) <= 6, caplog.text  # one that shows it, two alone, and what PUBACKs lost
        wait_until(lambda: transport.stats["held"] == 0, 20, "every message answered")
        lt.run(transport.stop())

        again = start_transport(port=proxy.port, client_id=cid)
        client.publish(INFER, v2_json(signal_rows(1), id="marker"), correlation=b"marker")
        (reply,) = client.collect_correlations({b"marker"}, timeout=30)[b"marker"]
        assert reply.status == "200" and again.stats["undeliverable"] == 0, again.stats
    finally:
        proxy.close()
