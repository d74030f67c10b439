"""Decoding a KServe v2 request body for a transport (HTTP, MQTT) without stalling the event loop:
a small body is decoded in place, a large one on the loop's executor, where its milliseconds of
parsing do not hold up every other connection."""

from __future__ import annotations

import asyncio

from ..protocol import v2
from ..protocol.tensor_decode import RegionReader

# Decoding a body this large would hold the event loop for milliseconds: do it on a thread.
DECODE_OFF_LOOP_BYTES = 256 * 1024


async def decode_request(body: bytes | bytearray, header_length: int | None,
                         regions: RegionReader | None = None) -> v2.DecodedRequest:
    """v2.decode_request, on a worker thread for a body over DECODE_OFF_LOOP_BYTES (inputs in
    shared memory regions are views: no bytes to parse)."""
    if len(body) > DECODE_OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, v2.decode_request, body, header_length,
                                                                regions)
    return v2.decode_request(body, header_length, regions)
