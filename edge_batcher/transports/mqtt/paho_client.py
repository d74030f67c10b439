"""The paho-mqtt 2.x adapter (MQTT 5): one paho Client (a BatchedClient, batched_io.py) whose
socket the event loop serves, as aiomqtt does, behind a small interface. paho's reads, writes
and callbacks run on the loop (add_reader/add_writer, and loop_misc every second for
keepalive): no network thread, so no thread hop and no GIL hand-over per message, and a
publish or an ack is a write on the loop (issue 20: a paho thread cost the loop a wake-up per
reply and per ack). Only connecting (DNS, TCP, TLS: blocking) runs in the loop's executor, and
paho opens the socket there. An incoming PUBLISH becomes the package's own immutable Message at
this edge (messages.py), stamped with the connection it arrived on. A publish is tracked until
paho reports it sent (publish_tracker.py; QoS 1: the broker's PUBACK) or the broker refuses it
(refusals.py), retried while paho's outgoing queue is full, and an ack goes back only on the
connection its message came from. A lost connection is retried with backoff
(reconnect_min_s..reconnect_max_s). docs/mqtt.md describes the whole flow.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from paho.mqtt.client import Client, MQTTMessage, MQTTMessageInfo
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from ...config import MqttSettings
from ...errors import ConfigError
from .batched_io import BatchedClient
from .messages import Message, Reply, decode_publish, message_from_paho, publish_properties
from .publish_tracker import PublishTracker, resolve
from .refusals import BrokerRefusals
from .undeliverable import ReplyRefused

log = logging.getLogger(__name__)

PUBLISH_RECHECK_S = 5.0  # a reply not reported sent by then is checked against paho's own flag
QUEUE_RETRY_S = 0.01  # a reply paho cannot queue yet (max_queued) is tried again after this long
LOG_INTERVAL_S = 10.0  # repeated warnings (outgoing queue full, session taken over) are logged at most this often
SESSION_TAKEN_OVER = 0x8E  # MQTT 5 DISCONNECT reason: another connection took our client id
HOUSEKEEPING_S = 1.0  # how often paho's keepalive duties run (loop_misc)
RECONNECT_DRAIN_S = 2.0  # the longest a reconnect or close waits for the DISCONNECT to go out


def tcp_no_delay(client: Client, userdata: Any, sock: Any) -> None:
    """paho leaves Nagle's algorithm on: a reply written while the previous packet waits for its TCP
    ACK would then sit out the peer's delayed ACK (40 ms on Linux). Small packets go out at once."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):  # not a TCP socket (e.g. a websocket wrapper)
        pass


class _QuietRetries(logging.Filter):
    """paho logs an ERROR "Client is not connected" on every retry while the broker is away; the
    adapter reports that itself (once, then every tenth attempt)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Client is not connected")


class PahoClient:
    """A paho Client for one MqttTransport: ``await connect()`` ... ``await close()``.

    ``on_message(Message)`` and ``on_session_resumed()`` are called on the event loop, inside
    paho's reads, and must not block. ``state`` is "connected" once CONNACK and SUBACK came, else "disconnected"."""

    def __init__(
        self, settings: MqttSettings, *, client_id: str, password: str | None, where: str, subscriptions: list[str],
        on_message: Callable[[Message], None], on_session_resumed: Callable[[], object],
    ):
        self.settings = settings
        self.client_id = client_id
        self._where = where
        self._subscriptions = subscriptions
        self._deliver = on_message
        self._session_resumed = on_session_resumed
        self._tracker = PublishTracker()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._write_scheduled = False  # a write of paho's queued bytes is due this loop turn
        self._retry: asyncio.Task | None = None  # reconnecting with backoff
        self._housekeeping: asyncio.Task | None = None
        self._last_connect_error: BaseException | None = None
        self._connected: asyncio.Event | None = None
        self._connect_properties: Properties | None = None
        self.state = "disconnected"
        self.connection = 0  # bumped on every successful CONNACK
        self.stopping = False  # set when the daemon drains: a disconnect is then expected, not a warning
        self._reconnecting = False
        self._closed = False
        self._loss_reported = False  # this connection's loss was handled (paho may report it twice)
        self._subscribe_mid: int | None = None
        self._connect_failures = 0
        self._last_queue_warning = 0.0
        self._last_takeover_log = -LOG_INTERVAL_S
        self._client = self._make_client(password)
        self._refusals = BrokerRefusals(self._client, self._tracker, settings.max_inflight)

    # ------------------------------------------------------------------ connection

    async def connect(self) -> None:
        """Connect (on a worker thread) and serve paho's socket from the event loop; a broker that
        is away is retried in the background with backoff."""
        s, client = self.settings, self._client
        self._loop = loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._connected = asyncio.Event()
        properties = Properties(PacketTypes.CONNECT)
        properties.SessionExpiryInterval = s.session_expiry_s
        # MQTT 5 flow control: the broker sends at most max_pending unacked QoS 1/2 messages and
        # keeps the rest queued for us (a backlog after a restart drains at our pace instead of
        # being answered 429). QoS 0 has no such bound: the transport's 429 hand-off covers it.
        properties.ReceiveMaximum = min(s.max_pending, 65535)
        self._connect_properties = properties
        # connect_async only records where to connect; _connect_now does it.
        client.connect_async(s.host, s.port, keepalive=s.keepalive_s, clean_start=False, properties=properties)
        self._housekeeping = loop.create_task(self._keep_alive())
        if not await self._connect_now():
            log.warning("MQTT: broker %s:%d not reachable (%s); retrying every %g-%g s in the background, "
                        "the Unix socket serves meanwhile", s.host, s.port, self._last_connect_error,
                        s.reconnect_min_s, s.reconnect_max_s)
            self._connect_failures = 1
            self._reconnect_later()

    async def _connect_now(self) -> bool:
        """One connection attempt. It resolves the host name and opens the TCP (and TLS)
        connection, which can block for seconds: on a worker thread, not the event loop."""
        assert self._loop is not None
        try:
            await self._loop.run_in_executor(None, self._client.reconnect)
        except (OSError, ValueError) as exc:  # refused, unreachable, DNS, TLS handshake
            self._last_connect_error = exc
            return False
        return True

    def _reconnect_later(self) -> None:
        """After a lost connection or a failed attempt: try again with backoff, in the background."""
        if self._closed or self.stopping or self._reconnecting or self._loop is None:
            return
        if self._retry is None or self._retry.done():
            self._retry = self._loop.create_task(self._retry_with_backoff())

    async def _retry_with_backoff(self) -> None:
        s = self.settings
        delay = s.reconnect_min_s
        while not (self._closed or self.stopping):
            await asyncio.sleep(delay)
            if self._closed or self.stopping or self._client.socket() is not None:
                return
            if await self._connect_now():
                if self._client.socket() is not None:
                    return
                # Connected, and lost again before this task heard of it: _reconnect_later saw
                # it running and left the next attempt to it.
                delay = s.reconnect_min_s
                continue
            self._on_connect_fail(self._client, None)
            delay = min(delay * 2, s.reconnect_max_s)

    async def reconnect(self) -> None:
        """Disconnect and connect again, resuming the session: the broker then sends every message
        we left unacked (MQTT redelivers only on a new connection)."""
        client = self._client
        self._reconnecting = True
        try:
            client.disconnect()  # queued after every reply and ack already written
            await self._socket_closed_within(RECONNECT_DRAIN_S)
            if self._closed or self.stopping:
                return
            connected = await self._connect_now()
        finally:
            self._reconnecting = False
        if not connected:
            self._connect_failures = 1
        if not connected or client.socket() is None:  # failed, or lost before we heard: _reconnect_later
            self._reconnect_later()                   # left the next attempt to us meanwhile

    async def close(self) -> None:
        """Disconnect, waiting briefly for the DISCONNECT to go out. Subscriptions stay in the
        persistent session."""
        self._closed = True
        for task in (self._retry, self._housekeeping):
            if task is not None:
                task.cancel()
        self._client.disconnect()
        await self._socket_closed_within(RECONNECT_DRAIN_S)
        self._client._sock_close()  # noqa: SLF001 - paho has no public close; a no-op once closed
        self.state = "disconnected"

    async def _socket_closed_within(self, seconds: float) -> None:
        """Wait until paho closed its socket (a DISCONNECT written, or the connection lost)."""
        deadline = time.monotonic() + seconds
        while self._client.socket() is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _keep_alive(self) -> None:
        """paho's periodic duties, which its own thread would do: PINGREQ when idle, and giving up
        on a broker that stopped answering (then on_disconnect, and a reconnect)."""
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            try:
                self._client.loop_misc()
            except Exception:  # a paho bug must not end the keepalive for good
                log.exception("MQTT: paho's keepalive check failed; trying again in %g s", HOUSEKEEPING_S)

    # ------------------------------------------------------------------ the socket on the event loop

    def _on_loop(self, fn: Callable[..., object], *args: Any) -> None:
        """Run fn now when on the event loop's thread (paho's reads and writes), else soon on it
        (paho opens and closes sockets on the worker thread that connects)."""
        if threading.get_ident() == self._loop_thread:
            fn(*args)
        elif self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop is closed: nothing to watch any more
                pass

    # Sockets are registered with the loop by file descriptor number, recorded when paho opens
    # the socket: paho closes a socket on the connecting thread before the loop hears of it, and
    # a closed socket object no longer knows its number.

    def _socket_open(self, client: Client, userdata: Any, sock: Any) -> None:
        tcp_no_delay(client, userdata, sock)
        self._on_loop(self._watch, sock, sock.fileno())

    def _watch(self, sock: Any, fd: int) -> None:
        assert self._loop is not None
        if sock is self._client.socket():
            self._loop.add_reader(fd, self._readable, sock, fd)

    def _socket_close(self, client: Client, userdata: Any, sock: Any) -> None:
        self._on_loop(self._unwatch, sock.fileno())

    def _unwatch(self, fd: int) -> None:
        assert self._loop is not None
        if fd >= 0:
            self._loop.remove_reader(fd)
            self._loop.remove_writer(fd)

    def _want_write(self, client: Client, userdata: Any, sock: Any) -> None:
        self._on_loop(self._write_soon, sock, sock.fileno())

    def _write_soon(self, sock: Any, fd: int) -> None:
        """paho has bytes to send. Written once per loop turn, so that the replies and acks of one
        turn go out together (no two epoll changes each); only bytes that the socket would not
        take wait for it to become writable (_writable)."""
        assert self._loop is not None
        if sock is self._client.socket() and not self._write_scheduled:
            self._write_scheduled = True
            self._loop.call_soon(self._writable, sock, fd)

    def _readable(self, sock: Any, fd: int) -> None:
        if sock is not self._client.socket():  # left from a connection paho has replaced
            self._unwatch(fd)
            return
        self._client.loop_read()  # BatchedClient's: parses everything it reads ahead, up to READ_PER_EVENT
        if self._client.has_unread():  # its share of this turn read: no readable event announces the rest
            assert self._loop is not None  # watched only while serving
            self._loop.call_soon(self._readable, sock, fd)

    def _writable(self, sock: Any, fd: int) -> None:
        assert self._loop is not None
        self._write_scheduled = False
        current: Any = self._client.socket()
        if sock is not current:  # replaced since (its number may be the new socket's): write that one
            if current is not None and self._client.want_write():
                self._write_soon(current, current.fileno())
            return
        self._client.coalesce()
        self._client.loop_write()
        # paho asks to be told of writability only once until all is written: if the socket took
        # only part, watch it until it takes the rest.
        if sock is self._client.socket() and self._client.want_write():
            self._loop.add_writer(fd, self._writable, sock, fd)
        else:
            self._loop.remove_writer(fd)

    async def wait_connected(self, timeout: float | None = None) -> bool:
        """Wait until connected and subscribed; False when `timeout` passes first."""
        if self._connected is None:
            return False
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    # ------------------------------------------------------------------ publishing and acks

    async def publish(self, reply: Reply) -> bool:
        """Publish and wait until paho reports it sent (QoS 1: the broker's PUBACK). False when
        the reply could not be queued: its request is then left unacked for redelivery.
        ReplyRefused when the broker refused it, refused its topic within TOPICS_REMEMBERED_S, or
        paho cannot send it at all."""
        qos = self.settings.qos
        properties = publish_properties(reply)
        while True:
            if self._closed:
                return False
            refused = self._refusals.of_reply(reply.topic, reply.correlation_data)
            if refused is not None:
                raise refused
            try:
                info: MQTTMessageInfo = self._client.publish(reply.topic, reply.payload, qos=qos, properties=properties)
            except ValueError as exc:  # a topic or payload paho refuses: resending will not help
                raise ReplyRefused(reply.topic, f"paho cannot publish it: {exc}") from None
            if info.rc != MQTTErrorCode.MQTT_ERR_QUEUE_SIZE:
                break
            # paho holds max_queued replies already: wait for the broker to take some, then retry.
            self._tracker.forget(info.mid, pending=False)
            now = time.monotonic()
            if now - self._last_queue_warning >= LOG_INTERVAL_S:
                self._last_queue_warning = now
                log.warning("MQTT: outgoing queue full (max_queued %d): replies wait for the broker to take "
                            "earlier ones", self.settings.max_queued)
            await asyncio.sleep(QUEUE_RETRY_S)
        if info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN and qos == 0:
            self._tracker.forget(info.mid, pending=False)
            return False  # QoS 0 is not kept across a reconnect
        # Success, or NO_CONN with QoS > 0: paho keeps it and sends it after the reconnect.
        loop = asyncio.get_running_loop()
        sent = self._tracker.wait(loop, info.mid, (reply.topic, reply.correlation_data))

        def recheck() -> None:
            # Slow (a reconnect), or a missed on_publish for a reused mid: paho's own flag says.
            if sent.done():
                return
            if _is_published(info):
                self._tracker.forget(info.mid, pending=False)
                resolve(sent, True)
            else:
                timer[0] = loop.call_later(PUBLISH_RECHECK_S, recheck)

        # A timer rather than wait_for(shield(...)): no extra future and task wake-up per reply.
        timer = [loop.call_later(PUBLISH_RECHECK_S, recheck)]
        try:
            return await sent
        except asyncio.CancelledError:
            self._tracker.forget(info.mid)
            raise
        finally:
            timer[0].cancel()

    def publish_nowait(self, reply: Reply) -> bool:
        """Queue a reply without waiting (safe inside paho's callbacks); False when paho refused
        it, or the broker refused its topic lately."""
        qos = self.settings.qos
        if self._refusals.of_reply(reply.topic, reply.correlation_data) is not None:
            return False
        try:
            info = self._client.publish(reply.topic, reply.payload, qos=qos, properties=publish_properties(reply))
        except ValueError:  # a topic or payload paho refuses
            return False
        # Not waited for; on_publish is still coming unless the publish was refused outright.
        pending = info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS or (info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN and qos > 0)
        self._tracker.forget(info.mid, pending)
        return pending

    def ack(self, message: Message) -> None:
        if message.qos == 0 or self._closed:
            return
        if message.connection != self.connection:
            return  # it arrived on an earlier connection: the broker redelivers it on this one
        self._client.ack(message.mid, message.qos)

    # ------------------------------------------------------------------ setup

    def _make_client(self, password: str | None) -> BatchedClient:
        s = self.settings
        client = BatchedClient(
            CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=MQTTProtocolVersion.MQTTv5, manual_ack=True
        )
        paho_log = logging.getLogger(f"{__package__}.paho")
        if not any(isinstance(f, _QuietRetries) for f in paho_log.filters):
            paho_log.addFilter(_QuietRetries())
        client.enable_logger(paho_log)
        client.suppress_exceptions = True  # a bug in a callback is logged, never breaks paho's read
        client.max_inflight_messages_set(s.max_inflight)
        client.max_queued_messages_set(s.max_queued)  # bounded: 0 would be unbounded
        if s.username:
            client.username_pw_set(s.username, password)
        if s.tls:
            try:
                client.tls_set(
                    ca_certs=s.ca_file or None, certfile=s.cert_file or None, keyfile=s.key_file or None,
                    cert_reqs=ssl.CERT_REQUIRED,  # the broker's certificate is always verified
                )
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError: unreadable or mismatched PEM files
                raise ConfigError(f"{self._where} tls: cannot load ca_file/cert_file/key_file: {exc}") from None
            if s.tls_insecure:
                log.warning("MQTT: tls_insecure = true: the broker's host name is not verified (testing only)")
                client.tls_insecure_set(True)
        client.on_socket_open = self._socket_open
        client.on_socket_close = self._socket_close
        client.on_socket_register_write = self._want_write  # no unregister: _writable knows when all is out
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message  # QoS 2 (paho keeps it until PUBREL)
        client.on_publish_packet = self._on_publish_packet  # QoS 0 and 1
        client.on_publish = self._on_publish
        return client

    # ------------------------------------------------------------------ paho callbacks (on the loop, inside paho's
    # reads and writes, except on_socket_open/close: never block)

    def _on_connect(self, client: Client, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        s = self.settings
        if reason_code.is_failure:
            log.error("MQTT: broker %s:%d refused the connection: %s (reason code %d)", s.host, s.port,
                      reason_code, reason_code.value)
            return
        self.connection += 1
        self._connect_failures = 0
        self._loss_reported = False
        log.info("MQTT: connected to %s:%d (%s session)", s.host, s.port,
                 "resumed" if flags.session_present else "new")
        if flags.session_present:  # what waits from the last connection is on its way again
            self._session_resumed()
        # Subscribing again is harmless when the session was resumed, and needed when it was not.
        _, self._subscribe_mid = client.subscribe([(f, s.qos) for f in self._subscriptions])

    def _on_subscribe(self, client: Client, userdata: Any, mid: int, reason_codes: list, properties: Any) -> None:
        if mid != self._subscribe_mid:
            return
        failed = [f"{f} ({rc})" for f, rc in zip(self._subscriptions, reason_codes, strict=False) if rc.is_failure]
        if failed:
            log.error("MQTT: the broker refused subscriptions: %s", ", ".join(failed))
        log.info("MQTT: subscribed to %s", ", ".join(self._subscriptions))
        self.state = "connected"
        self._signal(True)

    def _on_connect_fail(self, client: Client, userdata: Any) -> None:
        s = self.settings
        self._connect_failures += 1
        n = self._connect_failures
        if n == 1 or n % 10 == 0:
            log.warning("MQTT: cannot reach broker %s:%d (%d attempt(s)); retrying with backoff %g-%g s",
                        s.host, s.port, n, s.reconnect_min_s, s.reconnect_max_s)

    def _on_disconnect(self, client: Client, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        was = self.state
        self.state = "disconnected"
        self._signal(False)
        self._on_loop(self._reconnect_later)
        if self._loss_reported:  # paho reports a loss twice when a write and the read around it both fail
            return
        self._loss_reported = True
        if self.stopping or self._reconnecting:
            log.info("MQTT: disconnected (%s)", reason_code)
        elif reason_code.value == SESSION_TAKEN_OVER:
            now = time.monotonic()
            if now - self._last_takeover_log >= LOG_INTERVAL_S:
                self._last_takeover_log = now
                log.error("MQTT: session taken over: another client connected to %s:%d with our client id %r "
                          "(reason code 0x8E); give each daemon its own [mqtt] client_id", self.settings.host,
                          self.settings.port, self.client_id)
        elif was == "connected" or reason_code.is_failure:
            log.warning("MQTT: connection to %s:%d lost: %s (reason code %d, client id %r); reconnecting with "
                        "backoff. If this repeats every second or so, another client uses the same client id",
                        self.settings.host, self.settings.port, reason_code, reason_code.value, self.client_id)
        if not (self.stopping or self._reconnecting or self._closed):
            self._refusals.connection_lost()

    def _on_message(self, client: Client, userdata: Any, msg: MQTTMessage) -> None:
        self._deliver(message_from_paho(msg, self.connection))

    def _on_publish_packet(self, command: int, packet: bytearray) -> None:
        self._deliver(decode_publish(command, packet, self.connection))

    def _on_publish(self, client: Client, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        if reason_code.is_failure:  # its waiter logs it, throttled
            self._refusals.refused(mid, reason_code.getName(), reason_code.value)
        else:
            self._refusals.accepted()
            self._tracker.done(mid)

    def _signal(self, connected: bool) -> None:
        event, loop = self._connected, self._loop
        if event is None or loop is None:
            return
        try:
            loop.call_soon_threadsafe(event.set if connected else event.clear)
        except RuntimeError:
            pass


def _is_published(info: MQTTMessageInfo) -> bool:
    try:
        return info.is_published()
    except (ValueError, RuntimeError):  # rc records a failure (or NO_CONN: queued for the reconnect)
        return False
