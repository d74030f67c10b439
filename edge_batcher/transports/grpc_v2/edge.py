"""The gRPC edge: the limits an HTTP request meets (transports/edge.py), in the order that keeps a
refused call cheap. A call is checked before its message is read (http2.py lets a client send at
most one 64 KiB stream window of it before): the method (UNIMPLEMENTED), the calls in progress
(RESOURCE_EXHAUSTED) and the token on TCP (UNAUTHENTICATED); then a receive slot and
body_timeout_s (UNAVAILABLE, DEADLINE_EXCEEDED), the message's size (RESOURCE_EXHAUSTED), the
parse (INVALID_ARGUMENT) and the bytes charged to the shared budget until the method returns. An
EdgeBatcherError becomes the gRPC status of its HTTP status with the same message; anything else
is logged and answered INTERNAL. Connections are counted per listener (`ConnectionCount`): one
beyond the listener's share of max_connections is closed at once.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf.message import DecodeError

from ...errors import EdgeBatcherError, InvalidInput, Overloaded, RequestTimeout, Unauthorized
from ..edge import EdgeLimits
from ..v2_decode import off_loop_if_large
from .call import Call, CallError, Status, StreamReset
from .http2 import GrpcConnection

log = logging.getLogger(__name__)

# The error tree's HTTP statuses as gRPC status codes (as Triton and KServe map them).
GRPC_CODES = {
    400: Status.INVALID_ARGUMENT,
    401: Status.UNAUTHENTICATED,
    404: Status.NOT_FOUND,
    408: Status.DEADLINE_EXCEEDED,
    413: Status.RESOURCE_EXHAUSTED,
    429: Status.RESOURCE_EXHAUSTED,
    503: Status.UNAVAILABLE,
    504: Status.DEADLINE_EXCEEDED,
    507: Status.RESOURCE_EXHAUSTED,
}
OPEN_METHODS = frozenset({"ServerLive"})  # liveness without a secret, as HTTP's /v2/health/live
UNIX_PREFIX = "unix:"
LIMIT_LOG_INTERVAL_S = 60.0

Method = Callable[[Any, Call], Awaitable[Any]]
# A method's request type that has it given the message's bytes (a view of the call's body) to
# parse with its own input-sized work: ModelInfer, one hop off the event loop instead of two.
RAW_MESSAGE: Any = object()


def grpc_code(status: int) -> Status:
    return GRPC_CODES.get(status, Status.INTERNAL)


class ConnectionCount:
    """One listener's open connections and its share of max_connections."""

    def __init__(self, limit: int):
        self.limit = limit
        self.open: set[GrpcConnection] = set()
        self.refused_total = 0
        self._logged_at = -LIMIT_LOG_INTERVAL_S

    def admit(self, conn: GrpcConnection) -> bool:
        if len(self.open) >= self.limit:
            self.refused_total += 1
            now = asyncio.get_running_loop().time()
            if now - self._logged_at >= LIMIT_LOG_INTERVAL_S:  # once a minute, never a line per connection
                self._logged_at = now
                log.warning("gRPC connection limit reached: %d open ([server] max_connections); new ones are "
                            "closed at once (%d so far)", self.limit, self.refused_total)
            return False
        self.open.add(conn)
        return True

    def closed(self, conn: GrpcConnection) -> None:
        self.open.discard(conn)


class GrpcEdge:
    """Serves each call through the edge's checks to its method (one per server: it counts calls)."""

    def __init__(self, limits: EdgeLimits, service: str, methods: dict[str, tuple[Method, Any]]):
        self.limits = limits
        self._token = limits.token.encode()
        self._methods = {f"/{service}/{name}": (name, method, request_type)
                         for name, (method, request_type) in methods.items()}
        self.calls = 0

    def dispatch(self, call: Call) -> None:
        call.task = asyncio.get_running_loop().create_task(self._handle(call))

    async def _handle(self, call: Call) -> None:
        self.calls += 1
        try:
            try:
                reply = await self._serve(call)
            except CallError as exc:
                call.conn.respond(call, exc.status, exc.message)
                return
            await call.conn.respond_with(call, reply)
        except (StreamReset, asyncio.CancelledError):
            pass  # the client reset the stream or left: no one to answer
        finally:
            self.calls -= 1

    async def _serve(self, call: Call) -> bytes:
        """The serialized response message; CallError for any other answer."""
        entry = self._methods.get(call.path)
        if entry is None:
            raise CallError(Status.UNIMPLEMENTED, f"Method not found: {call.path}")
        name, method, request_type = entry
        try:
            if self.calls > self.limits.max_calls:
                raise Overloaded(f"too many calls in progress: the daemon's limit of {self.limits.max_calls} "
                                 "([server] max_connections) is reached; retry later")
            if name not in OPEN_METHODS:
                self._authorize(call)
            raw = await self._receive(call)
            with self.limits.budget.holding(len(raw), f"this message's {len(raw)} bytes"):
                # a RAW_MESSAGE method parses the bytes along with its own work
                request = raw if request_type is RAW_MESSAGE else await _parse(raw, request_type)
                del raw
                return (await method(request, call)).SerializeToString()
        except EdgeBatcherError as exc:
            raise CallError(grpc_code(exc.status), exc.message) from None
        except (CallError, StreamReset, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug, not bad input: keep serving, say what happened
            log.exception("unhandled error in gRPC %s", name)
            raise CallError(Status.INTERNAL, f"internal error: {type(exc).__name__}: {exc}") from None

    def _authorize(self, call: Call) -> None:
        if call.unix:
            return
        for key, value in call.metadata:
            if key == "authorization":
                # stripped first: perf_analyzer's -H "authorization: Bearer ..." sends " Bearer ..."
                scheme, _, given = value.strip().partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token):
                    return
        raise Unauthorized("missing or invalid bearer token (gRPC metadata 'authorization: Bearer <token>')")

    async def _receive(self, call: Call) -> memoryview:
        """The call's one message, within body_timeout_s of asking for a receive slot."""
        message = call.complete_message(self.limits.max_body_bytes)
        if message is not None:
            return message  # all of it came within the first window: nothing left to wait for
        budget = self.limits.budget
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget.timeout_s
        async with budget.receive_slot(budget.timeout_s):
            try:
                return await asyncio.wait_for(call.read_message(self.limits.max_body_bytes),
                                              max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise RequestTimeout(
                    f"request message not received within body_timeout_s {budget.timeout_s:g} s"
                ) from None


async def _parse(raw: memoryview, request_type: Any) -> Any:
    """The message from its bytes; a large one is parsed on a worker thread, off the event loop."""
    return await off_loop_if_large(len(raw), parse_message, raw, request_type)


def parse_message(raw: memoryview, request_type: Any) -> Any:
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        raise InvalidInput(f"the request is not a valid {request_type.DESCRIPTOR.full_name} message: {exc}") from None
