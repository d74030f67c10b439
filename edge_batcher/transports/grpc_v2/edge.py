"""The gRPC edge: the limits an HTTP request meets (transports/edge.py), in the order that keeps a
refused call cheap. grpcio itself gets them as options (`server_options`): the largest message,
connections per listener (a new one beyond is closed at once: UNAVAILABLE), idle_timeout_s to
finish the HTTP/2 handshake and to stay idle, no read-ahead past HTTP/2's 64 KiB window into a
message nobody reads yet (BDP probing grew it to 3.5 MB per unread call), and a backlog of calls
not yet handed over large enough that grpcio does not shed a burst itself (with CANCELLED and no
details). Every method is registered request-streaming so that `GrpcEdge` reads the message
itself, after the checks that need none of it: the calls in progress (RESOURCE_EXHAUSTED) and
the token on TCP (UNAUTHENTICATED); then a receive slot and body_timeout_s (UNAVAILABLE,
DEADLINE_EXCEEDED), the parse (INVALID_ARGUMENT, where grpcio said UNKNOWN and logged a
traceback) and the bytes charged to the shared budget until the method returns. An
EdgeBatcherError becomes the gRPC status of its HTTP status with the same message; anything else
is logged and answered INTERNAL; a call is aborted only once nothing references its message, so
a refused 15 MiB message is freed at once, not by some later garbage collection.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from ...errors import EdgeBatcherError, InvalidInput, Overloaded, RequestTimeout, Unauthorized
from ..edge import EdgeLimits
from ..v2_decode import DECODE_OFF_LOOP_BYTES

log = logging.getLogger(__name__)

# The error tree's HTTP statuses as gRPC status codes (as Triton and KServe map them).
GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
OPEN_METHODS = frozenset({"ServerLive"})  # liveness without a secret, as HTTP's /v2/health/live
UNIX_PREFIX = "unix:"
# Calls grpcio may hold before the daemon has seen them: a burst this large is still answered
# by the daemon (RESOURCE_EXHAUSTED), each holding at most its 64 KiB window meanwhile. grpcio's
# defaults shed calls at random from 1000 on, and all from 3000, with CANCELLED and no details.
MIN_BACKLOG = 3000
BACKLOG_PER_CALL = 4

Method = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def grpc_code(status: int) -> grpc.StatusCode:
    return GRPC_CODES.get(status, grpc.StatusCode.INTERNAL)


def server_options(limits: EdgeLimits) -> list[tuple[str, int]]:
    idle_ms = max(1, int(limits.idle_timeout_s * 1000))
    backlog = max(MIN_BACKLOG, BACKLOG_PER_CALL * limits.max_calls)
    return [
        ("grpc.max_receive_message_length", limits.max_body_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.max_allowed_incoming_connections", limits.grpc_connections),
        ("grpc.server_handshake_timeout_ms", idle_ms),
        ("grpc.max_connection_idle_ms", idle_ms),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.server.max_pending_requests", backlog),
        ("grpc.server.max_pending_requests_hard_limit", backlog),
    ]


@dataclass(frozen=True)
class _Refusal:
    code: grpc.StatusCode
    message: str


class GrpcEdge:
    """Wraps each RPC method in the edge's checks (one instance per server: it counts its calls)."""

    def __init__(self, limits: EdgeLimits):
        self.limits = limits
        self._token = limits.token.encode()
        self.calls = 0

    def method_handler(self, name: str, method: Method, request_type: Any) -> grpc.RpcMethodHandler:
        async def call(unread_messages: Any, context: grpc.aio.ServicerContext) -> Any:
            self.calls += 1
            try:
                outcome = await self._serve(name, method, request_type, context)
            finally:
                self.calls -= 1
            if isinstance(outcome, _Refusal):
                await context.abort(outcome.code, outcome.message)
            return outcome

        return grpc.stream_unary_rpc_method_handler(call, response_serializer=_serialize)

    async def _serve(self, name: str, method: Method, request_type: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if self.calls > self.limits.max_calls:
                raise Overloaded(f"too many calls in progress: the daemon's limit of {self.limits.max_calls} "
                                 "([server] max_connections) is reached; retry later")
            if name not in OPEN_METHODS:
                self._authorize(context)
            raw = await self._receive(context)
            with self.limits.budget.holding(len(raw), f"this message's {len(raw)} bytes"):
                request = await _parse(raw, request_type)
                del raw
                return await method(request, context)
        except EdgeBatcherError as exc:
            return _Refusal(grpc_code(exc.status), exc.message)
        except grpc.aio.AbortError:  # a method's own context.abort
            raise
        except Exception as exc:  # a bug, not bad input: keep serving, say what happened
            log.exception("unhandled error in gRPC %s", name)
            return _Refusal(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if context.peer().startswith(UNIX_PREFIX):
            return
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                # stripped first: perf_analyzer's -H "authorization: Bearer ..." sends " Bearer ..."
                scheme, _, given = (value if isinstance(value, str) else value.decode()).strip().partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token):
                    return
        raise Unauthorized("missing or invalid bearer token (gRPC metadata 'authorization: Bearer <token>')")

    async def _receive(self, context: grpc.aio.ServicerContext) -> bytes:
        """The call's one message, within body_timeout_s of asking for a receive slot."""
        budget = self.limits.budget
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget.timeout_s
        async with budget.receive_slot(budget.timeout_s):
            try:
                raw = await asyncio.wait_for(context.read(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise RequestTimeout(
                    f"request message not received within body_timeout_s {budget.timeout_s:g} s"
                ) from None
        if raw is grpc.aio.EOF:
            raise InvalidInput("the call carried no request message")
        return raw


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


async def _parse(raw: bytes, request_type: Any) -> Any:
    """The message from its bytes; a large one is parsed on a worker thread, off the event loop."""
    if len(raw) > DECODE_OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, _parse_now, raw, request_type)
    return _parse_now(raw, request_type)


def _parse_now(raw: bytes, request_type: Any) -> Any:
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        raise InvalidInput(f"the request is not a valid {request_type.DESCRIPTOR.full_name} message: {exc}") from None
