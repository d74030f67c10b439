"""A paho Client with a lean path for the packets of every request (issue 20). It reads its
socket in batches: one recv per readable event instead of paho's byte-at-a-time reads (a fixed
header is read one byte per call, so a PUBLISH and its PUBACK cost 7 recv calls). It writes the
packets queued in one loop turn with one send instead of one each; the syscalls were ~17% of
the MQTT path's event-loop CPU. And it hands a request's PUBLISH to the transport undecoded
(messages.decode_publish, ~4 us against paho's ~40 us), and reads a plain two-byte PUBACK
without paho's Properties (~11 us). paho's framing, its MQTT state and every other packet are
its own; `drop_queued` takes replies the broker refuses out of paho's queue, and
`set_in_flight_window` resends one at a time after a suspicious connection loss (issue 31). It
relies on paho 2.x internals (`_sock_recv`, `_handle_publish`, `_handle_pubackcomp`,
`_out_packet`'s entries, `_out_messages`), which pyproject bounds to paho-mqtt < 3 and
tests/mqtt/test_batched_io.py checks against the installed paho.
"""

from __future__ import annotations

import ssl
from collections import deque
from collections.abc import Callable
from typing import Any

from paho.mqtt.client import (
    DISCONNECT,
    MQTT_LOG_ERR,
    PUBLISH,
    Client,
    MQTTErrorCode,
    mqtt_ms_publish,
    mqtt_ms_queued,
    mqtt_ms_resend_pubrel,
    mqtt_ms_wait_for_puback,
    mqtt_ms_wait_for_pubcomp,
    mqtt_ms_wait_for_pubrec,
)
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

RECV_CHUNK = 256 * 1024  # what one recv takes from the socket at most
# What one readable event reads at most: a 16 MiB message is read over several loop turns (~5 ms
# each on the 2-core VM), not in one that holds every other connection for tens of milliseconds.
READ_PER_EVENT = 1024 * 1024
JOIN_MAX = 64 * 1024  # a larger packet is written on its own: copying it would cost more than a send
COALESCE_MAX = 256 * 1024  # how much of the queue one write's joining looks at
SENT_STATES = (mqtt_ms_wait_for_puback, mqtt_ms_wait_for_pubrec, mqtt_ms_wait_for_pubcomp)  # counted in flight
# What a two-byte PUBACK means (MQTT 5 3.4.2.1: no reason code is Success, no properties), shared
# by every on_publish call for one; on_publish callbacks only read them.
PUBACK_SUCCESS = ReasonCode(PacketTypes.PUBACK)
NO_PROPERTIES = Properties(PacketTypes.PUBACK)


class BatchedClient(Client):
    """paho's Client, reading ahead into a buffer that loop_read() parses to its end, and joining
    queued packets before each write (`coalesce()`)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._read_ahead = memoryview(b"")
        self._read_left = READ_PER_EVENT  # of this readable event's share of the socket
        # MQTT 5 with manual acks: an incoming QoS 0/1 PUBLISH goes to on_publish_packet(command
        # byte, the bytes after the remaining length) instead of through paho's MQTTMessage and
        # Properties (~40 us). It may raise paho's MalformedPacket, which drops the connection.
        self.on_publish_packet: Callable[[int, bytearray], None] | None = None

    def loop_read(self, max_packets: int = 1) -> MQTTErrorCode:
        """paho's loop_read, repeated while it leaves bytes read ahead (or decrypted by TLS) that
        no readable event will announce (paho parses a bounded number of packets per call), until
        READ_PER_EVENT bytes came from the socket: then `has_unread()` says whether the caller
        must call again on a later loop turn."""
        self._read_left = READ_PER_EVENT
        rc = super().loop_read(max_packets)
        while self._read_left > 0 and self.has_unread():
            rc = super().loop_read(max_packets)
        return rc

    def has_unread(self) -> bool:
        """Bytes read ahead, or decrypted by TLS, that no readable event will announce."""
        sock = self._sock
        return sock is not None and (bool(self._read_ahead) or _tls_pending(sock) > 0)

    def _sock_recv(self, bufsize: int) -> bytes:
        ahead = self._read_ahead
        if not ahead:
            if self._read_left <= 0:
                raise BlockingIOError  # this event's share is read: paho stops, the rest comes next turn
            data = super()._sock_recv(RECV_CHUNK)  # BlockingIOError when there is nothing
            self._read_left -= len(data)
            if len(data) <= bufsize:
                return data
            ahead = memoryview(data)
        self._read_ahead = ahead[bufsize:]
        return ahead[:bufsize].tobytes()

    def _handle_publish(self) -> MQTTErrorCode:
        command = self._in_packet["command"]
        handler = self.on_publish_packet
        if (handler is None or self._protocol != MQTTProtocolVersion.MQTTv5 or not self._manual_ack
                or command & 0x06 == 0x04):  # QoS 2: paho keeps the message until PUBREL
            return super()._handle_publish()
        with self._in_callback_mutex:
            try:
                handler(command, self._in_packet["packet"])
            except MalformedPacket:
                raise
            except Exception as err:  # as paho treats an on_message that raises
                self._easy_log(MQTT_LOG_ERR, "Caught exception in on_message: %s", err)
                if not self.suppress_exceptions:
                    raise
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def _handle_pubackcomp(self, cmd: Any) -> MQTTErrorCode:
        packet = self._in_packet["packet"]
        if cmd != "PUBACK" or len(packet) != 2:  # a reason code or properties: paho decodes them
            return super()._handle_pubackcomp(cmd)
        mid = (packet[0] << 8) | packet[1]
        with self._out_message_mutex:
            if mid in self._out_messages:  # else a duplicate: reported once already
                return self._do_on_publish(mid, PUBACK_SUCCESS, NO_PROPERTIES)
        return MQTTErrorCode.MQTT_ERR_SUCCESS

    def queued_topic(self, mid: int) -> str:
        """The topic of the publish `mid` that paho still holds (as it does during its on_publish)."""
        message = self._out_messages.get(mid)
        return message.topic if message is not None else ""

    def queued_to(self, topic: str) -> list[int]:
        """The mids of the QoS 1/2 publishes to `topic` that paho holds."""
        with self._out_message_mutex:  # a reconnect on the executor's thread may reset them meanwhile
            return [mid for mid, m in self._out_messages.items() if m.topic == topic and m.qos]

    def oldest_in_flight(self) -> int | None:
        """The mid of the oldest QoS 1/2 publish sent and not acknowledged yet, if any."""
        with self._out_message_mutex:
            return next((mid for mid, m in self._out_messages.items() if m.state in SENT_STATES), None)

    def drop_queued(self, mids: list[int]) -> None:
        """Take these publishes out of paho's queue, sent or not: paho neither sends them again
        after a reconnect nor reports a late acknowledgement of one."""
        with self._out_message_mutex:
            for mid in mids:
                message = self._out_messages.pop(mid, None)
                if message is not None and message.state in SENT_STATES:
                    self._inflight_messages -= 1

    def set_in_flight_window(self, size: int) -> None:
        """How many QoS 1/2 publishes may await their acknowledgement at once; also while connected,
        which paho's setter refuses (a wider window fills at the next acknowledgement)."""
        self._max_inflight_messages = size

    def _messages_reconnect_reset_out(self) -> None:
        # paho 2.2 marks every held QoS 1/2 publish to be sent again at the CONNACK, whatever the
        # window (it never counts them there): keep the window, so that the rest follow as the
        # broker acknowledges, and one at a time after a suspicious loss (set_in_flight_window).
        super()._messages_reconnect_reset_out()
        with self._out_message_mutex:
            window, resent = self._max_inflight_messages, 0
            for message in self._out_messages.values():
                if not message.qos or message.state not in (mqtt_ms_publish, mqtt_ms_resend_pubrel):
                    continue
                if window and resent >= window and message.state == mqtt_ms_publish:
                    message.state = mqtt_ms_queued
                else:
                    resent += 1

    def _sock_close(self) -> None:
        # What was read ahead belongs to this connection: never parse it as the next one's.
        self._read_ahead = memoryview(b"")
        super()._sock_close()

    def coalesce(self) -> None:
        """Join the packets at the head of the queue into as few writes as paho's bookkeeping
        allows. A packet paho acts on once written (a QoS 0 PUBLISH: its on_publish; a
        DISCONNECT: closing the socket) keeps its own entry, as does one over JOIN_MAX; PUBACKs,
        QoS 1/2 PUBLISHes and the rest are plain bytes to paho once queued, and are joined with
        their neighbours. Only the first COALESCE_MAX bytes are looked at: behind a socket that
        takes little, a backlog is not copied again on every loop turn."""
        queue: deque[Any] = self._out_packet
        if len(queue) < 2:
            return
        joined: deque[Any] = deque()
        run: list[memoryview] = []
        seen = taken = 0
        for packet in queue:
            if seen >= COALESCE_MAX:
                break
            taken += 1
            seen += packet["to_process"]
            kind = packet["command"] & 0xF0
            if kind == DISCONNECT or (kind == PUBLISH and packet["qos"] == 0) or packet["to_process"] > JOIN_MAX:
                _flush(run, joined)
                joined.append(packet)
            else:
                run.append(memoryview(packet["packet"])[packet["pos"]:])
        _flush(run, joined)
        for _ in range(taken):
            queue.popleft()
        queue.extendleft(reversed(joined))


def _tls_pending(sock: Any) -> int:
    return sock.pending() if isinstance(sock, ssl.SSLSocket) else 0


def _flush(run: list[memoryview], joined: deque[Any]) -> None:
    if run:
        data = b"".join(run)
        joined.append({"command": 0, "mid": 0, "qos": 0, "pos": 0, "to_process": len(data), "packet": data,
                       "info": None})
        run.clear()
