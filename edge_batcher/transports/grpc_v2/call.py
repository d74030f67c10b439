"""A gRPC call as the edge sees it: its method, metadata and deadline, its one message as the
client sends it (read only when the handler asks, which opens the stream's flow-control window),
and gRPC's status codes and the errors that end a call. The connection that carries it is
http2.py's GrpcConnection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from enum import IntEnum
from typing import Protocol

GRPC_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


class Status(IntEnum):
    """gRPC's status codes (the ones this server answers with)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


class CallError(Exception):
    """A call answered with a non-OK status (raised by a handler or the framing)."""

    def __init__(self, status: Status, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class StreamReset(Exception):
    """The client reset the stream, or the connection closed, while the call was in progress."""


def parse_grpc_timeout(value: str) -> float | None:
    """Seconds of a grpc-timeout header ("100m", "5S"); None when malformed."""
    unit = GRPC_TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


class Connection(Protocol):
    """What a call needs of the connection that carries it (http2.py's GrpcConnection)."""

    unix: bool
    peer: str
    stream_window: int  # what a client may send of a message before it is read
    peer_initial_window: int

    def open_window(self, call: Call, n: int) -> None: ...

    def respond(self, call: Call, status: Status, message: str = "") -> None: ...

    async def respond_with(self, call: Call, message: bytes) -> None: ...


class Call:
    """One gRPC call: its method, metadata and deadline, and its message as the client sends it."""

    def __init__(self, conn: Connection, stream_id: int, path: str, metadata: Sequence[tuple[str, str]],
                 timeout_s: float | None):
        self.conn = conn
        self.stream_id = stream_id
        self.path = path
        self.metadata = metadata
        loop = asyncio.get_running_loop()
        self.deadline = None if timeout_s is None else loop.time() + timeout_s
        self.body = bytearray()
        self.ended = False  # the client half-closed the stream
        self.reset = False  # the client reset it, or the connection closed
        self.reading = False  # the handler asked for the message: its window is open
        self.wanted: int | None = None  # body bytes that complete the message, once its prefix is read
        self.taken = False  # its message went to the handler as a view of body: no byte may follow
        self.recv_window = conn.stream_window
        self.send_window = conn.peer_initial_window
        self._arrived: asyncio.Future | None = None  # wakes read_message
        self.task: asyncio.Task | None = None

    @property
    def unix(self) -> bool:
        return self.conn.unix

    def peer(self) -> str:
        return self.conn.peer

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return self.metadata

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - asyncio.get_running_loop().time()

    def complete_message(self, max_bytes: int) -> memoryview | None:
        """The call's one message (its 5-byte prefix removed) if all of it has arrived, else None:
        a view of the body, not a copy (a camera frame's 0.9 MB copied once less on the loop)."""
        body = self.body
        if len(body) >= 5:
            if body[0] != 0:
                raise CallError(Status.UNIMPLEMENTED, "compressed messages are not supported "
                                                      "(grpc-encoding identity only)")
            length = int.from_bytes(body[1:5], "big")
            if length > max_bytes:
                raise CallError(Status.RESOURCE_EXHAUSTED,
                                f"Received message larger than max ({length} vs. {max_bytes})")
            if len(body) >= 5 + length:
                self.taken = True
                return memoryview(body)[5:5 + length]
        if self.ended:
            if not body:
                raise CallError(Status.INVALID_ARGUMENT, "the call carried no request message")
            raise CallError(Status.INVALID_ARGUMENT, "the stream ended inside the request message")
        return None

    async def read_message(self, max_bytes: int) -> memoryview:
        """The call's one message, opening the stream's window for it and waiting for the rest."""
        self.reading = True
        if self.recv_window < self.conn.stream_window and not self.ended:
            self.conn.open_window(self, self.conn.stream_window - self.recv_window)  # what came before
        while True:
            if self.reset:
                raise StreamReset()
            message = self.complete_message(max_bytes)
            if message is not None:
                return message
            if self.wanted is None and len(self.body) >= 5:
                # The length is known and allowed: open the window for all of the message at once
                # rather than a DATA frame at a time (a 0.9 MB camera frame took ~56 round trips).
                self.wanted = 5 + int.from_bytes(self.body[1:5], "big")
                missing = self.wanted - len(self.body) - self.recv_window
                if missing > 0:
                    self.conn.open_window(self, missing)
            self._arrived = asyncio.get_running_loop().create_future()
            await self._arrived

    def _wake(self) -> None:
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)
