"""An HTTP request body read under the shared body budget (`body_budget.py`), for every route
that reads one (/infer, generate, generate_stream).

`read_body(budget, request)` is an async context manager giving the whole body. It answers before
reading a byte when the declared Content-Length is over `max_body_bytes` (413) or would take the
bytes held by all bodies in progress over `max_inflight_body_bytes` (503); a chunked body, whose
size is unknown up front, is charged as it arrives. The bytes stay charged until the handler
leaves the context. The body must arrive within `body_timeout_s` (408, then aiohttp closes the
connection), so half-sent bodies cannot hold memory or a connection for long. A client that
disconnects mid-body is an INFO line, not an error: it is not the daemon's fault and there is
nobody left to answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from ..errors import InvalidInput, PayloadTooLarge, RequestTimeout
from .body_budget import BodyBudget, Charge

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client closed its connection before its body was complete; nobody to answer."""


@asynccontextmanager
async def read_body(budget: BodyBudget, request: web.Request) -> AsyncIterator[bytes | bytearray]:
    declared = request.content_length
    if declared is not None and declared > budget.max_body_bytes:
        raise PayloadTooLarge(f"request body too large: {declared} bytes, limit is {budget.max_body_bytes} bytes")
    charge = budget.charge()
    try:
        if declared is not None:
            charge.add(declared, f"this request's {declared} bytes")
        body: bytes | bytearray
        try:
            if declared and not request.can_read_body:
                # Read before us (a middleware's request.read(), in an app embedding these
                # routes): aiohttp keeps what it read.
                body = _checked(await request.read(), declared)
            elif declared is not None and request.content.is_eof():
                body = _already_received(request, declared)  # the common small body: no wait, no copy
            else:
                body = await asyncio.wait_for(_receive(budget, request, declared, charge), budget.timeout_s)
        except asyncio.TimeoutError:
            raise RequestTimeout(f"request body not received within body_timeout_s {budget.timeout_s:g} s") from None
        yield body
    finally:
        charge.release()


async def _receive(budget: BodyBudget, request: web.Request, declared: int | None, charge: Charge) -> bytearray:
    payload = request.content
    # With a Content-Length the body is filled in place: one copy, allocated at its final size.
    body = bytearray(declared) if declared is not None else bytearray()
    filled = 0
    try:
        while chunk := await payload.readany():
            if declared is None:
                if filled + len(chunk) > budget.max_body_bytes:
                    raise PayloadTooLarge(f"request body too large: limit is {budget.max_body_bytes} bytes")
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
    return _checked(body, declared)


def _checked(body: bytes, declared: int) -> bytes:
    if len(body) != declared:
        raise InvalidInput(f"request body shorter than its Content-Length: {len(body)} of {declared} bytes")
    return body
