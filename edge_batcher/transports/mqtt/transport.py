"""MqttTransport: serves a Runtime over MQTT. It admits each message as paho reads it to a
bounded inbox, answers it on the event loop (at most ``max_pending`` at once: route, decode, infer
within the message's deadline, encode) and acknowledges a QoS 1/2 request only after its reply was
published, so that what it could not answer (inbox full, connection lost, daemon stopping) is sent
again by the broker. This is the MQTT edge of the error tree: an EdgeBatcherError becomes
``{"error": message}`` with its status in the "status" user property, anything unexpected a logged
500. docs/mqtt.md states the delivery guarantee and explains the flow ("Threads and internals").
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from typing import Any

from paho.mqtt.client import topic_matches_sub

from ...config import MqttSettings
from ...errors import DeadlineExceeded, EdgeBatcherError, InvalidInput, Overloaded, PayloadTooLarge, Unavailable
from ...protocol import v2
from ...protocol.parameters import to_infer_request
from ...runtime import Runtime
from ...types import InferRequest
from ..v2_decode import decode_request, peek_id
from . import replies
from .inbox import MESSAGE_OVERHEAD_BYTES, Held, Inbox
from .messages import Message, Reply
from .paho_client import PahoClient
from .replies import BINARY, JSON, Route
from .settings import default_client_id, read_password, validate_settings
from .streams import StreamRoute, compile_stream
from .undeliverable import ReplyRefused, ThrottledLog, UndeliverableReplies, reply_topic_problem

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0  # stop(): how long replies in flight may take before their requests are left unacked
OVERLOAD_RETRY_S = (0.002, 0.05)  # a QoS 1/2 request the model's queue refused: first and longest wait


class _LeaveUnacked(Exception):
    """The daemon is stopping and this request could not run: no reply, no ack, so the broker
    redelivers it to the next daemon (or to us after the restart)."""


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
        self._infer_topics = f"{self.prefix}/infer/"  # and one level more: what _infer_filter matches
        self._infer_filter = self._infer_topics + "+"
        self._password = read_password(settings, where)
        self._max_payload = runtime.config.server.max_body_bytes  # the limit of every transport's edge
        self._routes: list[StreamRoute] = []
        self._client: PahoClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox = Inbox(settings.max_held_bytes, settings.max_pending)
        self._active = 0  # messages being answered (at most max_pending)
        self._tasks: set[asyncio.Task] = set()
        self._deferred_connection: int | None = None  # a connection on which messages were left for redelivery
        self._refetch: asyncio.Task | None = None
        self._accepting = False
        self._stopping = False
        self._undeliverable = UndeliverableReplies(log, runtime.metrics.mqtt_undeliverable_total)
        self._throttled = ThrottledLog(log)  # what a client's messages make us say: once per topic per minute
        self._counts = {"requests": 0, "stream_messages": 0, "answered": 0, "errors": 0, "rejected": 0,
                        "redelivered": 0, "unacked": 0, "deferred": 0, "superseded": 0, "refetches": 0,
                        "overload_waits": 0, "expired": 0, "replies_dropped": 0}  # fmt: skip

    # ------------------------------------------------------------------ public state

    @property
    def state(self) -> str:
        """Either "connected" (CONNACK and SUBACK received: serving) or "disconnected"."""
        return self._client.state if self._client is not None else "disconnected"

    @property
    def stats(self) -> dict[str, int]:
        """Counters: requests and stream_messages taken, answered (status 200), errors (error
        replies), rejected (answered at the hand-off without running: 413 too large; 429 for load,
        503 while stopping, when nothing would send them again), redelivered (duplicates flagged by the
        broker), unacked (left for redelivery), deferred (arrived with the inbox full, left
        unacked), superseded (copies the broker sent again of messages still waiting in the
        inbox, adopted by those), refetches (reconnects made to get deferred messages back),
        overload_waits (a model's full queue made a QoS 1/2 request wait), expired (504 after
        waiting past their deadline), replies_dropped (hand-off replies that paho could not
        queue), undeliverable (acked and dropped: their reply was refused, or its topic takes
        none); plus held and held_bytes: the inbox now."""
        return {**self._counts, "undeliverable": self._undeliverable.count, "held": self._inbox.count,
                "held_bytes": self._inbox.bytes}

    @property
    def subscriptions(self) -> list[str]:
        filters = [self._infer_filter, *dict.fromkeys(r.filter for r in self._routes)]
        if self.settings.shared_group:
            return [f"$share/{self.settings.shared_group}/{f}" for f in filters]
        return filters

    async def wait_connected(self, timeout: float | None = None) -> bool:
        """Wait until connected and subscribed; False when `timeout` passes first."""
        if self._client is None:
            return False
        return await self._client.wait_connected(timeout)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> MqttTransport:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        s = self.settings
        self._loop = asyncio.get_running_loop()
        self._routes = [compile_stream(m, self.runtime, f"{self._where} streams[{i}]") for i, m in enumerate(s.streams)]
        self._client = PahoClient(s, client_id=self.client_id, password=self._password, where=self._where,
                                  subscriptions=self.subscriptions, on_message=self._on_message,
                                  on_session_resumed=self._session_resumed)
        self._accepting = True
        self._stopping = False
        log.info("MQTT: connecting to %s:%d as %s (topics under %s/, qos %d%s)", s.host, s.port, self.client_id,
                 self.prefix, s.qos, f", shared group {s.shared_group}" if s.shared_group else "")
        await self._client.connect()

    def pause(self) -> None:
        """Take no new messages: anything the broker sends from now on stays unacked and is
        redelivered after the restart (the daemon calls this when it starts draining)."""
        self._accepting = False
        self._stopping = True
        if self._client is not None:
            self._client.stopping = True

    async def stop(self, timeout: float = STOP_GRACE_S) -> None:
        """Pause, give replies in flight `timeout` seconds, disconnect.

        Subscriptions are *not* removed: they belong to the persistent session, and removing them
        would make the broker drop the requests published while we restart."""
        self.pause()
        self._drop_waiting()
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
        await client.close()
        log.info("MQTT: stopped (%s)", ", ".join(f"{k} {v}" for k, v in self.stats.items() if not k.startswith("held")))

    # ------------------------------------------------------------------ inside paho's reads (never block)

    def _on_message(self, msg: Message) -> None:
        if not self._accepting:
            if not self._sent_again_if_unacked(msg):
                self._refuse_now(msg, replies.stopping(self.device_id))
            return  # else left unacked: the broker sends it to the next daemon (or to us, restarted)
        if self._inbox.adopt(msg):  # the broker's copy of a message still waiting
            self._counts["superseded"] += 1
            return
        if len(msg.payload) > self._max_payload:  # answered unparsed; acked, since a redelivery would not fit either
            self._refuse_now(msg, PayloadTooLarge(f"payload too large: {len(msg.payload)} bytes, limit is "
                                                  f"{self._max_payload} bytes ([server] max_body_bytes)"))
            return
        cost = len(msg.payload) + MESSAGE_OVERHEAD_BYTES
        if not self._inbox.admit(msg.qos, cost):
            if self._sent_again_if_unacked(msg):
                self._defer(msg)
            else:
                self._refuse_now(msg, replies.overloaded(msg.qos, self.settings, self.device_id))
            return
        if not self._call_on_loop(self._arrive, Held(msg, cost, time.monotonic())):
            self._inbox.release(msg.qos, cost)

    def _session_resumed(self) -> None:
        """Called inside paho's read of the CONNACK, before any message of the new connection."""
        if self._client is not None:
            self._inbox.session_resumed(self._client.connection)

    def _defer(self, msg: Message) -> None:
        """A QoS 1/2 message with the inbox full (a broker sending past Receive Maximum): leave it
        unacked. The broker sends it again on the next connection, which _refetch_deferred makes
        once the inbox is empty."""
        self._counts["deferred"] += 1
        if self._deferred_connection != msg.connection:
            self._deferred_connection = msg.connection
            log.warning("MQTT: the broker sends more than the inbox holds (max_held_bytes %d, %d messages held): "
                        "leaving the excess unacknowledged, to be fetched again by a reconnect once the inbox is empty",
                        self.settings.max_held_bytes, self._inbox.count)

    def _sent_again_if_unacked(self, msg: Message) -> bool:
        """Would the broker send `msg` again if we left it unacked? A QoS 1/2 message with a
        persistent session: yes. QoS 0, or session_expiry_s = 0 (the session, and what it holds for
        us, ends with the connection): no, so such a message is answered instead."""
        return msg.qos > 0 and self.settings.session_expiry_s > 0

    def _refuse_now(self, msg: Message, error: EdgeBatcherError) -> None:
        """Answer a message at once without running it (a 413 too large; a 429 for load or a 503
        while stopping when nothing would send it again) and ack it. Safe inside paho's read: it
        only queues the reply and the ack; the payload is not parsed, so the reply carries the
        Correlation Data but not the v2 id. A reply paho cannot queue is dropped and counted."""
        self._counts["rejected"] += 1
        try:
            route = self._route(msg.topic)
            if route is None:
                return  # a stale subscription
            client = self._client
            if client is None:  # stopped
                return
            error = replies.bad_response_topic(msg) or error
            if not client.publish_nowait(replies.error(msg, route, error, None, self.prefix)):
                self._counts["replies_dropped"] += 1
            self._ack(msg)
        except Exception:
            log.exception("MQTT: could not refuse a message on %s", msg.topic)

    def _call_on_loop(self, callback, *args) -> bool:
        """Run callback on the event loop once paho's read in progress is done (paho calls back
        inside its reads, on the loop); False when the loop is closed (we are going away)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return False
        loop.call_soon(callback, *args)
        return True

    # ------------------------------------------------------------------ the inbox (event loop)

    def _arrive(self, held: Held) -> None:
        if not self._accepting:
            self._inbox.release(held.msg.qos, held.cost)
            if not self._sent_again_if_unacked(held.msg):
                self._refuse_now(held.msg, replies.stopping(self.device_id))
            return  # else left unacked: the next daemon (or we, restarted) answers it
        self._inbox.waiting.append(held)
        self._start_waiting()

    def _start_waiting(self) -> None:
        assert self._loop is not None  # start() set it; messages arrive only after that
        while self._inbox.waiting and self._active < self.settings.max_pending:
            held = self._inbox.next_waiting()
            held.started = time.monotonic()
            self._active += 1
            task = self._loop.create_task(self._handle(held))
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._finished, held))

    def _finished(self, held: Held, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._active -= 1
        self._inbox.release(held.msg.qos, held.cost)
        self._start_waiting()
        self._maybe_refetch()

    def _drop_waiting(self) -> None:
        """Stopping: forget the messages not started yet, unacked, for the next daemon; those that
        nothing would send again are answered 503."""
        while self._inbox.waiting:
            held = self._inbox.next_waiting()
            self._inbox.release(held.msg.qos, held.cost)
            if not self._sent_again_if_unacked(held.msg):
                self._refuse_now(held.msg, replies.stopping(self.device_id))

    def _maybe_refetch(self) -> None:
        """Messages were deferred on this connection and the inbox is empty now: reconnect, so the
        broker sends them again (MQTT redelivers unacked messages only on a new connection)."""
        client = self._client
        if (client is None or self._deferred_connection != client.connection or self._inbox.count
                or self._refetch is not None or not self._accepting):
            return
        assert self._loop is not None  # start() set it, as it did the client
        self._refetch = self._loop.create_task(self._refetch_deferred(client))

    async def _refetch_deferred(self, client: PahoClient) -> None:
        self._counts["refetches"] += 1
        log.info("MQTT: reconnecting to receive the messages left unacknowledged while the inbox was full "
                 "(%d deferred so far)", self._counts["deferred"])
        try:
            await client.reconnect()
        finally:
            self._refetch = None

    # ------------------------------------------------------------------ answering (event loop)

    def _route(self, topic: str) -> Route | None:
        """("infer", model) for <prefix>/infer/<model>, ("stream", StreamRoute), or None."""
        # The infer filter by hand: paho's topic_matches_sub builds a matcher per call (~4 us).
        infer = self._infer_topics
        if topic.startswith(infer) and "/" not in topic[len(infer):]:
            return "infer", topic[len(infer):]
        for route in self._routes:
            if topic_matches_sub(route.filter, topic):
                return "stream", route
        return None

    async def _handle(self, held: Held) -> None:
        msg = held.msg
        if msg.dup:
            self._counts["redelivered"] += 1
        route = self._route(msg.topic)
        if route is None:
            # A subscription left in the persistent session by an older configuration.
            self._throttled.warning(msg.topic, "MQTT: no request route or stream matches %s; dropping the message",
                                    msg.topic)
            self._ack(msg)
            return
        if self._undeliverable.refused_before(msg):  # sent again after its reply was refused
            self._ack(msg)
            return
        try:
            if route[0] == "infer":
                self._counts["requests"] += 1
                reply = await self._answer_request(held, route)
            else:
                self._counts["stream_messages"] += 1
                reply = await self._answer_stream(held, route)
            if self._undeliverable.refused_before(msg):  # an earlier copy's reply was refused meanwhile
                self._ack(msg)
                return
            sent = await self._publish(reply)
        except _LeaveUnacked:
            self._counts["unacked"] += 1
            return
        except ReplyRefused as exc:  # acked: left unacked, it would come back on every connection
            self._undeliverable.refused(msg, exc)
            self._ack(msg)
            return
        if sent:
            self._ack(msg)
        else:
            self._counts["unacked"] += 1

    async def _infer(self, request: InferRequest, held: Held) -> Any:
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

    def _deadline(self, request: InferRequest, held: Held) -> tuple[float, str]:
        """When the request must be answered, and what set that. Its timeout counts from when it
        left the inbox: a message waits there only because the broker sent past our Receive
        Maximum, and would otherwise have waited at the broker. Its Message Expiry Interval
        counts from its arrival, as the broker would have counted it."""
        batching = self.runtime.runner(request.model).config.batching
        timeout = batching.default_timeout_ms / 1000.0 if request.timeout_s is None else request.timeout_s
        timeout = min(timeout, batching.max_timeout_ms / 1000.0)
        deadline, what = held.started + timeout, f"timeout of {timeout * 1000:.0f} ms"
        expiry_s = held.msg.expiry_s
        if expiry_s is not None and held.received + expiry_s < deadline:
            deadline, what = held.received + expiry_s, f"message expiry interval of {expiry_s} s"
        return deadline, what

    def _time_left(self, deadline: float, what: str) -> float:
        """Seconds left until `deadline`; DeadlineExceeded (504) when none are."""
        left = deadline - time.monotonic()
        if left <= 0:
            self._counts["expired"] += 1
            raise DeadlineExceeded(f"not answered within its {what}: it waited on {self.device_id}")
        return left

    async def _answer_request(self, held: Held, route: Route) -> Reply:
        msg, model = held.msg, route[1]
        bad_topic = replies.bad_response_topic(msg)
        if bad_topic is not None:  # answered on the result topic, without decoding the request
            self._counts["errors"] += 1
            return replies.error(msg, route, bad_topic, None, self.prefix)
        payload = msg.payload
        header_length = None
        decoded = None
        try:
            header_length = replies.header_length(msg)
            if not payload:
                raise InvalidInput("empty payload: expected a KServe v2 inference request (JSON)")
            decoded = await decode_request(payload, header_length)
            request = to_infer_request(model, decoded, self.runtime.runner(model).config.batching.priority_levels)
            if decoded.parameters.get("stream") is True:
                response = await self._stream_chunks(held, model, request)
            else:
                response = await self._infer(request, held)
            binary = v2.binary_outputs_for(decoded, list(response.outputs))
            body, json_length = v2.encode_response(model, response.id, response.outputs, binary=binary,
                                                   parameters=response.parameters or None)
        except (asyncio.CancelledError, ReplyRefused):
            raise
        except Exception as exc:
            error = self._error(exc, msg, f"request on {msg.topic}")
            self._counts["errors"] += 1
            # Decoded: its id is known (or it has none). Not decoded: its JSON header may still name one.
            request_id = decoded.id if decoded is not None else await peek_id(payload, header_length)
            return replies.error(msg, route, error, request_id, self.prefix)
        self._counts["answered"] += 1
        if json_length is None:
            return replies.make(msg, replies.topic_for(msg, self.prefix, model), body, 200, JSON)
        return replies.make(msg, replies.topic_for(msg, self.prefix, model), body, 200, BINARY,
                           ((v2.HEADER_LENGTH, str(json_length)),))

    async def _stream_chunks(self, held: Held, model: str, request: InferRequest) -> Any:
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
                body, _ = v2.encode_response(model, previous.id, previous.outputs,
                                             parameters=previous.parameters or None)
                await self._publish(replies.make(msg, replies.topic_for(msg, self.prefix, model), body, 200, JSON))
            previous = chunk
        if previous is None:
            raise InvalidInput(f"model {model!r} produced no output for this request")
        return previous

    async def _answer_stream(self, held: Held, route: Route) -> Reply:
        msg, stream = held.msg, route[1]
        try:
            array, single = stream.decode(msg.payload, f"stream {msg.topic}")
            response = await self._infer(InferRequest(model=stream.model, inputs={stream.input.name: array}), held)
            body = stream.result(msg.topic, response.outputs, single)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = self._error(exc, msg, f"stream message on {msg.topic}")
            self._counts["errors"] += 1
            return replies.error(msg, route, error, None, self.prefix)
        self._counts["answered"] += 1
        return replies.make(msg, stream.output_topic(msg.topic, self.prefix), body, 200, JSON)

    def _error(self, exc: Exception, msg: Message, what: str) -> EdgeBatcherError:
        if isinstance(exc, Unavailable) and self._stopping and self._sent_again_if_unacked(msg):
            raise _LeaveUnacked() from exc  # draining: the next daemon (or we, restarted) answers it
        if isinstance(exc, EdgeBatcherError):
            return exc
        log.exception("MQTT: unhandled error on %s", what)
        return EdgeBatcherError(f"internal error: {type(exc).__name__}: {exc}")

    async def _publish(self, reply: Reply) -> bool:
        """True once the broker took the reply; False when it could not be queued (not connected
        with QoS 0, or stopped): its request is then left unacked for redelivery. ReplyRefused
        when the broker refused it, or its topic is one no broker takes (checked first: mosquitto
        may drop the connection over such a publish)."""
        problem = reply_topic_problem(reply.topic)
        if problem is not None:
            raise ReplyRefused(reply.topic, f"the topic {problem}")
        client = self._client
        return False if client is None else await client.publish(reply)

    def _ack(self, msg: Message) -> None:
        if self._client is not None:
            self._client.ack(msg)

