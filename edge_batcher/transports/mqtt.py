"""The MQTT transport (paho-mqtt 2.x, MQTT 5): KServe v2 requests through a broker, and sensor streams.

Topics (``<prefix>`` is ``[mqtt] topic_prefix``, by default ``edge-batcher/<device id>``)::

    <prefix>/infer/<model>      requests: a KServe v2 JSON request, or the v2 binary extension when the
                                MQTT 5 Content Type is application/octet-stream (the JSON header's length
                                then travels in the user property Inference-Header-Content-Length)
    <Response Topic>            the reply, with the request's Correlation Data, the user property
                                "status" ("200", "400", ...) and a Content Type
    <prefix>/result/<model>     the reply of a request that carried no Response Topic
    [[mqtt.streams]] topic      plain sensor payloads (a JSON number array or raw little-endian bytes)
                                routed to one model input; results go to the stream's output topic

With ``shared_group`` every subscription is ``$share/<group>/<filter>``: the broker splits the
messages of one topic across every daemon of the group (the way to scale past one device).

Threads. paho's network thread (``loop_start``) runs every paho callback; none of them blocks it.
``on_message`` only admits the message to the inbox (bounded in bytes) and hands it to the event
loop with ``call_soon_threadsafe``. Decoding, inference, encoding and publishing happen on the
event loop, at most ``max_pending`` messages at once; the rest wait in the inbox in arrival order.
The only blocking paho calls (``connect``: DNS, TCP, TLS; ``loop_stop``: a thread join) run in the
loop's executor.

At-least-once. The client connects with ``manual_ack=True`` and a persistent session
(``clean_start=False`` + SessionExpiryInterval): the broker keeps our subscriptions and queues
QoS 1/2 requests while the daemon restarts, and redelivers the ones we never acked. A request is
acked only after its reply was accepted by the broker (``on_publish``: the PUBACK for a QoS 1
reply), and only on the connection it arrived on (after a reconnect the broker redelivers it
anyway). A reply that paho cannot queue yet is retried, never dropped. QoS 1/2 requests are never
refused for load: the broker holds the backlog (Receive Maximum = ``max_pending``), and what a
broker sends beyond it (mosquitto 2.0 does, after the first acknowledgements and on every
reconnect) waits in the inbox up to ``max_held_bytes``; past that a message is left unacked and,
once the inbox is empty, the transport reconnects so that the broker sends it again. Only QoS 0
requests are answered 429 for load. After a crash, a broker restart or a connection loss a
request may be answered twice; every reply carries the request's Correlation Data and v2 ``id``
so clients can drop duplicates. docs/mqtt.md states the guarantee and its limits.

Error edge: every :class:`~edge_batcher.errors.EdgeBatcherError` becomes ``{"error": message}``
(plus the request's ``id`` when known) with its status in the "status" user property; anything
unexpected is logged and answered 500 while the daemon keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import json
import logging
import os
import socket
import ssl
import string
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from paho.mqtt.client import Client, MQTTMessage, MQTTMessageInfo, topic_matches_sub
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from ..config import DaemonConfig, MqttSettings, StreamMapping
from ..errors import ConfigError, DeadlineExceeded, EdgeBatcherError, InvalidInput, Overloaded, Unavailable
from ..protocol import v2
from ..runtime import Runtime
from ..types import DATATYPE_TO_NUMPY, InferRequest, TensorSpec
from .http import DECODE_OFF_LOOP_BYTES, to_infer_request

log = logging.getLogger(__name__)

JSON = v2.JSON_CONTENT_TYPE
BINARY = v2.BINARY_CONTENT_TYPE
STATUS_PROPERTY = "status"
STOP_GRACE_S = 5.0  # stop(): how long replies in flight may take before their requests are left unacked
PUBLISH_RECHECK_S = 5.0  # a reply not reported sent by then is checked against paho's own flag
MESSAGE_OVERHEAD_BYTES = 2048  # a held message's MQTTMessage, properties, bookkeeping (~1.9 KiB measured)
QUEUE_RETRY_S = 0.01  # a reply paho cannot queue yet (max_queued) is tried again after this long
OVERLOAD_RETRY_S = (0.002, 0.05)  # a QoS 1/2 request the model's queue refused: first and longest wait
LOG_INTERVAL_S = 10.0  # repeated warnings (outgoing queue full, session taken over) are logged at most this often
SESSION_TAKEN_OVER = 0x8E  # MQTT 5 DISCONNECT reason: another connection took our client id


class _QuietRetries(logging.Filter):
    """paho logs an ERROR "Client is not connected" on every retry while the broker is away; the
    transport reports that itself (once, then every tenth attempt)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Client is not connected")


class _LeaveUnacked(Exception):
    """The daemon is stopping and this request could not run: no reply, no ack, so the broker
    redelivers it to the next daemon (or to us after the restart)."""


# --------------------------------------------------------------------------- settings


def validate_settings(s: MqttSettings, where: str = "[mqtt]") -> None:
    """Check what config.py does not: ranges, enumerations, topic syntax, files. Raises ConfigError
    naming the key, e.g. ``[mqtt] qos: expected 0, 1 or 2, got 3``."""
    if not s.host:
        raise ConfigError(f"{where} host: expected the broker's host name or address, got an empty string")
    if not 0 < s.port < 65536:
        raise ConfigError(f"{where} port: expected 1..65535, got {s.port}")
    if s.qos not in (0, 1, 2):
        raise ConfigError(f"{where} qos: expected 0, 1 or 2, got {s.qos}")
    if not 0 <= s.keepalive_s <= 65535:
        raise ConfigError(f"{where} keepalive_s: expected 0..65535 seconds, got {s.keepalive_s}")
    if not 0 <= s.session_expiry_s <= 0xFFFFFFFF:
        raise ConfigError(f"{where} session_expiry_s: expected 0..4294967295 seconds, got {s.session_expiry_s}")
    for key in ("max_inflight", "max_queued", "max_pending", "max_held_bytes"):
        value = getattr(s, key)
        if value < 1:  # paho reads 0 as "unbounded": never allow it
            raise ConfigError(f"{where} {key}: expected a positive number (0 would be unbounded), got {value}")
    if s.reconnect_min_s <= 0:
        raise ConfigError(f"{where} reconnect_min_s: expected a positive number of seconds, got {s.reconnect_min_s}")
    if s.reconnect_max_s < s.reconnect_min_s:
        raise ConfigError(
            f"{where} reconnect_max_s: expected at least reconnect_min_s ({s.reconnect_min_s}), got {s.reconnect_max_s}"
        )
    for key in ("device_id", "topic_prefix", "shared_group"):
        value = getattr(s, key)
        if any(c in value for c in "+#\0"):
            raise ConfigError(f"{where} {key}: must not contain the MQTT wildcards '+' or '#', got {value!r}")
    if s.topic_prefix and (s.topic_prefix.endswith("/") or s.topic_prefix.startswith("$")):
        raise ConfigError(f"{where} topic_prefix: must not end with '/' or start with '$', got {s.topic_prefix!r}")
    if "/" in s.shared_group:
        raise ConfigError(f"{where} shared_group: must not contain '/', got {s.shared_group!r}")
    if s.password and s.password_file:
        raise ConfigError(f"{where} password_file: set password or password_file, not both")
    if (s.password or s.password_file) and not s.username:
        raise ConfigError(f"{where} username: a password is set, so set the user name too")
    if s.password_file and not os.access(s.password_file, os.R_OK):
        raise ConfigError(f"{where} password_file: {s.password_file} does not exist or is not readable")
    for key in ("ca_file", "cert_file", "key_file"):
        path = getattr(s, key)
        if path and not os.path.isfile(path):
            raise ConfigError(f"{where} {key}: {path} is not a file")
        if path and not s.tls:
            raise ConfigError(f"{where} {key}: set tls = true to use it")
    if s.key_file and not s.cert_file:
        raise ConfigError(f"{where} key_file: a client key needs its certificate: set cert_file too")
    for i, stream in enumerate(s.streams):
        _validate_stream(stream, f"{where} streams[{i}]")


def _validate_stream(m: StreamMapping, where: str) -> None:
    _check_filter(m.topic, f"{where} topic")
    if m.encoding not in ("json", "raw"):
        raise ConfigError(f"{where} encoding: expected json or raw, got {m.encoding!r}")
    if not m.model:
        raise ConfigError(f"{where} model: name the model this stream feeds")
    if m.output_topic:
        wildcards = sum(1 for level in m.topic.split("/") if level in ("+", "#"))
        try:
            fields = [f for _, f, spec, conv in string.Formatter().parse(m.output_topic) if f is not None]
        except ValueError as exc:
            raise ConfigError(f"{where} output_topic: {m.output_topic!r} is not a valid template: {exc}") from None
        for f in fields:
            if not f.isdigit() or not 1 <= int(f) <= wildcards:
                allowed = ", ".join(f"{{{i}}}" for i in range(1, wildcards + 1)) or "none (the filter has no wildcards)"
                raise ConfigError(
                    f"{where} output_topic: {{{f}}} is not a wildcard of {m.topic!r}; allowed: {allowed}"
                )
        sample = m.output_topic.format("", *(["x"] * wildcards))
        if any(c in sample for c in "+#"):
            raise ConfigError(f"{where} output_topic: must not contain '+' or '#', got {m.output_topic!r}")
        if topic_matches_sub(m.topic, sample):
            raise ConfigError(
                f"{where} output_topic: {m.output_topic!r} matches the stream's own filter {m.topic!r}: "
                f"results would be fed back in"
            )


def _check_filter(topic: str, where: str) -> None:
    if not topic or "\0" in topic:
        raise ConfigError(f"{where}: expected an MQTT topic filter like sensors/+/vibration, got {topic!r}")
    if topic.startswith("$share/"):
        raise ConfigError(f"{where}: use [mqtt] shared_group instead of a $share/ filter, got {topic!r}")
    levels = topic.split("/")
    for i, level in enumerate(levels):
        if ("+" in level or "#" in level) and level not in ("+", "#"):
            raise ConfigError(f"{where}: a wildcard must fill a whole level, got {topic!r}")
        if level == "#" and i != len(levels) - 1:
            raise ConfigError(f"{where}: '#' must be the last level, got {topic!r}")


# --------------------------------------------------------------------------- stream routes


@dataclass
class StreamRoute:
    """One [[mqtt.streams]] mapping, checked against the loaded model."""

    filter: str
    levels: list[str]
    model: str
    input: TensorSpec
    encoding: str
    output_template: str  # "" : <prefix>/streams/<model>/<source topic>
    labels: list[str]

    def wildcards(self, topic: str) -> list[str]:
        """The topic levels that the filter's '+' / '#' matched, in order ({1}, {2}, ...)."""
        parts = topic.split("/")
        out = []
        for i, level in enumerate(self.levels):
            if level == "+":
                out.append(parts[i])
            elif level == "#":
                out.append("/".join(parts[i:]))
                break
        return out

    def output_topic(self, topic: str, prefix: str) -> str:
        if not self.output_template:
            return f"{prefix}/streams/{self.model}/{topic}"
        return self.output_template.format("", *self.wildcards(topic))

    def decode(self, payload: bytes, where: str) -> tuple[np.ndarray, bool]:
        """The payload as the input tensor with a batch dimension; True when it was one row
        (its outputs are then sent without the batch dimension)."""
        if not payload:
            raise InvalidInput(f"{where}: empty payload")
        if self.encoding == "raw":
            return self._decode_raw(payload, where)
        return self._decode_json(payload, where)

    def _decode_raw(self, payload: bytes, where: str) -> tuple[np.ndarray, bool]:
        spec = self.input
        dtype = DATATYPE_TO_NUMPY[spec.datatype]
        row_shape = list(spec.shape[1:])
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        if len(payload) % row_bytes:
            raise InvalidInput(
                f"{where}: raw payload of {len(payload)} bytes is not a whole number of rows: input "
                f"{spec.name!r} takes {row_shape} {spec.datatype} per row ({row_bytes} bytes, little-endian)"
            )
        rows = len(payload) // row_bytes
        if spec.datatype == "BOOL":
            array = np.frombuffer(payload, dtype=np.uint8) != 0
        else:  # a read-only view of the payload on little-endian hosts; a copy elsewhere
            array = np.frombuffer(payload, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
        return array.reshape([rows, *row_shape]), rows == 1

    def _decode_json(self, payload: bytes, where: str) -> tuple[np.ndarray, bool]:
        spec = self.input
        try:
            data = json.loads(payload)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
            raise InvalidInput(f"{where}: payload is not JSON ({exc}); expected a JSON array of numbers") from None
        if not isinstance(data, list) or not data:
            raise InvalidInput(
                f"{where}: expected a JSON array of numbers (one row) or an array of rows, got {type(data).__name__}"
            )
        try:
            array = np.asarray(data)
        except (ValueError, TypeError, RecursionError):
            raise InvalidInput(f"{where}: rows have different lengths") from None
        if array.dtype.kind not in "iuf":  # bools, strings, objects, nulls
            raise InvalidInput(f"{where}: expected numbers, got {_json_kind(array)}")
        feature_rank = len(spec.shape) - 1
        if array.ndim == feature_rank:
            array, single = array[np.newaxis], True
        elif array.ndim == feature_rank + 1:
            single = False
        else:
            raise InvalidInput(
                f"{where}: array of shape {list(array.shape)} does not fit input {spec.name!r} of shape "
                f"{list(spec.shape)}: send one row of {list(spec.shape[1:])} or a list of such rows"
            )
        return _cast(array, spec, where), single


def _json_kind(array: np.ndarray) -> str:
    return {"b": "true/false", "U": "strings"}.get(array.dtype.kind, "non-numbers (null, objects or mixed values)")


def _cast(array: np.ndarray, spec: TensorSpec, where: str) -> np.ndarray:
    target = DATATYPE_TO_NUMPY[spec.datatype]
    if target.kind == "f":
        return array.astype(target)
    if target.kind == "b":
        if array.dtype.kind in "iu" and bool(np.all((array == 0) | (array == 1))):
            return array != 0
        raise InvalidInput(f"{where}: input {spec.name!r} is BOOL: send 0 or 1")
    if target.kind in "iu":
        if array.dtype.kind == "f" and not bool(np.all(np.isfinite(array) & (array == np.floor(array)))):
            raise InvalidInput(f"{where}: input {spec.name!r} is {spec.datatype}: send integers")
        info = np.iinfo(target)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise InvalidInput(f"{where}: values out of range [{info.min}, {info.max}] for {spec.datatype}")
        return array.astype(target)
    raise InvalidInput(f"{where}: input {spec.name!r} of datatype {spec.datatype} cannot be fed from a stream")


def _jsonable(array: np.ndarray) -> Any:
    if array.dtype.kind == "O":
        flat = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
        return np.array(flat, dtype=object).reshape(array.shape).tolist()
    return array.tolist()


# --------------------------------------------------------------------------- publish tracking


class _PublishTracker:
    """Futures that resolve when paho reports a publish as sent (on_publish).

    on_publish may run on paho's thread before publish() has even returned our mid, so a mid that
    completes before anyone waits on it is remembered in `early` and consumed by the waiter. Every
    mid is either waited on or forgotten, so neither table grows.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._early: dict[int, bool] = {}
        self._ignored: set[int] = set()

    def wait(self, loop: asyncio.AbstractEventLoop, mid: int) -> asyncio.Future:
        future = loop.create_future()
        with self._lock:
            self._ignored.discard(mid)  # a new publish reuses the mid of one that never completed
            ok = self._early.pop(mid, None)
            if ok is None:
                self._waiters[mid] = (loop, future)
                return future
        future.set_result(ok)
        return future

    def done(self, mid: int, ok: bool) -> None:
        """Called on paho's thread."""
        with self._lock:
            if mid in self._ignored:
                self._ignored.discard(mid)
                return
            entry = self._waiters.pop(mid, None)
            if entry is None:
                self._early[mid] = ok
                return
        loop, future = entry
        try:
            loop.call_soon_threadsafe(_resolve, future, ok)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def forget(self, mid: int, pending: bool = True) -> None:
        """Nobody will wait for `mid`; `pending`: its on_publish may still come (ignore it then)."""
        with self._lock:
            self._waiters.pop(mid, None)
            if self._early.pop(mid, None) is None and pending:
                self._ignored.add(mid)


class _Inbox:
    """Bookkeeping of the messages taken from the broker and not answered yet: their bytes (each
    counted as its payload plus MESSAGE_OVERHEAD_BYTES of Python objects) and how many are QoS 0.

    paho's thread admits, the event loop releases; a lock keeps the two consistent.
    """

    def __init__(self, max_bytes: int, max_qos0: int):
        self._lock = threading.Lock()
        self.max_bytes = max_bytes
        self.max_qos0 = max_qos0
        self.bytes = 0
        self.count = 0
        self.qos0 = 0

    def admit(self, qos: int, cost: int) -> bool:
        """Take a message of `cost` bytes. A QoS 0 message needs one of max_pending places; a QoS 1/2
        message needs room in max_bytes (an empty inbox always takes one, however large)."""
        with self._lock:
            if qos == 0:
                if self.qos0 >= self.max_qos0:
                    return False
                self.qos0 += 1
            elif self.count and self.bytes + cost > self.max_bytes:
                return False
            self.bytes += cost
            self.count += 1
            return True

    def release(self, qos: int, cost: int) -> None:
        with self._lock:
            self.bytes -= cost
            self.count -= 1
            if qos == 0:
                self.qos0 -= 1


@dataclass(eq=False)
class _Held:
    """A message in the inbox: where it came from and when, for its deadline (times are
    time.monotonic(), which is also the event loop's clock)."""

    msg: MQTTMessage
    generation: int  # the connection it arrived on
    cost: int
    expiry_s: int | None  # the MQTT 5 Message Expiry Interval left when it arrived
    received: float  # when paho handed it over
    started: float = 0.0  # when it left the inbox to be answered


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


# --------------------------------------------------------------------------- transport


class MqttTransport:
    """Serves a Runtime over MQTT. ``async with MqttTransport(settings, runtime): ...`` or
    ``await start()`` ... ``pause()`` ... ``await stop()``.

    The constructor validates the settings (ConfigError naming the key); ``start`` checks the
    stream mappings against the loaded models, then connects in the background: a broker that is
    away is retried with backoff while the rest of the daemon serves.
    """

    def __init__(self, settings: MqttSettings, runtime: Runtime, *, source: str | None = None):
        src = source if source is not None else getattr(runtime.config, "source", "")
        where = f"{src}: [mqtt]" if src else "[mqtt]"
        validate_settings(settings, where)
        self.settings = settings
        self.runtime = runtime
        self._where = where
        self.device_id = settings.device_id or socket.gethostname()
        self.client_id = settings.client_id or default_client_id(self.device_id, runtime.config)
        self.prefix = settings.topic_prefix or f"edge-batcher/{self.device_id}"
        self._infer_filter = f"{self.prefix}/infer/+"
        self._password = self._read_password()
        self._routes: list[StreamRoute] = []
        self._client: Client | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox = _Inbox(settings.max_held_bytes, settings.max_pending)
        self._waiting: collections.deque[_Held] = collections.deque()  # in the inbox, not started yet
        self._active = 0  # messages being answered (at most max_pending)
        self._tracker = _PublishTracker()
        self._tasks: set[asyncio.Task] = set()
        self._connect_properties: Properties | None = None
        self._session_resumed = False
        self._deferred_generation: int | None = None  # a connection on which messages were left for redelivery
        self._refetch: asyncio.Task | None = None
        self._refetching = False
        self._last_queue_warning = 0.0
        self._last_takeover_log = -LOG_INTERVAL_S
        self._connected: asyncio.Event | None = None
        self._state = "disconnected"
        self._generation = 0  # bumped on every successful CONNACK (paho's thread)
        self._subscribe_mid: int | None = None
        self._connect_failures = 0
        self._accepting = False
        self._stopping = False
        self._counts = {"requests": 0, "stream_messages": 0, "answered": 0, "errors": 0, "rejected": 0,
                        "redelivered": 0, "unacked": 0, "deferred": 0, "superseded": 0, "refetches": 0,
                        "overload_waits": 0, "expired": 0, "replies_dropped": 0}  # fmt: skip

    # ------------------------------------------------------------------ public state

    @property
    def state(self) -> str:
        """Either "connected" (CONNACK and SUBACK received: serving) or "disconnected"."""
        return self._state

    @property
    def stats(self) -> dict[str, int]:
        """Counters: requests and stream_messages taken, answered (status 200), errors (error
        replies), rejected (QoS 0 answered 429 at the hand-off), redelivered (duplicates flagged by
        the broker), unacked (left for redelivery), deferred (arrived with the inbox full, left
        unacked), superseded (waiting when the connection was lost; the broker sends them again),
        refetches (reconnects made to get deferred messages back), overload_waits (a model's full
        queue made a QoS 1/2 request wait), expired (504 after waiting past their deadline),
        replies_dropped (429 replies to QoS 0 requests that paho could not queue); plus held and
        held_bytes: the inbox now."""
        return {**self._counts, "held": self._inbox.count, "held_bytes": self._inbox.bytes}

    @property
    def subscriptions(self) -> list[str]:
        filters = [self._infer_filter, *dict.fromkeys(r.filter for r in self._routes)]
        if self.settings.shared_group:
            return [f"$share/{self.settings.shared_group}/{f}" for f in filters]
        return filters

    async def wait_connected(self, timeout: float | None = None) -> bool:
        """Wait until connected and subscribed; False when `timeout` passes first."""
        if self._connected is None:
            return False
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> MqttTransport:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        s = self.settings
        self._loop = loop = asyncio.get_running_loop()
        self._connected = asyncio.Event()
        self._routes = [self._compile(m, f"{self._where} streams[{i}]") for i, m in enumerate(s.streams)]
        self._client = client = self._make_client()
        self._accepting = True
        self._stopping = False
        properties = Properties(PacketTypes.CONNECT)
        properties.SessionExpiryInterval = s.session_expiry_s
        # MQTT 5 flow control: the broker sends at most max_pending unacked QoS 1/2 messages and
        # keeps the rest queued for us (a backlog after a restart drains at our pace instead of
        # being answered 429). QoS 0 has no such bound: the 429 hand-off covers it.
        properties.ReceiveMaximum = min(s.max_pending, 65535)
        self._connect_properties = properties
        connect = functools.partial(
            client.connect, s.host, s.port, keepalive=s.keepalive_s, clean_start=False, properties=properties
        )
        log.info("MQTT: connecting to %s:%d as %s (topics under %s/, qos %d%s)", s.host, s.port, self.client_id,
                 self.prefix, s.qos, f", shared group {s.shared_group}" if s.shared_group else "")
        try:
            # connect() resolves the host name and opens the TCP (and TLS) connection: it can block
            # for seconds, so it runs on a worker thread instead of stalling the event loop.
            await loop.run_in_executor(None, connect)
        except (OSError, ValueError) as exc:  # refused, unreachable, DNS, TLS handshake
            log.warning("MQTT: broker %s:%d not reachable (%s); retrying every %g-%g s in the background, "
                        "the Unix socket serves meanwhile", s.host, s.port, exc, s.reconnect_min_s, s.reconnect_max_s)
            self._connect_failures = 1
            client.connect_async(s.host, s.port, keepalive=s.keepalive_s, clean_start=False, properties=properties)
        client.loop_start()  # paho's own network thread: reads, writes, keepalive, reconnects

    def pause(self) -> None:
        """Take no new messages: anything the broker sends from now on stays unacked and is
        redelivered after the restart (the daemon calls this when it starts draining)."""
        self._accepting = False
        self._stopping = True

    async def stop(self, timeout: float = STOP_GRACE_S) -> None:
        """Pause, give replies in flight `timeout` seconds, disconnect, stop paho's thread.

        Subscriptions are *not* removed: they belong to the persistent session, and removing them
        would make the broker drop the requests published while we restart."""
        self.pause()
        self._drop_waiting("stopping")
        if self._refetch is not None:
            await asyncio.wait({self._refetch}, timeout=timeout)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        left = list(self._tasks)
        for task in left:
            task.cancel()  # its request stays unacked: the broker redelivers it
        await asyncio.gather(*left, return_exceptions=True)
        client, self._client = self._client, None
        if client is None:
            return
        client.disconnect()
        # loop_stop() joins paho's thread (which exits once the DISCONNECT is out): a blocking wait.
        await asyncio.get_running_loop().run_in_executor(None, client.loop_stop)
        self._state = "disconnected"
        log.info("MQTT: stopped (%s)", ", ".join(f"{k} {v}" for k, v in self._counts.items()))

    # ------------------------------------------------------------------ setup

    def _read_password(self) -> str | None:
        s = self.settings
        if s.password_file:
            try:
                with open(s.password_file, encoding="utf-8") as fh:
                    return fh.read().rstrip("\r\n")
            except OSError as exc:
                raise ConfigError(f"{self._where} password_file: cannot read {s.password_file}: {exc.strerror}") from None
        return s.password or None

    def _compile(self, m: StreamMapping, where: str) -> StreamRoute:
        try:
            runner = self.runtime.runner(m.model)
        except EdgeBatcherError as exc:
            raise ConfigError(f"{where} model: {exc.message}") from None
        specs = {spec.name: spec for spec in runner.inputs}
        if m.input and m.input not in specs:
            raise ConfigError(f"{where} input: model {m.model!r} has no input {m.input!r}; its inputs are {', '.join(specs)}")
        if len(specs) != 1:  # every input is required, and a stream message fills exactly one
            raise ConfigError(f"{where} model: a stream fills one input, but {m.model!r} needs {', '.join(specs)}")
        (spec,) = specs.values()
        if spec.datatype == "BYTES":
            raise ConfigError(f"{where} model: input {spec.name!r} is BYTES; streams carry numbers")
        if m.encoding == "raw" and any(d < 0 for d in spec.shape[1:]):
            raise ConfigError(
                f"{where} encoding: raw needs a fixed row shape, but input {spec.name!r} is {list(spec.shape)}; use json"
            )
        labels = list(runner.config.labels)
        return StreamRoute(m.topic, m.topic.split("/"), m.model, spec, m.encoding, m.output_topic, labels)

    def _make_client(self) -> Client:
        s = self.settings
        client = Client(
            CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=MQTTProtocolVersion.MQTTv5, manual_ack=True
        )
        paho_log = logging.getLogger(f"{__name__}.paho")
        if not any(isinstance(f, _QuietRetries) for f in paho_log.filters):
            paho_log.addFilter(_QuietRetries())
        client.enable_logger(paho_log)
        client.suppress_exceptions = True  # a bug in a callback is logged, never kills paho's thread
        client.max_inflight_messages_set(s.max_inflight)
        client.max_queued_messages_set(s.max_queued)  # bounded: 0 would be unbounded
        client.reconnect_delay_set(s.reconnect_min_s, s.reconnect_max_s)
        if s.username:
            client.username_pw_set(s.username, self._password)
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
        client.on_socket_open = tcp_no_delay
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        return client

    # ------------------------------------------------------------------ paho callbacks (paho's thread: never block)

    def _on_connect(self, client: Client, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        s = self.settings
        if reason_code.is_failure:
            log.error("MQTT: broker %s:%d refused the connection: %s (reason code %d)", s.host, s.port,
                      reason_code, reason_code.value)
            return
        self._generation += 1
        self._session_resumed = bool(flags.session_present)
        self._connect_failures = 0
        log.info("MQTT: connected to %s:%d (%s session)", s.host, s.port,
                 "resumed" if flags.session_present else "new")
        if flags.session_present:  # what waits from the last connection is on its way again
            self._call_on_loop(self._drop_waiting, "superseded")
        # Subscribing again is harmless when the session was resumed, and needed when it was not.
        _, self._subscribe_mid = client.subscribe([(f, s.qos) for f in self.subscriptions])

    def _on_subscribe(self, client: Client, userdata: Any, mid: int, reason_codes: list, properties: Any) -> None:
        if mid != self._subscribe_mid:
            return
        failed = [f"{f} ({rc})" for f, rc in zip(self.subscriptions, reason_codes) if rc.is_failure]
        if failed:
            log.error("MQTT: the broker refused subscriptions: %s", ", ".join(failed))
        log.info("MQTT: subscribed to %s", ", ".join(self.subscriptions))
        self._state = "connected"
        self._signal(True)

    def _on_connect_fail(self, client: Client, userdata: Any) -> None:
        s = self.settings
        self._connect_failures += 1
        n = self._connect_failures
        if n == 1 or n % 10 == 0:
            log.warning("MQTT: cannot reach broker %s:%d (%d attempt(s)); retrying with backoff %g-%g s",
                        s.host, s.port, n, s.reconnect_min_s, s.reconnect_max_s)

    def _on_disconnect(self, client: Client, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        was = self._state
        self._state = "disconnected"
        self._signal(False)
        if self._stopping or self._refetching:
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

    def _on_message(self, client: Client, userdata: Any, msg: MQTTMessage) -> None:
        if not self._accepting:
            return  # stopping: left unacked, the broker redelivers it
        cost = len(msg.payload) + MESSAGE_OVERHEAD_BYTES
        if not self._inbox.admit(msg.qos, cost):
            if msg.qos == 0:
                self._reject_overloaded(msg)  # nothing will redeliver it: say so at once
            else:
                self._defer(msg)
            return
        held = _Held(msg, self._generation, cost, getattr(msg.properties, "MessageExpiryInterval", None),
                     time.monotonic())
        if not self._call_on_loop(self._arrive, held):
            self._inbox.release(msg.qos, cost)

    def _on_publish(self, client: Client, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        if reason_code.is_failure:
            log.warning("MQTT: the broker refused a reply (mid %d): %s", mid, reason_code)
        self._tracker.done(mid, True)

    def _defer(self, msg: MQTTMessage) -> None:
        """A QoS 1/2 message with the inbox full (a broker sending past Receive Maximum): leave it
        unacked. The broker sends it again on the next connection, which _refetch_deferred makes
        once the inbox is empty."""
        self._counts["deferred"] += 1
        if self._deferred_generation != self._generation:
            self._deferred_generation = self._generation
            log.warning("MQTT: the broker sends more than the inbox holds (max_held_bytes %d, %d messages held): "
                        "leaving the excess unacknowledged, to be fetched again by a reconnect once the inbox is empty",
                        self.settings.max_held_bytes, self._inbox.count)

    def _reject_overloaded(self, msg: MQTTMessage) -> None:
        """A QoS 0 message with max_pending QoS 0 messages already taken: answer 429 now. Runs on
        paho's thread, so it only queues the reply (non-blocking); the payload is not parsed, so the
        reply carries the Correlation Data but not the v2 id. A reply paho cannot queue is dropped
        and counted: QoS 0 promises nothing more."""
        self._counts["rejected"] += 1
        try:
            route = self._route(msg.topic)
            if route is None:
                return  # a stale subscription
            error = Overloaded(
                f"overloaded: {self.settings.max_pending} QoS 0 messages are already pending on {self.device_id}; "
                f"retry later, or publish with QoS 1 to be served late instead"
            )
            topic, payload, properties = self._error_reply(msg, route, error, None)
            info = self._client.publish(topic, payload, qos=self.settings.qos, properties=properties)
            # Not waited for (paho's thread must not wait); on_publish is still coming unless
            # the publish was refused outright.
            pending = info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS or (
                info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN and self.settings.qos > 0)
            self._tracker.forget(info.mid, pending)
            if not pending:
                self._counts["replies_dropped"] += 1
        except Exception:
            log.exception("MQTT: could not reject a message on %s", msg.topic)

    # ------------------------------------------------------------------ event loop side

    def _signal(self, connected: bool) -> None:
        event, loop = self._connected, self._loop
        if event is None or loop is None:
            return
        try:
            loop.call_soon_threadsafe(event.set if connected else event.clear)
        except RuntimeError:
            pass

    def _call_on_loop(self, callback, *args) -> bool:
        """From paho's thread; False when the event loop is closed (we are going away)."""
        loop = self._loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            return False
        return True

    def _arrive(self, held: _Held) -> None:
        if not self._accepting:
            self._inbox.release(held.msg.qos, held.cost)  # left unacked: the next daemon (or we, restarted) answers it
            return
        self._waiting.append(held)
        self._start_waiting()

    def _start_waiting(self) -> None:
        while self._waiting and self._active < self.settings.max_pending:
            held = self._waiting.popleft()
            held.started = time.monotonic()
            self._active += 1
            task = self._loop.create_task(self._handle(held))
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._finished, held))

    def _finished(self, held: _Held, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._active -= 1
        self._inbox.release(held.msg.qos, held.cost)
        self._start_waiting()
        self._maybe_refetch()

    def _drop_waiting(self, why: str) -> None:
        """Forget the messages not started yet, unacked: on a resumed session ("superseded") the
        broker sends those of earlier connections again; when "stopping" the next daemon gets them."""
        kept: collections.deque[_Held] = collections.deque()
        for held in self._waiting:
            if why == "superseded" and (held.generation == self._generation or held.msg.qos == 0):
                kept.append(held)  # QoS 0 is never sent again: answer it still
                continue
            self._inbox.release(held.msg.qos, held.cost)
            if why == "superseded":
                self._counts["superseded"] += 1
        self._waiting = kept

    def _maybe_refetch(self) -> None:
        """Messages were deferred on this connection and the inbox is empty now: reconnect, so the
        broker sends them again (MQTT redelivers unacked messages only on a new connection)."""
        if (self._deferred_generation != self._generation or self._inbox.count or self._refetch is not None
                or not self._accepting or self._client is None):
            return
        self._refetch = self._loop.create_task(self._refetch_deferred())

    async def _refetch_deferred(self) -> None:
        client, s = self._client, self.settings
        self._counts["refetches"] += 1
        log.info("MQTT: reconnecting to receive the messages left unacknowledged while the inbox was full "
                 "(%d deferred so far)", self._counts["deferred"])
        self._refetching = True
        try:
            client.disconnect()  # queued after every reply and ack already written
            await self._loop.run_in_executor(None, client.loop_stop)
            if self._client is client and self._accepting:
                client.connect_async(s.host, s.port, keepalive=s.keepalive_s, clean_start=False,
                                     properties=self._connect_properties)
                client.loop_start()
        finally:
            self._refetching = False
            self._refetch = None

    def _route(self, topic: str) -> tuple[str, Any] | None:
        """("infer", model) for <prefix>/infer/<model>, ("stream", StreamRoute), or None."""
        if topic_matches_sub(self._infer_filter, topic):
            return "infer", topic[len(self.prefix) + len("/infer/"):]
        for route in self._routes:
            if topic_matches_sub(route.filter, topic):
                return "stream", route
        return None

    async def _handle(self, held: _Held) -> None:
        msg = held.msg
        if msg.dup:
            self._counts["redelivered"] += 1
        route = self._route(msg.topic)
        try:
            if route is None:
                # A subscription left in the persistent session by an older configuration.
                log.warning("MQTT: no request route or stream matches %s; dropping the message", msg.topic)
                self._ack(msg, held.generation)
                return
            if route[0] == "infer":
                self._counts["requests"] += 1
                topic, payload, properties = await self._answer_request(held, route)
            else:
                self._counts["stream_messages"] += 1
                topic, payload, properties = await self._answer_stream(held, route)
        except _LeaveUnacked:
            self._counts["unacked"] += 1
            return
        if await self._publish(topic, payload, properties):
            self._ack(msg, held.generation)
        else:
            self._counts["unacked"] += 1

    async def _infer(self, request: InferRequest, held: _Held) -> Any:
        """Runtime.infer within the message's deadline (see _deadline). A QoS 1/2 request that finds
        the model's queue full waits for room instead of being answered 429: its sender asked for
        delivery, and the broker holds the rest of the backlog meanwhile."""
        if request.timeout_s is not None and request.timeout_s <= 0:
            return await self.runtime.infer(request)  # the runner's own 504 names the timeout
        deadline, what = self._deadline(request, held)
        delay, longest = OVERLOAD_RETRY_S
        while True:
            left = request.timeout_s = self._time_left(deadline, what)
            try:
                return await self.runtime.infer(request)
            except Overloaded:
                if held.msg.qos == 0:
                    raise
            self._counts["overload_waits"] += 1
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, longest)

    def _deadline(self, request: InferRequest, held: _Held) -> tuple[float, str]:
        """When the request must be answered, and what set that. Its timeout counts from when it
        left the inbox: a message waits there only because the broker sent past our Receive
        Maximum, and would otherwise have waited at the broker. Its Message Expiry Interval
        counts from its arrival, as the broker would have counted it."""
        batching = self.runtime.runner(request.model).config.batching
        timeout = batching.default_timeout_ms / 1000.0 if request.timeout_s is None else request.timeout_s
        timeout = min(timeout, batching.max_timeout_ms / 1000.0)
        deadline, what = held.started + timeout, f"timeout of {timeout * 1000:.0f} ms"
        if held.expiry_s is not None and held.received + held.expiry_s < deadline:
            deadline, what = held.received + held.expiry_s, f"message expiry interval of {held.expiry_s} s"
        return deadline, what

    def _time_left(self, deadline: float, what: str) -> float:
        """Seconds left until `deadline`; DeadlineExceeded (504) when none are."""
        left = deadline - time.monotonic()
        if left <= 0:
            self._counts["expired"] += 1
            raise DeadlineExceeded(f"not answered within its {what}: it waited on {self.device_id}")
        return left

    async def _answer_request(self, held: _Held, route: tuple[str, Any]) -> tuple[str, bytes, Properties]:
        msg, model = held.msg, route[1]
        payload = msg.payload
        header_length = None
        request_id = None
        try:
            header_length = _header_length(msg)
            if not payload:
                raise InvalidInput("empty payload: expected a KServe v2 inference request (JSON)")
            if len(payload) > DECODE_OFF_LOOP_BYTES:  # would hold the loop for milliseconds
                decoded = await asyncio.get_running_loop().run_in_executor(None, v2.decode_request, payload, header_length)
            else:
                decoded = v2.decode_request(payload, header_length)
            request_id = decoded.id
            request = to_infer_request(model, decoded)
            if decoded.parameters.get("stream") is True:
                response = await self._stream_chunks(held, model, request)
            else:
                response = await self._infer(request, held)
            binary = v2.binary_outputs_for(decoded, list(response.outputs))
            body, json_length = v2.encode_response(model, response.id, response.outputs, binary=binary,
                                                   parameters=response.parameters or None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = self._error(exc, f"request on {msg.topic}")
            self._counts["errors"] += 1
            if request_id is None:
                request_id = _peek_id(payload, header_length)
            return self._error_reply(msg, route, error, request_id)
        self._counts["answered"] += 1
        properties = self._reply_properties(msg, 200, BINARY if json_length is not None else JSON)
        if json_length is not None:
            properties.UserProperty.append((v2.HEADER_LENGTH, str(json_length)))
        return self._reply_topic(msg, model), body, properties

    async def _stream_chunks(self, held: _Held, model: str, request: InferRequest) -> Any:
        """A streaming model (rag, generator) with parameters.stream = true: publish every chunk
        but the last at once, each with the request's Correlation Data and
        parameters.triton_final_response = false; the last is returned and published (and the
        request acked) like any reply."""
        msg = held.msg
        runner = self.runtime.runner(model)
        if not hasattr(runner, "stream"):
            raise InvalidInput(f"model {model!r} does not stream tokens; leave out parameters.stream")
        if request.timeout_s is None or request.timeout_s > 0:
            request.timeout_s = self._time_left(*self._deadline(request, held))
        previous = None
        async for chunk in runner.stream(request):
            if previous is not None:
                body, _ = v2.encode_response(model, previous.id, previous.outputs, parameters=previous.parameters or None)
                await self._publish(self._reply_topic(msg, model), body, self._reply_properties(msg, 200, JSON))
            previous = chunk
        if previous is None:
            raise InvalidInput(f"model {model!r} produced no output for this request")
        return previous

    async def _answer_stream(self, held: _Held, route: tuple[str, Any]) -> tuple[str, bytes, Properties]:
        msg, stream = held.msg, route[1]
        try:
            array, single = stream.decode(msg.payload, f"stream {msg.topic}")
            response = await self._infer(InferRequest(model=stream.model, inputs={stream.input.name: array}), held)
            outputs = {name: out[0] if single else out for name, out in response.outputs.items()}
            result: dict[str, Any] = {
                "topic": msg.topic,
                "model": stream.model,
                "outputs": {name: _jsonable(out) for name, out in outputs.items()},
            }
            labels = _labels(outputs, stream.labels)
            if labels:
                result["labels"] = labels
            body = json.dumps(result, separators=(",", ":")).encode()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = self._error(exc, f"stream message on {msg.topic}")
            self._counts["errors"] += 1
            return self._error_reply(msg, route, error, None)
        self._counts["answered"] += 1
        return stream.output_topic(msg.topic, self.prefix), body, self._reply_properties(msg, 200, JSON)

    def _error(self, exc: Exception, what: str) -> EdgeBatcherError:
        if isinstance(exc, Unavailable) and self._stopping:
            raise _LeaveUnacked() from exc  # draining: the next daemon (or we, restarted) answers it
        if isinstance(exc, EdgeBatcherError):
            return exc
        log.exception("MQTT: unhandled error on %s", what)
        return EdgeBatcherError(f"internal error: {type(exc).__name__}: {exc}")

    def _error_reply(
        self, msg: MQTTMessage, route: tuple[str, Any], error: EdgeBatcherError, request_id: str | None
    ) -> tuple[str, bytes, Properties]:
        """The reply for a failed message: on the request's reply topic, or the stream's output topic."""
        body: dict[str, Any] = {"error": error.message}
        if route[0] == "infer":
            topic = self._reply_topic(msg, route[1])
            if request_id is not None:
                body["id"] = request_id
        else:
            topic = route[1].output_topic(msg.topic, self.prefix)
            body = {"topic": msg.topic, **body}
        status = error.status
        return topic, json.dumps(body).encode(), self._reply_properties(msg, status, JSON)

    def _reply_topic(self, msg: MQTTMessage, model: str) -> str:
        topic = getattr(msg.properties, "ResponseTopic", None)
        return topic or f"{self.prefix}/result/{model}"

    def _reply_properties(self, msg: MQTTMessage, status: int, content_type: str) -> Properties:
        properties = Properties(PacketTypes.PUBLISH)
        correlation = getattr(msg.properties, "CorrelationData", None)
        if correlation is not None:
            properties.CorrelationData = correlation
        properties.ContentType = content_type
        properties.UserProperty = [(STATUS_PROPERTY, str(status))]
        return properties

    async def _publish(self, topic: str, payload: bytes, properties: Properties) -> bool:
        """Publish and wait until paho reports it sent (QoS 1: the broker's PUBACK). False when
        the reply could not be queued: its request is then left unacked for redelivery."""
        qos = self.settings.qos
        while True:
            client = self._client
            if client is None:
                return False
            try:
                info: MQTTMessageInfo = client.publish(topic, payload, qos=qos, properties=properties)
            except ValueError as exc:  # e.g. a response topic with wildcards: resending will not help
                log.warning("MQTT: cannot publish the reply to %r: %s; dropping it", topic, exc)
                return True
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
        sent = self._tracker.wait(asyncio.get_running_loop(), info.mid)
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(sent), PUBLISH_RECHECK_S)
                except asyncio.TimeoutError:
                    # Slow (a reconnect), or a missed on_publish for a reused mid: paho's own flag says.
                    if _is_published(info):
                        self._tracker.forget(info.mid, pending=False)
                        return True
        except asyncio.CancelledError:
            self._tracker.forget(info.mid)
            raise

    def _ack(self, msg: MQTTMessage, generation: int) -> None:
        if msg.qos == 0 or self._client is None:
            return
        if generation != self._generation:
            return  # it arrived on an earlier connection: the broker redelivers it on this one
        self._client.ack(msg.mid, msg.qos)


# --------------------------------------------------------------------------- helpers


def default_client_id(device_id: str, config: DaemonConfig) -> str:
    """``edge-batcher-<device id>-<8 hex digits of the Unix socket's path>``. The socket path tells
    daemons on one host apart (two cannot share it), so the service and a bench run beside it do
    not take each other's session, while a restarted daemon finds its persistent session again."""
    path = str(config.socket_path())
    return f"edge-batcher-{device_id}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


def tcp_no_delay(client: Client, userdata: Any, sock: Any) -> None:
    """paho leaves Nagle's algorithm on: a reply written while the previous packet waits for its TCP
    ACK would then sit out the peer's delayed ACK (40 ms on Linux). Small packets go out at once."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):  # not a TCP socket (e.g. a websocket wrapper)
        pass


def _is_published(info: MQTTMessageInfo) -> bool:
    try:
        return info.is_published()
    except (ValueError, RuntimeError):  # rc records a failure (or NO_CONN: queued for the reconnect)
        return False


def _header_length(msg: MQTTMessage) -> int | None:
    """Inference-Header-Content-Length from the user properties; required for a binary request."""
    value = None
    for name, val in getattr(msg.properties, "UserProperty", None) or []:
        if name.lower() == v2.HEADER_LENGTH.lower():
            value = val
    binary = getattr(msg.properties, "ContentType", None) == BINARY
    if value is None:
        if binary:
            raise InvalidInput(
                f"binary request (Content Type {BINARY}) without the user property {v2.HEADER_LENGTH} "
                f"giving the JSON header's length"
            )
        return None
    return v2.parse_header_length(value)


def _peek_id(payload: bytes, header_length: int | None) -> str | None:
    """The v2 id of a request that failed to decode, when its JSON header still parses."""
    try:
        header = json.loads(payload[:header_length] if header_length is not None else payload)
    except Exception:
        return None
    value = header.get("id") if isinstance(header, dict) else None
    return value if isinstance(value, str) else None


def _labels(outputs: dict[str, np.ndarray], labels: list[str]) -> dict[str, Any]:
    """Class names for integer outputs holding one class index per row (argmax-style class_id)."""
    if not labels:
        return {}
    named: dict[str, Any] = {}
    for name, out in outputs.items():
        if out.dtype.kind not in "iu" or out.ndim > 1 or out.size == 0:
            continue
        if out.min() < 0 or out.max() >= len(labels):
            continue
        named[name] = labels[int(out)] if out.ndim == 0 else [labels[int(i)] for i in out]
    return named
