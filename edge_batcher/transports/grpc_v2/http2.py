"""HTTP/2 for gRPC's unary calls, on asyncio: the framing, header compression (headers.py, on
the `hpack` package), flow control both ways and the connection's lifecycle, with nothing of
grpcio. Each HEADERS frame that opens a stream becomes a `Call` handed to `dispatch`; the call's message is
read only when its handler asks for it (`Call.read_message`), so a client may have at most one
64 KiB stream window of a message sent before the edge has checked the call; once it is read
and its length known, the window opens for all of it at once. Responses are written
with static header blocks (no dynamic table), the message split to the peer's frame size and
windows; a client that reads none of them for idle_timeout_s is disconnected (a slow one is not). Why this and not
grpc.aio: docs/benchmarks.md, "gRPC against HTTP".
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import TypeVar

from hpack import HPACKError

from ..socket_queues import unsent_bytes
from .call import Call, Status
from .headers import MAX_HEADER_LIST, HeaderDecoder

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = (
    0x0, 0x1, 0x3, 0x5, 0x6, 0x7, 0x8)
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 0x1, 0x3, 0x4
SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x5, 0x6

DEFAULT_WINDOW = 65535  # HTTP/2's initial window: what a client may send before a call is read
DEFAULT_FRAME = 16384  # HTTP/2's default and smallest SETTINGS_MAX_FRAME_SIZE
# The frames we accept, advertised: a 0.9 MB camera frame comes in one DATA frame, not 56 of
# 16 KiB, each parsed and copied by Python (docs/benchmarks.md, "gRPC against HTTP").
MAX_FRAME = 1 << 20
MAX_STREAMS = 1000  # per connection; a client queues beyond it (the edge refuses by its own count)
CONNECTION_WINDOW = 1 << 24  # the connection-level window, refilled as DATA arrives
CONNECTION_ACK_AT = CONNECTION_WINDOW // 4  # DATA bytes received before the window is refilled
# Acknowledgements (PING, SETTINGS) held while the client reads nothing, beyond which it is
# disconnected: a flood of 9-byte frames must not grow our memory for ever.
MAX_UNREAD_CONTROL = 4 << 20


B = TypeVar("B", bytes, memoryview)


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A header field as HPACK's literal without indexing, new name, no Huffman: stateless."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def grpc_message(text: str) -> bytes:
    """gRPC's percent-encoding of grpc-message: UTF-8, every byte but printable ASCII (and '%') as %XX."""
    return b"".join(bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in text.encode())


RESPONSE_HEADERS = b"\x88" + literal(b"content-type", b"application/grpc")  # 0x88: :status 200
TRAILERS_OK = literal(b"grpc-status", b"0")


def trailers(status: Status, message: str) -> bytes:
    block = literal(b"grpc-status", str(int(status)).encode())
    return block + literal(b"grpc-message", grpc_message(message)) if message else block


Dispatch = Callable[[Call], None]


def stalled(before: tuple[int, int], now: tuple[int, int]) -> bool:
    """Whether a client read none of our answers between two looks, each (bytes handed to the
    kernel, bytes the kernel still holds for the client). It read some if the kernel took more
    from us (there was room: it had read) or holds less. Not the write buffer's size: calls that
    finish meanwhile still add their headers to it, so it can grow while a slow client reads."""
    return now[0] <= before[0] and now[1] >= before[1]


class GrpcConnection(asyncio.Protocol):
    """One client connection: HTTP/2 frames in, calls to `dispatch`, responses out."""

    def __init__(self, dispatch: Dispatch, *, idle_timeout_s: float, unix: bool,
                 admit: Callable[[GrpcConnection], bool], closed: Callable[[GrpcConnection], None]):
        self.dispatch = dispatch
        self.idle_timeout_s = idle_timeout_s
        self.unix = unix
        self._admit, self._closed = admit, closed
        self.peer = "unix:"
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, Call] = {}
        self.stream_window = DEFAULT_WINDOW
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME
        self.send_window = DEFAULT_WINDOW  # the connection-level window the peer grants us
        self._window_grown: asyncio.Future | None = None
        self._drained: asyncio.Future | None = None  # set while the transport's buffer is full
        self._write_stall: asyncio.TimerHandle | None = None  # aborts a client that reads nothing meanwhile
        self._written = 0  # bytes handed to the transport: less what it holds, what has left
        self._held_control = bytearray()  # acknowledgements held while writing is paused
        self._buf = bytearray()
        self._preface = False
        self._headers: tuple[int, int, bytearray] | None = None  # (stream, flags, block) awaiting CONTINUATION
        self._decoder = HeaderDecoder()
        self._last_stream = 0
        self._unacked = 0  # DATA bytes received since the last connection WINDOW_UPDATE
        self._idle_since = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self.going_away = False
        self.gone = asyncio.get_running_loop().create_future()  # done when the connection is closed

    # ------------------------------------------------------------------ lifecycle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self._admit(self):
            transport.abort()
            return
        if not self.unix:
            host, port = transport.get_extra_info("peername")[:2]
            self.peer = f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
        settings = struct.pack(">HIHIHIHI", SETTINGS_MAX_CONCURRENT_STREAMS, MAX_STREAMS,
                               SETTINGS_INITIAL_WINDOW_SIZE, DEFAULT_WINDOW, SETTINGS_MAX_FRAME_SIZE, MAX_FRAME,
                               SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST)
        self._write(frame(SETTINGS, 0, 0, settings)
                    + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", CONNECTION_WINDOW - DEFAULT_WINDOW)))
        self._idle_since = asyncio.get_running_loop().time()
        self._check_idle_later(self.idle_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed(self)
        for timer in (self._idle_timer, self._write_stall):
            if timer is not None:
                timer.cancel()
        for call in list(self.streams.values()):
            self._abandon(call)
        self.streams.clear()
        for waiter in (self._window_grown, self._drained):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        if not self.gone.done():
            self.gone.set_result(None)

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()
        self._watch_stall(None)

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None
        if self._held_control:  # last: writing them may pause writing (and watch for a stall) again
            held = bytes(self._held_control)
            self._held_control.clear()
            self._write(held)

    def _watch_stall(self, before: tuple[int, int] | None) -> None:
        """While writing is paused: every idle_timeout_s, abort (its calls abandoned) if the
        client read nothing since the last look; a slow reader makes progress and stays."""
        self._write_stall = None
        if self.transport is None:
            return
        now = (self._written - self.transport.get_write_buffer_size(), unsent_bytes(self.transport))
        if before is not None and stalled(before, now):
            log.debug("gRPC connection from %s: its client read none of our answers for %.1f s (idle_timeout_s)",
                      self.peer, self.idle_timeout_s)
            self.transport.abort()
            return
        self._write_stall = asyncio.get_running_loop().call_later(self.idle_timeout_s, self._watch_stall, now)

    def go_away(self) -> None:
        """Take no new calls (those open are answered); close once none is left."""
        if self.going_away or self.transport is None or self.transport.is_closing():
            return
        self.going_away = True
        self._write(frame(GOAWAY, 0, 0, struct.pack(">II", self._last_stream, NO_ERROR)))
        if not self.streams:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _check_idle_later(self, delay: float) -> None:
        self._idle_timer = asyncio.get_running_loop().call_later(max(delay, 0.01), self._check_idle)

    def _check_idle(self) -> None:
        """Closed after idle_timeout_s with no call open (or no HTTP/2 preface at all)."""
        if self.transport is None or self.transport.is_closing():
            return
        idle_for = asyncio.get_running_loop().time() - self._idle_since
        if not self.streams and idle_for >= self.idle_timeout_s:
            if self._preface:
                self._write(frame(GOAWAY, 0, 0, struct.pack(">II", self._last_stream, NO_ERROR)))
            self.transport.close()
            return
        self._check_idle_later(self.idle_timeout_s - idle_for if not self.streams else self.idle_timeout_s)

    def _fail(self, code: int, why: str) -> None:
        """A connection error: GOAWAY with `code`, then closed (the client broke HTTP/2 itself)."""
        log.debug("gRPC connection from %s closed: %s", self.peer, why)
        if self.transport is not None and not self.transport.is_closing():
            self._write(frame(GOAWAY, 0, 0, struct.pack(">II", self._last_stream, code) + why.encode()))
            self.transport.close()

    # ------------------------------------------------------------------ frames in

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        if not self._preface:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(bytes(buf)):
                    self._fail(PROTOCOL_ERROR, "not HTTP/2 (gRPC needs HTTP/2 with prior knowledge)")
                return
            if bytes(buf[:len(PREFACE)]) != PREFACE:
                self._fail(PROTOCOL_ERROR, "not HTTP/2 (gRPC needs HTTP/2 with prior knowledge)")
                return
            del buf[:len(PREFACE)]
            self._preface = True
        pos, end = 0, len(buf)
        view = memoryview(buf)
        try:
            while end - pos >= 9 and self.transport is not None and not self.transport.is_closing():
                length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
                if length > MAX_FRAME:
                    self._fail(FRAME_SIZE_ERROR, f"a frame of {length} bytes (the limit is {MAX_FRAME})")
                    return
                if end - pos < 9 + length:
                    break
                kind, flags = buf[pos + 3], buf[pos + 4]
                stream_id = int.from_bytes(view[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                start, pos = pos + 9, pos + 9 + length
                if kind == DATA and self._headers is None:
                    # appended to its call straight from the buffer: one copy of a camera frame
                    # fewer on the loop (released here, before the buffer is cut below)
                    with view[start:pos] as chunk:
                        self._on_data(flags, stream_id, chunk)
                else:
                    self._on_frame(kind, flags, stream_id, bytes(view[start:pos]))
        finally:
            view.release()
            del buf[:pos]
        if self._unacked >= CONNECTION_ACK_AT and self.transport is not None and not self.transport.is_closing():
            # Every DATA byte is buffered in its call at once, so the connection window only has
            # to stay open: each stream's own window bounds a call's unread bytes. Acknowledged a
            # quarter at a time, not per read: on loopback TCP each write also runs the client's
            # receive path, ~4 writes per 0.9 MB message.
            self._write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._unacked)))
            self._unacked = 0

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._headers is not None and kind != CONTINUATION:
            self._fail(PROTOCOL_ERROR, "a header block interrupted before its END_HEADERS")
        elif kind == HEADERS:  # (DATA frames go to _on_data from data_received, without a copy)
            self._on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._on_settings(payload)
        elif kind == PING:
            if not flags & ACK:
                self._acknowledge(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == RST_STREAM:
            call = self.streams.pop(stream_id, None)
            if call is not None:
                self._abandon(call)
                self._stream_closed()
        elif kind == GOAWAY:
            self.go_away()
        elif kind == PUSH_PROMISE:
            self._fail(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types are ignored, as HTTP/2 says

    @staticmethod
    def _unpad(flags: int, payload: B) -> B:
        if flags & PADDED:
            pad = payload[0] if payload else 0
            return payload[1:len(payload) - pad]
        return payload

    def _on_data(self, flags: int, stream_id: int, payload: memoryview) -> None:
        self._unacked += len(payload)
        call = self.streams.get(stream_id)
        if call is None or call.ended:
            return  # a stream answered (and reset) already: its bytes are dropped
        data = self._unpad(flags, payload)
        call.recv_window -= len(payload)
        if call.recv_window < 0:
            self._reset(call, FLOW_CONTROL_ERROR)
            return
        if call.taken:  # bytes after its one message (a unary call carries one): dropped
            call.ended = call.ended or bool(flags & END_STREAM)
            return
        call.body += data
        if flags & END_STREAM:
            call.ended = True
        elif call.wanted is not None:
            if len(call.body) < call.wanted:
                return  # its window covers the rest already: wake the reader when all is here
        elif call.reading and payload:
            self.open_window(call, len(payload))
        call._wake()

    def open_window(self, call: Call, n: int) -> None:
        """Let the client send `n` more bytes of `call`'s message (it is being read)."""
        call.recv_window += n
        if self.transport is not None and not self.transport.is_closing():
            self._write(frame(WINDOW_UPDATE, 0, call.stream_id, struct.pack(">I", n)))

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        block = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            block = block[5:]
        if len(block) > MAX_HEADER_LIST:  # frames may be 1 MiB: pure-Python HPACK must not see that
            self._fail(ENHANCE_YOUR_CALM, f"a header block over {MAX_HEADER_LIST} bytes")
            return
        if flags & END_HEADERS:
            self._headers_complete(stream_id, flags, block)
        else:
            self._headers = (stream_id, flags, bytearray(block))

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._headers is None or self._headers[0] != stream_id:
            self._fail(PROTOCOL_ERROR, "a CONTINUATION frame without its HEADERS")
            return
        block = self._headers[2]
        block += payload
        if len(block) > MAX_HEADER_LIST:
            self._fail(ENHANCE_YOUR_CALM, f"a header block over {MAX_HEADER_LIST} bytes")
            return
        if flags & END_HEADERS:
            opening_flags = self._headers[1]
            self._headers = None
            self._headers_complete(stream_id, opening_flags, bytes(block))

    def _headers_complete(self, stream_id: int, flags: int, block: bytes) -> None:
        try:
            headers = self._decoder.decode(block)
        except HPACKError as exc:
            self._fail(COMPRESSION_ERROR, f"undecodable headers: {exc}")
            return
        call = self.streams.get(stream_id)
        if call is not None:  # trailers from the client: the stream's end
            call.ended = True
            call._wake()
            return
        if stream_id % 2 == 0:
            self._fail(PROTOCOL_ERROR, f"stream {stream_id} cannot open a new call")
            return
        if stream_id <= self._last_stream:
            return  # trailers of a stream answered already
        self._last_stream = stream_id
        if self.going_away or len(self.streams) >= MAX_STREAMS:
            self._write(frame(RST_STREAM, 0, stream_id, struct.pack(">I", REFUSED_STREAM)))
            return
        call = Call(self, stream_id, headers.path, headers.metadata, headers.timeout_s)
        self.streams[stream_id] = call
        if flags & END_STREAM:
            call.ended = True
        if headers.refusal is not None:
            self.respond(call, Status.INVALID_ARGUMENT, headers.refusal)
            return
        self.dispatch(call)

    def _on_settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            self._fail(FRAME_SIZE_ERROR, "a SETTINGS frame of a length not a multiple of 6")
            return
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for call in self.streams.values():
                    call.send_window += delta
                self._window_changed()
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self.peer_max_frame = max(DEFAULT_FRAME, min(value, (1 << 24) - 1))
        self._acknowledge(frame(SETTINGS, ACK, 0))

    def _acknowledge(self, ack: bytes) -> None:
        """Write a PING or SETTINGS acknowledgement; while writing is paused (the client reads
        nothing), hold it in one buffer written when the transport drains. Not one transport
        write each: Python 3.12's socket transport sums its buffered chunks on every write, so a
        flood of tiny ones queued there costs the loop quadratic time. A client that lets over
        MAX_UNREAD_CONTROL of them pile up is disconnected."""
        if self._drained is None:
            self._write(ack)
            return
        self._held_control += ack
        if len(self._held_control) > MAX_UNREAD_CONTROL:
            self._held_control.clear()
            self._fail(ENHANCE_YOUR_CALM, f"over {MAX_UNREAD_CONTROL >> 20} MiB of answers left unread")

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            self._fail(FRAME_SIZE_ERROR, "a WINDOW_UPDATE frame not 4 bytes long")
            return
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            self.send_window += increment
        elif (call := self.streams.get(stream_id)) is not None:
            call.send_window += increment
        self._window_changed()

    def _window_changed(self) -> None:
        if self._window_grown is not None and not self._window_grown.done():
            self._window_grown.set_result(None)

    # ------------------------------------------------------------------ responses out

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)
            self._written += len(data)

    def respond(self, call: Call, status: Status, message: str = "") -> None:
        """A response without a message: trailers only (every refusal and error)."""
        if self.streams.get(call.stream_id) is not call:
            return  # reset by the client meanwhile
        block = RESPONSE_HEADERS + trailers(status, message)
        self._end(call, frame(HEADERS, END_HEADERS | END_STREAM, call.stream_id, block))

    async def respond_with(self, call: Call, message: bytes) -> None:
        """An OK response carrying `message`, within the peer's windows and our write buffer."""
        if self.streams.get(call.stream_id) is not call:
            return
        data = b"\x00" + len(message).to_bytes(4, "big") + message
        head = frame(HEADERS, END_HEADERS, call.stream_id, RESPONSE_HEADERS)
        if len(data) <= min(self.send_window, call.send_window, self.peer_max_frame) and self._drained is None:
            self._take_window(call, len(data))  # the common case: one write
            self._end(call, head + frame(DATA, 0, call.stream_id, data)
                      + frame(HEADERS, END_HEADERS | END_STREAM, call.stream_id, TRAILERS_OK))
            return
        self._write(head)
        sent = 0
        while sent < len(data):
            if self.transport is None or self.transport.is_closing() or self.streams.get(call.stream_id) is not call:
                return
            if self._drained is not None:
                await self._drained
                continue
            n = min(len(data) - sent, self.send_window, call.send_window, self.peer_max_frame)
            if n <= 0:
                if self._window_grown is None or self._window_grown.done():  # one for every waiting call
                    self._window_grown = asyncio.get_running_loop().create_future()
                await self._window_grown
                continue
            self._take_window(call, n)
            self._write(frame(DATA, 0, call.stream_id, data[sent:sent + n]))
            sent += n
        self._end(call, frame(HEADERS, END_HEADERS | END_STREAM, call.stream_id, TRAILERS_OK))

    def _take_window(self, call: Call, n: int) -> None:
        self.send_window -= n
        call.send_window -= n

    def _end(self, call: Call, frames: bytes) -> None:
        """The stream's last frames: then forgotten; a client still sending is told to stop (RST NO_ERROR)."""
        self.streams.pop(call.stream_id, None)
        if not call.ended:
            frames += frame(RST_STREAM, 0, call.stream_id, struct.pack(">I", NO_ERROR))
        self._write(frames)
        self._stream_closed()

    def _reset(self, call: Call, code: int) -> None:
        self.streams.pop(call.stream_id, None)
        self._abandon(call)
        self._write(frame(RST_STREAM, 0, call.stream_id, struct.pack(">I", code)))
        self._stream_closed()

    def _abandon(self, call: Call) -> None:
        call.reset = True
        call._wake()
        if call.task is not None and not call.task.done():
            call.task.cancel()

    def _stream_closed(self) -> None:
        if not self.streams:
            self._idle_since = asyncio.get_running_loop().time()
            if self.going_away and self.transport is not None:
                self.transport.close()
