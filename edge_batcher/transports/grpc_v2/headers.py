"""A gRPC call's request headers: HPACK-decoded (the `hpack` package) with the blocks that left
the dynamic table as it was remembered per connection, and read into what they say of the call
(its method's path, metadata, deadline, or why it is refused). http2.py keeps one HeaderDecoder
per connection.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from hpack import Decoder, HPACKDecodingError

from .call import parse_grpc_timeout

MAX_HEADER_LIST = 16384  # decoded request headers per call
HEADER_CACHE = 64  # header blocks remembered per connection (cleared when full)
# Dynamic table size updates a block may open with: RFC 7541 4.2 allows two (a smaller size, then
# the final one) after a SETTINGS_HEADER_TABLE_SIZE change
MAX_SIZE_UPDATES = 2


class CallHeaders(NamedTuple):
    """What a call's request headers say: its method's path, metadata, why it is refused, deadline."""

    path: str
    metadata: tuple[tuple[str, str], ...]
    refusal: str | None
    timeout_s: float | None


def call_headers(headers: Iterable[tuple[bytes, bytes]]) -> CallHeaders:
    path, metadata, refusal, timeout_s = "", [], None, None
    for raw_name, raw_value in headers:
        name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
        if name == ":path":
            path = value
        elif name == ":method" and value != "POST":
            refusal = f"method {value}: gRPC calls are POST"
        elif name == "content-type" and not value.startswith("application/grpc"):
            refusal = f"content-type {value}: gRPC calls are application/grpc"
        elif name == "grpc-timeout":
            timeout_s = parse_grpc_timeout(value)
        elif not name.startswith(":"):
            metadata.append((name, value))
    return CallHeaders(path, tuple(metadata), refusal, timeout_s)


class HeaderDecoder:
    """HPACK decoding of request header blocks, with the blocks that left the dynamic table as it was
    remembered: a client repeating its calls sends the same indexed bytes every time, and while the
    table is unchanged the same bytes mean the same headers. The pure-Python decoder was ~7% of the
    daemon's time under perf_analyzer's gRPC load (docs/benchmarks.md)."""

    def __init__(self) -> None:
        self._decoder = Decoder(max_header_list_size=MAX_HEADER_LIST)
        self._known: dict[bytes, tuple[tuple[Any, ...], CallHeaders]] = {}

    def _table_state(self) -> tuple[Any, ...]:
        # every change of the table adds a new head entry (an object this tuple keeps alive, so
        # compared by identity) or changes its length or size limit
        table = self._decoder.header_table
        entries = table.dynamic_entries
        return len(entries), entries[0] if entries else None, table.maxsize

    def decode(self, block: bytes) -> CallHeaders:
        """The block's headers (HPACKError when undecodable)."""
        state = self._table_state()
        known = self._known.get(block)
        if known is not None and _same_state(known[0], state):
            return known[1]
        if _leading_size_updates(block) > MAX_SIZE_UPDATES:
            # hpack takes any number, each costing Python time and decoding to nothing:
            # 16 KiB of them kept the event loop 28 ms
            raise HPACKDecodingError(f"more than {MAX_SIZE_UPDATES} dynamic table size updates at the block's start")
        headers = call_headers(self._decoder.decode(block, raw=True))
        if _same_state(self._table_state(), state):
            if len(self._known) >= HEADER_CACHE:
                self._known.clear()
            self._known[block] = (state, headers)
        return headers


def _leading_size_updates(block: bytes) -> int:
    """How many dynamic table size updates (001xxxxx, an HPACK integer with a 5-bit prefix)
    open the block; counting stops past MAX_SIZE_UPDATES."""
    count, i = 0, 0
    while i < len(block) and block[i] & 0xE0 == 0x20 and count <= MAX_SIZE_UPDATES:
        count += 1
        if block[i] & 0x1F == 0x1F:  # the integer goes on in bytes with the high bit set
            i += 1
            while i < len(block) and block[i] & 0x80:
                i += 1
        i += 1
    return count


def _same_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[0] == b[0] and a[1] is b[1] and a[2] == b[2]
