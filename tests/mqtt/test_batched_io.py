"""The lean packet path under paho (batched_io.BatchedClient, messages.decode_publish): it must
read what paho reads, refuse what breaks the framing, and cut the syscalls per packet, against
the installed paho and a real mosquitto."""

from __future__ import annotations

import asyncio
import socket
import uuid

import pytest
from paho.mqtt import _packet
from paho.mqtt.client import Client, MQTTMessage, MQTTMessageInfo
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_batcher.config import MqttSettings
from edge_batcher.transports.mqtt.batched_io import COALESCE_MAX, READ_PER_EVENT, BatchedClient
from edge_batcher.transports.mqtt.messages import Message, Reply, decode_publish, message_from_paho
from edge_batcher.transports.mqtt.paho_client import PahoClient
from tests.support.mqtt import LoopThread, wait_until


def publish_packet(topic: str, payload: bytes, qos: int, mid: int, **props) -> tuple[int, bytearray]:
    """(command byte, the rest) of a PUBLISH, its properties packed by paho's own Properties."""
    properties = Properties(PacketTypes.PUBLISH)
    for name, value in props.items():
        setattr(properties, name, value)
    raw_topic = topic.encode()
    body = len(raw_topic).to_bytes(2, "big") + raw_topic
    if qos:
        body += mid.to_bytes(2, "big")
    return 0x30 | (qos << 1), bytearray(body + properties.pack() + payload)


def paho_reads(command: int, packet: bytearray, connection: int) -> Message:
    """What paho's own decoder makes of the packet, as the transport's Message."""
    decoded = _packet.decode_publish(command, packet, MQTTProtocolVersion.MQTTv5)
    msg = MQTTMessage(mid=decoded.mid, topic=decoded.topic)
    msg.qos, msg.dup, msg.properties, msg.payload = decoded.qos, decoded.dup, decoded.properties, decoded.payload
    return message_from_paho(msg, connection)


PACKETS = {
    "qos 1, request properties": publish_packet(
        "edge/dev/infer/vibration", b'{"inputs": []}', 1, 7, ResponseTopic="r/abc", CorrelationData=b"\x00\x01c",
        ContentType="application/json"),
    "qos 0, no properties": publish_packet("a/b", b"x", 0, 0),
    "user properties kept in order, expiry": publish_packet(
        "s/ünï/cödé", b"\x00" * 10, 1, 65535, UserProperty=[("b", "2"), ("a", "1"), ("b", "3")],
        MessageExpiryInterval=3600),
    "lengths over 127 (two-byte variable integers)": publish_packet(
        "t/" + "x" * 300, b"p" * 70_000, 1, 1, CorrelationData=b"c" * 200, UserProperty=[("k" * 150, "v" * 150)]),
    "properties the Message does not keep": publish_packet(
        "t", b"{}", 1, 2, PayloadFormatIndicator=1, SubscriptionIdentifier=[300], ContentType="text/plain"),
    "empty payload and topic": publish_packet("", b"", 1, 9, ResponseTopic="r"),
}


@pytest.mark.parametrize("case", PACKETS)
@pytest.mark.parametrize("dup", [False, True])
def test_the_lean_decoder_reads_what_paho_reads(case, dup):
    command, packet = PACKETS[case]
    if dup:
        command |= 0x08
    ours = decode_publish(command, packet, connection=3)
    assert ours == paho_reads(command, packet, connection=3)
    assert type(ours.payload) is bytes


def _truncated_properties() -> bytearray:
    _, packet = publish_packet("t", b"", 1, 1, ResponseTopic="reply/topic")
    return packet[:-4]


MALFORMED = {
    "topic length past the end": bytearray(b"\x00\x09abc"),
    "no packet identifier": bytearray(b"\x00\x01t\x00"),
    "property length past the end": bytearray(b"\x00\x01t\x00\x01\x20\x08"),
    "a string past its properties": _truncated_properties(),
    "a property that is not a PUBLISH's": bytearray(b"\x00\x01t\x00\x01\x02\x11\x00"),
    "topic not UTF-8": bytearray(b"\x00\x02\xc3\x28\x00\x01\x00"),
    "U+0000 in a string": bytearray(b"\x00\x01t\x00\x01\x05\x03\x00\x02a\x00"),
    "a property twice": bytearray(b"\x00\x01t\x00\x01\x08\x03\x00\x01a\x03\x00\x01b"),
    "variable integer of five bytes": bytearray(b"\x00\x01t\x00\x01\xff\xff\xff\xff\x01"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_broken_publish_is_malformed(case):
    with pytest.raises(MalformedPacket):
        decode_publish(0x32, MALFORMED[case], connection=1)


def test_qos_3_is_malformed():
    command, packet = PACKETS["qos 1, request properties"]
    with pytest.raises(MalformedPacket, match="QoS 3"):
        decode_publish(command | 0x06, packet, connection=1)


@pytest.fixture
def counted_syscalls(monkeypatch):
    """How often paho's socket primitives (one recv or send each) ran for a BatchedClient (not
    for the test's own paho clients)."""
    counts = {"recv": 0, "send": 0}
    recv, send = Client._sock_recv, Client._sock_send

    def counting_recv(self, bufsize):
        counts["recv"] += isinstance(self, BatchedClient)
        return recv(self, bufsize)

    def counting_send(self, buf):
        counts["send"] += isinstance(self, BatchedClient)
        return send(self, buf)

    monkeypatch.setattr(Client, "_sock_recv", counting_recv)
    monkeypatch.setattr(Client, "_sock_send", counting_send)
    return counts


@pytest.fixture
def paho_client(broker):
    """(loop thread, a connected PahoClient subscribed to batched/in/+, the Messages it received)."""
    lt = LoopThread()
    received: list[Message] = []
    settings = MqttSettings(enabled=True, host="127.0.0.1", port=broker.port, reconnect_min_s=0.1,
                            reconnect_max_s=0.5, keepalive_s=5)
    client = PahoClient(settings, client_id=f"batched-{uuid.uuid4().hex[:8]}", password=None, where="[mqtt]",
                        subscriptions=["batched/in/+"], on_message=received.append,
                        on_session_resumed=lambda: None)
    lt.run(client.connect())
    assert lt.run(client.wait_connected(10))
    yield lt, client, received
    lt.run(client.close())
    lt.close()


def answer(lt: LoopThread, client: PahoClient, received: list[Message], body) -> list[bool]:
    """Publish body(message) as each message's reply and ack it, all in one loop turn; whether
    each reply was accepted by the broker."""

    async def answer_all() -> list[bool]:
        replies = [client.publish(Reply(m.response_topic, body(m), 200, "text/plain", m.correlation_data))
                   for m in received]
        for m in received:
            client.ack(m)
        return await asyncio.gather(*replies)

    return lt.run(answer_all())


def test_a_burst_is_read_and_answered_with_few_syscalls(paho_client, mqtt_client, counted_syscalls):
    """200 requests published at once arrive intact, and 200 replies and acks go back. paho alone
    makes >= 4 recv calls per PUBLISH and one send per packet (400 here); batched, the acks and the
    first max_inflight replies leave together, and each later reply at worst with the PUBACK read
    that releases it (measured: ~33 recv and ~11 send calls)."""
    lt, client, received = paho_client
    n = 200
    sender = mqtt_client()
    counted_syscalls.update(recv=0, send=0)
    for i in range(n):
        sender.publish(f"batched/in/{i % 3}", f"request {i}".encode(), correlation=str(i).encode(),
                       content_type="text/plain", user_properties=[("seq", str(i))])
    wait_until(lambda: len(received) == n, 10, f"{n} requests delivered")
    assert counted_syscalls["recv"] < 2 * n, counted_syscalls  # at worst one per PUBLISH
    for msg in received:
        i = int(msg.correlation_data)
        assert (msg.topic, msg.payload, msg.qos) == (f"batched/in/{i % 3}", f"request {i}".encode(), 1)
        assert (msg.content_type, msg.user_properties, msg.response_topic) == (
            "text/plain", (("seq", str(i)),), sender.response_topic)

    counted_syscalls.update(send=0)
    # Every reply's PUBACK came back (the lean PUBACK path).
    assert answer(lt, client, received, lambda m: b"reply " + m.correlation_data) == [True] * n
    replies = sender.collect(n)
    assert sorted(r.payload for r in replies) == sorted(b"reply " + m.correlation_data for m in received)
    assert all(r.status == "200" for r in replies)
    assert counted_syscalls["send"] < n, counted_syscalls
    # No subscriber: mosquitto's PUBACK carries reason 0x10, which paho's own decoder reads.
    assert lt.run(client.publish(Reply("batched/nobody-listens", b"x", 200, "text/plain")))


def test_messages_larger_than_a_read_and_a_joined_write_arrive_whole(paho_client, mqtt_client):
    """A 1 MiB request among small ones spans several reads of RECV_CHUNK; a 300 KiB reply among
    small ones is written on its own (JOIN_MAX): all arrive intact and in order."""
    lt, client, received = paho_client
    sender = mqtt_client()
    sizes = [10, 1024 * 1024 + 3, 10, 20, 300 * 1024, 10]
    payloads = [bytes([i]) * size for i, size in enumerate(sizes)]
    for i, payload in enumerate(payloads):
        sender.publish("batched/in/big", payload, correlation=str(i).encode())
    wait_until(lambda: len(received) == len(sizes), 10, "the requests delivered")
    assert [m.payload for m in received] == payloads
    assert answer(lt, client, received, lambda m: m.payload[::-1]) == [True] * len(sizes)
    replies = sender.collect(len(sizes))
    assert [r.payload for r in replies] == [p[::-1] for p in payloads]


def test_a_large_message_is_read_over_several_loop_turns(paho_client, mqtt_client, monkeypatch):
    """A 5 MiB request is read at most READ_PER_EVENT bytes per readable event, so other
    connections are served between its reads (before, one event could read 100 recv calls' worth:
    a 16 MiB message held the loop for ~70 ms), and it arrives whole."""
    lt, client, received = paho_client
    taken: list[int] = []
    recv = BatchedClient._sock_recv
    read = BatchedClient.loop_read

    def counting_recv(self, bufsize):
        data = recv(self, bufsize)
        taken[-1] += len(data)
        return data

    def counting_read(self, max_packets=1):
        taken.append(0)
        return read(self, max_packets)

    monkeypatch.setattr(BatchedClient, "_sock_recv", counting_recv)
    monkeypatch.setattr(BatchedClient, "loop_read", counting_read)
    payload = bytes(range(256)) * (5 * 4096)
    mqtt_client().publish("batched/in/big", payload, correlation=b"big")
    wait_until(lambda: len(received) == 1, 20, "the request delivered")
    assert received[0].payload == payload
    # bytes handed to paho per event: what came from the socket, at most READ_PER_EVENT (plus what
    # an earlier event read ahead, at most one recv's worth)
    assert len([n for n in taken if n]) >= 5 and max(taken) <= READ_PER_EVENT + 256 * 1024, taken


class LosesItsNewConnection(PahoClient):
    """A PahoClient whose next successful reconnection is lost before the retry that made it hears
    of its success: the race seen on 2026-11-27 (the broker dropped a resumed session while the
    worker thread's result was still on its way to the loop), made certain."""

    arm = False

    async def _connect_now(self) -> bool:
        connected = await super()._connect_now()
        if connected and self.arm:
            self.arm = False
            self._client.socket().shutdown(socket.SHUT_RDWR)
            while self._client.socket() is not None:  # paho reads the end, on_disconnect runs
                await asyncio.sleep(0.01)
        return connected


@pytest.mark.parametrize("first", ["lost", "reconnect"])
def test_a_connection_lost_before_its_retry_hears_of_it_is_retried(broker, first):
    """The lost connection's on_disconnect finds the attempt still running (the retry after a
    loss, or reconnect() fetching deferred messages) and leaves the next attempt to it; the
    attempt must then see that its connection is gone, not stop (before: the daemon stayed
    disconnected for good, 60 s of unanswered requests in a test run)."""
    lt = LoopThread()
    settings = MqttSettings(enabled=True, host="127.0.0.1", port=broker.port, reconnect_min_s=0.1,
                            reconnect_max_s=0.5, keepalive_s=5)
    client = LosesItsNewConnection(settings, client_id=f"race-{uuid.uuid4().hex[:8]}", password=None,
                                   where="[mqtt]", subscriptions=["race/in/+"], on_message=lambda m: None,
                                   on_session_resumed=lambda: None)
    try:
        lt.run(client.connect())
        assert lt.run(client.wait_connected(10))
        client.arm = True

        async def drop() -> None:
            client._client.socket().shutdown(socket.SHUT_RDWR)  # the first loss starts the retry task

        lt.run(drop() if first == "lost" else client.reconnect())
        wait_until(lambda: not client.arm, 10, "the retry's connection made and lost")
        wait_until(lambda: client.state == "connected", 10, "connected again after the second loss")
        assert lt.run(client.wait_connected(5))
    finally:
        lt.run(client.close())
        lt.close()


def test_coalescing_keeps_apart_the_packets_paho_acts_on_once_written():
    """A QoS 0 PUBLISH (paho then calls on_publish) and a DISCONNECT (paho then closes the socket)
    keep their own entries; the rest is joined, a partly written packet from where it stopped."""
    client = BatchedClient(CallbackAPIVersion.VERSION2, protocol=MQTTProtocolVersion.MQTTv5)
    qos0 = MQTTMessageInfo(3)
    for command, qos, data, info in [(0x40, 0, b"ack1", None), (0x32, 1, b"pub1", None), (0x30, 0, b"pub0", qos0),
                                     (0x40, 0, b"ack2", None), (0x40, 0, b"ack3", None), (0xE0, 0, b"bye", None)]:
        client._packet_queue(command, data, 1, qos, info)
    client._out_packet[0]["pos"] = 2  # "ac" already written
    client.coalesce()
    assert [bytes(p["packet"][p["pos"]:]) for p in client._out_packet] == [b"k1pub1", b"pub0", b"ack2ack3", b"bye"]
    assert client._out_packet[1]["info"] is qos0 and client._out_packet[3]["command"] == 0xE0


def test_coalescing_looks_only_at_the_head_of_a_long_queue():
    """Behind a socket that takes little, the queue grows: each write joins its first
    COALESCE_MAX bytes and leaves the rest as paho queued it, so no turn copies the backlog."""
    client = BatchedClient(CallbackAPIVersion.VERSION2, protocol=MQTTProtocolVersion.MQTTv5)
    for i in range(1000):
        client._packet_queue(0x40, bytes([i % 256]) * 1024, i, 0, None)
    tail = list(client._out_packet)[300:]
    expected = b"".join(bytes(p["packet"]) for p in client._out_packet)
    client.coalesce()
    head = client._out_packet[0]
    assert COALESCE_MAX <= head["to_process"] <= COALESCE_MAX + 1024
    assert all(a is b for a, b in zip(list(client._out_packet)[-700:], tail[-700:]))
    assert b"".join(bytes(p["packet"]) for p in client._out_packet) == expected
