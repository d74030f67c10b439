"""The connection layer under the HTTP app: how many connections, for how long, and what a
client that breaks HTTP framing itself is told. aiohttp's RequestHandler serves each connection
of the Unix socket and the TCP listener; the subclass here admits at most the edge's HTTP share
of `[server] max_connections` (one count for both listeners, transports/edge.py). A connection
beyond it closes the oldest *idle* one: idle for EVICT_AFTER_IDLE_S with no request anywhere in
it (none handled, none parsed and waiting, no unread bytes in its socket), so a complete request
is never dropped unanswered to make room; with none idle, the newcomer is answered 503, its
unread bytes discarded and its side shut down so that the client reads the answer rather than a
reset. TLS is started by each admitted connection itself (`TlsListener`), so a connection is
counted during its handshake too, which must end within idle_timeout_s; one beyond the limit is
closed at once. Reaching the limit is logged once, then summarised per interval, never a line per
connection. Malformed framing is answered like other bad input, 400 with `{"error": ...}` at
DEBUG, not aiohttp's plain-text page and a traceback. A connection that does not complete a
request header within idle_timeout_s of connecting or of its last answer is closed (here, since
aiohttp's `keepalive_timeout` covers the time after connecting only from 3.14 on); a request
*body* has its own deadline (`http_body.py`). A client that stops reading its answers is
disconnected once not one byte of its answers has left for idle_timeout_s: its answers and the
requests it pipelined behind them are freed, not kept for ever (a slow reader is not).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from dataclasses import dataclass

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from .socket_queues import unread_bytes

log = logging.getLogger(__name__)

# How often a sustained overflow of the connection limit is summarised in the log.
LIMIT_LOG_INTERVAL_S = 10.0
# Refused connections kept open after their 503 until the client closes (at most this long), so
# that bytes it sends meanwhile are discarded rather than answered with a reset; beyond this
# many at once a refused connection is closed right after its 503 (their descriptors are part
# of descriptors.RESERVED_FDS).
MAX_REFUSALS_ANSWERING = 32
REFUSAL_LINGER_S = 1.0
# A connection is evicted for a newer one only after it has been idle this long: a client that
# has just connected, or just read an answer, gets the time to send its next request.
EVICT_AFTER_IDLE_S = 1.0


@dataclass(frozen=True)
class TlsListener:
    """TLS on the TCP listener of this port, started by each admitted connection itself, so that
    connections still in their handshake are counted (asyncio's own TLS reaches the handler only
    after the handshake: silent connections piled up uncounted until accept() failed with EMFILE)."""

    context: ssl.SSLContext
    port: int
    handshake_timeout_s: float


class ConnectionGuard:
    """The open connections, oldest first, and the limit on how many may be open at once."""

    def __init__(self, limit: int, idle_timeout_s: float, log_interval_s: float = LIMIT_LOG_INTERVAL_S):
        self.limit = limit
        self.idle_timeout_s = idle_timeout_s  # to complete a request header after connecting or an answer
        self.tls: TlsListener | None = None
        self.log_interval_s = log_interval_s
        self._open: dict[GuardedRequestHandler, None] = {}  # insertion order = age
        self.evicted_total = 0
        self.refused_total = 0
        self._evicted_since_log = 0
        self._refused_since_log = 0
        self._report: asyncio.TimerHandle | None = None
        self.refusals_answering = 0  # refused connections still open after their 503

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, conn: GuardedRequestHandler) -> bool:
        """Make room for `conn` if the limit is reached; False when it must be refused."""
        if len(self._open) >= self.limit:
            now = asyncio.get_running_loop().time()
            idle = next((c for c in self._open if c.evictable(now)), None)
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


def _discard_unread(transport: asyncio.BaseTransport) -> None:
    """Read and drop what the client already sent, so closing sends a FIN, not a reset."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    for _ in range(16):  # at most 1 MiB: a refusal must stay cheap
        try:
            if not os.read(sock.fileno(), 65536):
                return
        except OSError:  # BlockingIOError: nothing more for now
            return


class GuardedRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol, counted by a ConnectionGuard, with JSON framing errors."""

    def __init__(self, manager: Server, *, guard: ConnectionGuard, **kwargs):
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.idle_timeout_s = guard.idle_timeout_s
        self._idle_check: asyncio.TimerHandle | None = None
        self.requests_running = 0  # kept by connection_state_middleware
        self.requests_waiting = 0  # parsed, not yet taken by a handler
        self.idle_since = self._loop.time()  # connected, or the last answer given
        self._refused = False
        self._lingering: asyncio.TimerHandle | None = None
        self._handshake: asyncio.Task | None = None  # TLS being started on the raw connection
        self._write_stall: asyncio.TimerHandle | None = None  # while the client reads none of our answers

    def evictable(self, now: float) -> bool:
        """Idle for EVICT_AFTER_IDLE_S, with no request anywhere in the connection."""
        return (self.requests_running == 0 and self.requests_waiting == 0
                and now - self.idle_since >= EVICT_AFTER_IDLE_S and unread_bytes(self.transport) == 0)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tls = self._tls_for(transport)
        if not self.guard.admit(self):
            self._refused = True
            if tls is None:
                self._refuse(transport)
            else:
                transport.close()  # a plain-text 503 means nothing to a client in its TLS handshake
            return
        if tls is not None:
            transport.pause_reading()  # type: ignore[attr-defined]  # the ClientHello is for start_tls
            self._handshake = asyncio.ensure_future(self._start_tls(transport, tls))
            return
        super().connection_made(transport)
        self._check_idle_later(self.idle_timeout_s)

    def _tls_for(self, transport: asyncio.BaseTransport) -> TlsListener | None:
        tls = self.guard.tls
        sockname = transport.get_extra_info("sockname")
        if tls is not None and isinstance(sockname, tuple) and sockname[1] == tls.port:
            return tls
        return None

    async def _start_tls(self, raw: asyncio.BaseTransport, tls: TlsListener) -> None:
        # start_tls pauses reading itself, but on a transport already marked paused its pause does
        # nothing, and on Python 3.10 the pause in connection_made did not hold: the transport adds
        # its reader after connection_made, paused or not, so the ClientHello went to the HTTP
        # parser and every handshake timed out. Resumed here, start_tls's own pause removes the
        # reader before anything is read.
        raw.resume_reading()  # type: ignore[attr-defined]
        try:
            transport = await asyncio.get_running_loop().start_tls(
                raw, self, tls.context, server_side=True,  # type: ignore[arg-type]
                ssl_handshake_timeout=tls.handshake_timeout_s)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, asyncio.CancelledError) as exc:
            log.debug("TLS handshake with %s not completed: %r", raw.get_extra_info("peername"), exc)
            raw.close()
            self.guard.closed(self)
            return
        finally:
            self._handshake = None
        if transport is None:  # closed as the handshake finished
            self.guard.closed(self)
            return
        super().connection_made(transport)
        self.idle_since = self._loop.time()
        self._check_idle_later(self.idle_timeout_s)

    def _check_idle_later(self, seconds: float) -> None:
        self._idle_check = self._loop.call_later(seconds, self._close_if_idle)

    def _close_if_idle(self) -> None:
        """Close a connection that has not completed a request header within idle_timeout_s of
        connecting or of its last answer. aiohttp's keepalive_timeout does so only after an
        answer before 3.14 (a connection that sends nothing, or half a header, stayed open), so
        the deadline is kept here, the same on every version."""
        self._idle_check = None
        if self.transport is None:
            return
        if self.requests_running or self.requests_waiting:
            self._check_idle_later(self.idle_timeout_s)  # busy: the body has its own deadline
            return
        idle_for = self._loop.time() - self.idle_since
        if idle_for >= self.idle_timeout_s:
            log.debug("closing a connection idle for %.1f s without a complete request header (idle_timeout_s)",
                      idle_for)
            self.force_close()
        else:
            self._check_idle_later(self.idle_timeout_s - idle_for)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_stall(None)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None

    def _watch_stall(self, unsent_before: int | None) -> None:
        """While writing is paused: every idle_timeout_s, abort if not one byte of our answers has
        left since the last look (a slow reader of a large answer makes progress and stays);
        close() would wait for the unread bytes for ever."""
        self._write_stall = None
        if self.transport is None:
            return
        unsent = self.transport.get_write_buffer_size()  # type: ignore[attr-defined]
        if unsent_before is not None and unsent >= unsent_before:
            log.debug("closing a connection whose client read none of its answers for %.1f s (idle_timeout_s)",
                      self.idle_timeout_s)
            self.transport.abort()  # type: ignore[attr-defined]
            return
        self._write_stall = self._loop.call_later(self.idle_timeout_s, self._watch_stall, unsent)

    def force_close(self) -> None:
        if self._handshake is not None:  # evicted during its handshake
            self._handshake.cancel()
            return
        super().force_close()

    def _refuse(self, transport: asyncio.BaseTransport) -> None:
        _discard_unread(transport)
        transport.write(_refusal(self.guard.limit))  # type: ignore[attr-defined]
        can_linger = self.guard.refusals_answering < MAX_REFUSALS_ANSWERING
        if can_linger and transport.can_write_eof():  # type: ignore[attr-defined]
            self.guard.refusals_answering += 1
            transport.write_eof()  # type: ignore[attr-defined]
            self._lingering = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.close)
        else:
            transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # discarded: the 503 is already on its way
        waiting = len(self._messages)
        super().data_received(data)
        self.requests_waiting += len(self._messages) - waiting

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            if self._lingering is not None:
                self._lingering.cancel()
                self._lingering = None
                self.guard.refusals_answering -= 1
            return
        self.guard.closed(self)
        for timer in (self._idle_check, self._write_stall):
            if timer is not None:
                timer.cancel()
        self._idle_check = self._write_stall = None
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

    def __init__(self, app: web.Application, *, max_connections: int, idle_timeout_s: float, **kwargs):
        kwargs.setdefault("keepalive_timeout", idle_timeout_s)  # aiohttp's own, after an answer
        super().__init__(app, **kwargs)
        self.guard = ConnectionGuard(max_connections, idle_timeout_s)

    def serve_tls(self, port: int, context: ssl.SSLContext, handshake_timeout_s: float) -> None:
        """TLS for connections to this TCP port (its site is added without an ssl_context)."""
        self.guard.tls = TlsListener(context, port, handshake_timeout_s)

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
    conn.requests_waiting = max(conn.requests_waiting - 1, 0)
    conn.requests_running += 1
    try:
        return await handler(request)
    finally:
        conn.requests_running -= 1
        conn.idle_since = asyncio.get_running_loop().time()
