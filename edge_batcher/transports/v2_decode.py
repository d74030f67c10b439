"""Decoding a KServe v2 request body for a transport (HTTP, MQTT) without stalling the event loop:
a small body is decoded in place, a large one on the loop's executor, where its milliseconds of
parsing do not hold up every other connection; the same for finding the id of a request that
failed to decode (`peek_id`), which its error answer carries. `off_loop_if_large` is that rule,
also for the other bodies a door parses (gRPC messages, generate's and the index's JSON)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

from ..protocol import v2
from ..protocol.tensor_decode import RegionReader

# Decoding a body this large would hold the event loop for milliseconds: do it on a thread.
DECODE_OFF_LOOP_BYTES = 256 * 1024

T = TypeVar("T")


async def off_loop_if_large(size: int, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in place, or on the loop's executor when it works on more than
    DECODE_OFF_LOOP_BYTES (`size`)."""
    if size > DECODE_OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
    return fn(*args)


async def decode_request(body: bytes | bytearray, header_length: int | None,
                         regions: RegionReader | None = None) -> v2.DecodedRequest:
    """v2.decode_request, on a worker thread for a body over DECODE_OFF_LOOP_BYTES (inputs in
    shared memory regions are views: no bytes to parse)."""
    return await off_loop_if_large(len(body), v2.decode_request, body, header_length, regions)


async def peek_id(body: bytes | bytearray, header_length: int | None) -> str | None:
    """The v2 id of a request that failed to decode, when its JSON header still parses (on a
    worker thread for a header over DECODE_OFF_LOOP_BYTES)."""
    header = body[:header_length] if header_length is not None else body
    return await off_loop_if_large(len(header), _peek_id, header)


def _peek_id(header: bytes | bytearray) -> str | None:
    try:
        doc = json.loads(header)
    except Exception:
        return None
    value = doc.get("id") if isinstance(doc, dict) else None
    return value if isinstance(value, str) else None
