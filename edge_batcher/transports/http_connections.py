"""The connection layer under the HTTP app: how many connections, for how long, and what a
client that breaks HTTP framing itself is told.

aiohttp's RequestHandler serves each connection of the Unix socket and the TCP listener; the
subclass here adds three things. At most `[server] max_connections` are open at once (one
count for all listeners): a connection beyond it closes the oldest *idle* one (no request being
handled: an idle keep-alive connection, or one still sending its request header), or, when
every connection has a request in progress, is answered 503 and closed. Reaching the limit is
logged once, then summarised once per interval with counts, never a line per connection, so a
flood cannot fill the journal. And malformed framing (request line, header, chunked encoding)
is answered like every other bad input, 400 with `{"error": ...}`, logged at DEBUG, instead of
aiohttp's plain-text page and an ERROR traceback.

Timeouts are aiohttp's `keepalive_timeout`, which runs from the moment a connection is made
and again after each response: a connection that does not complete a request header within it
is closed, so idle and slowloris connections cannot pile up. A request *body* has its own
deadline (`transports/http_body.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

log = logging.getLogger(__name__)

# How often a sustained overflow of the connection limit is summarised in the log.
LIMIT_LOG_INTERVAL_S = 10.0


class ConnectionGuard:
    """The open connections, oldest first, and the limit on how many may be open at once."""

    def __init__(self, limit: int, log_interval_s: float = LIMIT_LOG_INTERVAL_S):
        self.limit = limit
        self.log_interval_s = log_interval_s
        self._open: dict[GuardedRequestHandler, None] = {}  # insertion order = age
        self.evicted_total = 0
        self.refused_total = 0
        self._evicted_since_log = 0
        self._refused_since_log = 0
        self._report: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, conn: GuardedRequestHandler) -> bool:
        """Make room for `conn` if the limit is reached; False when it must be refused."""
        if len(self._open) >= self.limit:
            idle = next((c for c in self._open if c.idle), None)
            if idle is None:
                self.refused_total += 1
                self._refused_since_log += 1
                self._limit_reached()
                return False
            self._open.pop(idle)
            idle.force_close()
            self.evicted_total += 1
            self._evicted_since_log += 1
            self._limit_reached()
        self._open[conn] = None
        return True

    def closed(self, conn: GuardedRequestHandler) -> None:
        self._open.pop(conn, None)

    def _limit_reached(self) -> None:
        if self._report is not None:
            return  # the periodic summary will count this one
        log.warning(
            "connection limit reached: %d open ([server] max_connections); closing the oldest idle "
            "connections, answering 503 while all are busy (summarised every %.0f s)",
            self.limit, self.log_interval_s,
        )
        self._evicted_since_log = self._refused_since_log = 0
        self._report = asyncio.get_running_loop().call_later(self.log_interval_s, self._summarise)

    def _summarise(self) -> None:
        evicted, refused = self._evicted_since_log, self._refused_since_log
        self._evicted_since_log = self._refused_since_log = 0
        if not evicted and not refused:
            self._report = None  # quiet again: the next overflow logs its first line at once
            return
        log.warning(
            "connection limit %d: %d idle connections closed and %d refused with 503 in the last %.0f s",
            self.limit, evicted, refused, self.log_interval_s,
        )
        self._report = asyncio.get_running_loop().call_later(self.log_interval_s, self._summarise)

    def stop(self) -> None:
        if self._report is not None:
            self._report.cancel()
            self._report = None


def _refusal(limit: int) -> bytes:
    body = json.dumps({"error": f"too many connections: the daemon's limit of {limit} is reached "
                                "and all of them have a request in progress; retry later"}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))


class GuardedRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol, counted by a ConnectionGuard, with JSON framing errors."""

    def __init__(self, manager: Server, *, guard: ConnectionGuard, **kwargs):
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.requests_running = 0  # kept by connection_state_middleware
        self._refused = False

    @property
    def idle(self) -> bool:
        return self.requests_running == 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.guard.admit(self):
            self._refused = True
            transport.write(_refusal(self.guard.limit))  # type: ignore[attr-defined]
            transport.close()
            return
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        self.guard.closed(self)
        super().connection_lost(exc)

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to what never reached the app: a request it could not parse (400),
        or an exception that escaped every handler (500). Same shape as every other error."""
        if status >= 500:
            self.log_exception("unhandled error on a connection", exc_info=exc)
            text = f"internal error: {type(exc).__name__}: {exc}" if exc else "internal error"
        else:
            detail = message or (str(exc) if exc else "")
            log.debug("malformed HTTP request from %s: %s", request.remote or "unix socket", detail)
            text = f"malformed HTTP request: {detail}" if detail else "malformed HTTP request"
        if request.writer.output_size > 0:  # a response was already started: nothing can be said
            raise ConnectionError("response already started; closing the connection")
        resp = web.json_response({"error": text}, status=status)
        resp.force_close()
        return resp


class GuardedServer(Server):
    def __init__(self, *args, guard: ConnectionGuard, **kwargs):
        super().__init__(*args, **kwargs)
        self.guard = guard

    def __call__(self) -> GuardedRequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, guard=self.guard, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """web.AppRunner whose connections are GuardedRequestHandlers sharing one ConnectionGuard."""

    def __init__(self, app: web.Application, *, max_connections: int, **kwargs):
        super().__init__(app, **kwargs)
        self.guard = ConnectionGuard(max_connections)

    async def _make_server(self) -> Server:
        plain = await super()._make_server()  # runs the app's startup and freezes it
        return GuardedServer(plain.request_handler, request_factory=plain.request_factory,
                             loop=asyncio.get_running_loop(), guard=self.guard, **self._kwargs)

    async def cleanup(self) -> None:
        self.guard.stop()
        await super().cleanup()


@web.middleware
async def connection_state_middleware(request: web.Request, handler):
    """Marks the connection busy while one of its requests is handled (so it is not evicted)."""
    conn = request.protocol
    if not isinstance(conn, GuardedRequestHandler):  # e.g. aiohttp's test server
        return await handler(request)
    conn.requests_running += 1
    try:
        return await handler(request)
    finally:
        conn.requests_running -= 1
