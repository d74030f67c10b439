"""Request bodies under a memory budget: how large one may be, how many bytes all may hold at
once, and how long a client may take to send one.

`BodyBudget.read(request)` is an async context manager giving the whole body. It answers before
reading a byte when the declared Content-Length is over `max_body_bytes` (413) or would take the
bytes held by all bodies in progress over `max_inflight_body_bytes` (503); a chunked body, whose
size is unknown up front, is charged as it arrives. The bytes stay charged until the handler
leaves the context, because decoded tensors may be views of the body. The body must arrive within
`body_timeout_s` (408, then aiohttp closes the connection), so half-sent bodies cannot hold memory or a
connection for long. A client that disconnects mid-body is an INFO line, not an error: it is
not the daemon's fault and there is nobody left to answer.

After a large body is released the daemon asks glibc to return freed heap to the system
(`malloc_trim`, on a thread): decoding a JSON body of megabytes allocates several times its size
in short-lived objects, and glibc would otherwise keep those pages for the life of the process.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from ..errors import InvalidInput, PayloadTooLarge, Unavailable

log = logging.getLogger(__name__)

# Bodies from this size up trigger a malloc_trim once no large body is in progress any more.
TRIM_AFTER_BYTES = 1024 * 1024


class ClientGone(Exception):
    """The client closed its connection before its body was complete; nobody to answer."""


class BodyBudget:
    def __init__(self, *, max_body_bytes: int, max_inflight_bytes: int, timeout_s: float):
        self.max_body_bytes = max_body_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.timeout_s = timeout_s
        self.held = 0  # bytes charged to bodies in progress
        self.rejected_total = 0
        self.large_in_progress = 0  # bodies of TRIM_AFTER_BYTES or more being read or used
        self.trim = _malloc_trim()

    @asynccontextmanager
    async def read(self, request: web.Request) -> AsyncIterator[bytes | bytearray]:
        declared = request.content_length
        if declared is not None and declared > self.max_body_bytes:
            raise PayloadTooLarge(f"request body too large: {declared} bytes, limit is {self.max_body_bytes} bytes")
        charge = _Charge(self)
        try:
            if declared is not None:
                charge.add(declared, f"this request's {declared} bytes")
            body: bytes | bytearray
            try:
                if declared is not None and request.content.is_eof():
                    body = _already_received(request, declared)  # the common small body: no wait, no copy
                else:
                    body = await asyncio.wait_for(self._receive(request, declared, charge), self.timeout_s)
            except asyncio.TimeoutError:
                raise web.HTTPRequestTimeout(
                    text=f"request body not received within body_timeout_s {self.timeout_s:g} s"
                ) from None
            yield body
        finally:
            charge.release()

    async def _receive(self, request: web.Request, declared: int | None, charge: _Charge) -> bytearray:
        payload = request.content
        # With a Content-Length the body is filled in place: one copy, allocated at its final size.
        body = bytearray(declared) if declared is not None else bytearray()
        filled = 0
        try:
            while chunk := await payload.readany():
                if declared is None:
                    if filled + len(chunk) > self.max_body_bytes:
                        raise PayloadTooLarge(f"request body too large: limit is {self.max_body_bytes} bytes")
                    charge.add(len(chunk), "the rest of this chunked body")
                    body += chunk
                else:
                    if filled + len(chunk) > declared:
                        raise InvalidInput(f"request body longer than its Content-Length {declared}")
                    body[filled:filled + len(chunk)] = chunk
                filled += len(chunk)
        except (RequestPayloadError, HttpProcessingError) as exc:
            raise InvalidInput(f"malformed request body: {exc}") from None
        except ConnectionError:
            log.info("client %s closed the connection after %d of %s body bytes of %s %s",
                     request.remote or "on the unix socket", filled,
                     declared if declared is not None else "(chunked)", request.method, request.path)
            raise ClientGone() from None
        if declared is not None and filled < declared:
            raise InvalidInput(f"request body shorter than its Content-Length: {filled} of {declared} bytes")
        return body


def _already_received(request: web.Request, declared: int) -> bytes:
    """The body of a request that arrived with its headers (aiohttp has seen its end)."""
    try:
        body = request.content.read_nowait(-1)
    except (RequestPayloadError, HttpProcessingError) as exc:
        raise InvalidInput(f"malformed request body: {exc}") from None
    if len(body) != declared:
        raise InvalidInput(f"request body shorter than its Content-Length: {len(body)} of {declared} bytes")
    return body


class _Charge:
    """The bytes one body holds against its BodyBudget."""

    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.bytes = 0
        self.large = False

    def add(self, n: int, what: str) -> None:
        b = self.budget
        if b.held + n > b.max_inflight_bytes:
            b.rejected_total += 1
            raise Unavailable(
                f"server busy: request bodies in progress hold {b.held} bytes and {what} would exceed "
                f"max_inflight_body_bytes {b.max_inflight_bytes}; retry later"
            )
        b.held += n
        self.bytes += n
        if not self.large and self.bytes >= TRIM_AFTER_BYTES:
            self.large = True
            b.large_in_progress += 1

    def release(self) -> None:
        b = self.budget
        b.held -= self.bytes
        self.bytes = 0
        if self.large:
            self.large = False
            b.large_in_progress -= 1
            if b.large_in_progress == 0 and b.trim is not None:
                # The last large body is gone: hand its freed pages back, on a thread (it walks the
                # heap) and on the next loop turn, once an error leaving the handler has let go of
                # the frames that still reference the decoded tensors.
                loop = asyncio.get_running_loop()
                loop.call_soon(loop.run_in_executor, None, b.trim, 0)


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library is not glibc (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim
