"""The daemon's own HTTP/2 for gRPC (transports/grpc_v2/http2.py) against grpcio's client, on a
real Unix socket: messages larger than every window both ways, many calls on one connection
without cross-talk, cancelled calls, compressed messages, error details, clients that do not
speak HTTP/2 and connections left idle. The service here echoes (or fails) so that the framing
is tested on its own; the daemon's RPCs over it are in test_grpc_edge.py and test_triton_tools.py."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc", reason="grpcio (a test dependency) is not installed")
http2 = pytest.importorskip("edge_batcher.transports.grpc_v2.http2", reason="the grpc extra is not installed")
grpc_headers = pytest.importorskip("edge_batcher.transports.grpc_v2.headers", reason="the grpc extra is not installed")
from edge_batcher.transports.grpc_v2.call import CallError, Status, StreamReset, parse_grpc_timeout  # noqa: E402

MiB = 1 << 20


class EchoServer:
    """GrpcConnection on a Unix socket, in a loop of its own thread: /t/Echo answers the message,
    /t/Fail answers its text as an INVALID_ARGUMENT, /t/Hold waits until cancelled."""

    def __init__(self, path: Path, idle_timeout_s: float = 30.0):
        self.path = path
        self.idle_timeout_s = idle_timeout_s
        self.connections: set = set()
        self.cancelled = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EchoServer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        def connection():
            return http2.GrpcConnection(self.dispatch, idle_timeout_s=self.idle_timeout_s, unix=True,
                                        admit=lambda c: self.connections.add(c) or True,
                                        closed=self.connections.discard)

        self.loop.run_until_complete(self.loop.create_unix_server(connection, str(self.path)))
        self._ready.set()
        self.loop.run_forever()

    def dispatch(self, call) -> None:
        call.task = self.loop.create_task(self._serve(call))

    async def _serve(self, call) -> None:
        try:
            view = await call.read_message(64 * MiB)  # a view of the call's body
            message = bytes(view)
            if call.path == "/t/Echo":
                await call.conn.respond_with(call, message)
            elif call.path == "/t/Fail":
                call.conn.respond(call, Status.INVALID_ARGUMENT, message.decode())
            elif call.path == "/t/Hold":
                await asyncio.sleep(3600)  # holding its message's view, as the daemon's parse does
            else:
                call.conn.respond(call, Status.UNIMPLEMENTED, f"Method not found: {call.path}")
        except CallError as exc:
            call.conn.respond(call, exc.status, exc.message)
        except (asyncio.CancelledError, StreamReset):
            self.cancelled += 1


@pytest.fixture
def echo(tmp_path):
    with EchoServer(tmp_path / "h2.sock") as server:
        yield server


def _channel(server: EchoServer, **options) -> grpc.Channel:
    opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    return grpc.insecure_channel(f"unix:{server.path}", options=opts + list(options.items()))


def test_messages_larger_than_every_window_come_back_whole(echo):
    # 5 MiB: 80 times HTTP/2's initial window and 320 frames of 16 KiB, each way
    payload = bytes(range(256)) * (5 * MiB // 256)
    with _channel(echo) as channel:
        assert channel.unary_unary("/t/Echo")(payload, timeout=30) == payload
        assert channel.unary_unary("/t/Echo")(b"", timeout=30) == b""


def _frames(sock: socket.socket, seconds: float):
    """The frames (kind, flags, stream, payload) a raw client reads within `seconds`."""
    buf, deadline = b"", time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        buf += chunk
        while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
            length = int.from_bytes(buf[:3], "big")
            yield buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF, buf[9:9 + length]
            buf = buf[9 + length:]


def _call_headers(encoder, path: str = "/t/Echo") -> bytes:
    """A raw client's request header block for a gRPC call to `path`."""
    return encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
                           ("content-type", "application/grpc"), ("te", "trailers")])


def _answer(sock: socket.socket, stream: int, seconds: float = 10.0) -> bytes:
    """What a raw client reads as `stream`'s answer: its DATA, up to its trailers."""
    answer = b""
    for kind, flags, at, payload in _frames(sock, seconds):
        if kind == http2.DATA and at == stream:
            answer += payload
        elif kind == http2.HEADERS and at == stream and flags & http2.END_STREAM:
            break
    return answer


def test_a_large_message_gets_its_whole_window_once_its_length_is_read(echo):
    # A 0.9 MB frame took a WINDOW_UPDATE round trip per 16 KiB frame (gRPC 0.69x HTTP's
    # throughput for camera frames): once the handler reads the message and its 5-byte prefix
    # has come, the stream's window opens for all of it at once.
    hpack = pytest.importorskip("hpack")
    size = MiB
    message = b"\x00" + size.to_bytes(4, "big") + bytes(size)
    headers = _call_headers(hpack.Encoder())
    chunk = http2.DEFAULT_FRAME
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(echo.path))
        s.sendall(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0)
                  + http2.frame(http2.HEADERS, http2.END_HEADERS, 1, headers)
                  + http2.frame(http2.DATA, 0, 1, message[:chunk]))
        granted = http2.DEFAULT_WINDOW
        for kind, _, stream, payload in _frames(s, 2.0):
            if kind == http2.WINDOW_UPDATE and stream == 1:
                granted += int.from_bytes(payload, "big")
                if granted >= len(message):
                    break
        assert granted >= len(message), f"the stream may send {granted} bytes of a {len(message)}-byte message"
        # The rest in one DATA frame: frames up to MAX_FRAME (1 MiB, advertised) are accepted.
        assert http2.DEFAULT_FRAME < len(message) - chunk <= http2.MAX_FRAME
        rest = [message[chunk:]]
        s.sendall(b"".join(http2.frame(http2.DATA, http2.END_STREAM if i == len(rest) - 1 else 0, 1, part)
                           for i, part in enumerate(rest)))
        s.sendall(http2.frame(http2.WINDOW_UPDATE, 0, 0, (2**31 - 1 - 65535).to_bytes(4, "big"))
                  + http2.frame(http2.SETTINGS, 0, 0, (0x4).to_bytes(2, "big") + (2**31 - 1).to_bytes(4, "big")))
        assert _answer(s, 1) == message


def test_concurrent_calls_on_one_connection_get_their_own_answers(echo):
    with _channel(echo) as channel:
        echo_call = channel.unary_unary("/t/Echo")
        sizes = [1, 100, 70_000, 5, 300_000] * 40  # some beyond a stream's window, most not
        futures = [echo_call.future(bytes([i % 251]) * n, timeout=60) for i, n in enumerate(sizes)]
        for i, (n, future) in enumerate(zip(sizes, futures, strict=True)):
            assert future.result() == bytes([i % 251]) * n
    assert len(echo.connections) <= 1


def test_answers_wait_for_the_clients_window_without_losing_one_another(echo):
    # a client granting small windows: every large answer waits for WINDOW_UPDATEs, many at once
    with _channel(echo, **{"grpc.http2.bdp_probe": 0, "grpc.http2.lookahead_bytes": 16384}) as channel:
        echo_call = channel.unary_unary("/t/Echo")
        futures = [echo_call.future(bytes([i]) * 300_000, timeout=60) for i in range(24)]
        assert [f.result() for f in futures] == [bytes([i]) * 300_000 for i in range(24)]


def test_errors_carry_their_status_and_details(echo):
    with _channel(echo) as channel:
        with pytest.raises(grpc.RpcError) as failed:
            channel.unary_unary("/t/Fail")("shape [2, 3] is not [-1, 256]: 100 % wrong — ünïcode".encode(), timeout=10)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert failed.value.details() == "shape [2, 3] is not [-1, 256]: 100 % wrong — ünïcode"
        with pytest.raises(grpc.RpcError) as unknown:
            channel.unary_unary("/t/Nope")(b"x", timeout=10)
        assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED and "/t/Nope" in unknown.value.details()
        assert channel.unary_unary("/t/Echo")(b"still fine", timeout=10) == b"still fine"


def test_compressed_messages_are_refused_by_name(echo):
    with _channel(echo) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary("/t/Echo")(b"a" * 1000, timeout=10, compression=grpc.Compression.Gzip)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "compressed messages are not supported" in refused.value.details()


def test_a_call_past_its_deadline_is_cancelled_on_the_server_and_the_connection_serves_on(echo):
    with _channel(echo) as channel:
        with pytest.raises(grpc.RpcError) as late:
            channel.unary_unary("/t/Hold")(b"x", timeout=0.3)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 5
        while echo.cancelled < 1:  # the client's RST_STREAM reached the server's call
            assert time.monotonic() < deadline, "the held call was never cancelled"
            time.sleep(0.05)
        assert channel.unary_unary("/t/Echo")(b"next", timeout=10) == b"next"


def test_a_client_that_does_not_speak_http2_is_closed(echo):
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(echo.path))
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while chunk := s.recv(65536):
            received += chunk
    # the server's SETTINGS, then GOAWAY(PROTOCOL_ERROR) naming the problem, then the close
    assert b"not HTTP/2" in received
    with _channel(echo) as channel:
        assert channel.unary_unary("/t/Echo")(b"ok", timeout=10) == b"ok"


def _goaway_text(echo, after_preface: bytes) -> bytes:
    """All the daemon answers a connection that sends these bytes after the preface, to its close."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(echo.path))
        s.sendall(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0) + after_preface)
        received = b""
        try:
            while chunk := s.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    return received


def test_broken_framing_after_the_preface_closes_only_that_connection(echo):
    size = http2.MAX_FRAME + 1
    oversized = size.to_bytes(3, "big") + bytes([0, 0]) + (1).to_bytes(4, "big")
    assert f"a frame of {size} bytes".encode() in _goaway_text(echo, oversized + b"\0" * 20000)
    with _channel(echo) as channel:
        assert channel.unary_unary("/t/Echo")(b"ok", timeout=10) == b"ok"


def test_a_header_block_over_the_limit_in_one_frame_closes_only_that_connection(echo):
    """DATA frames may be 1 MiB; a HEADERS frame that size would hand pure-Python HPACK a 1 MiB
    block (table size updates decode to nothing, so the header list limit never stops it)."""
    limit = grpc_headers.MAX_HEADER_LIST
    block = b"\x20" * (limit + 1)  # dynamic table size updates to 0, over and over
    received = _goaway_text(echo, http2.frame(http2.HEADERS, http2.END_HEADERS, 1, block))
    assert f"a header block over {limit} bytes".encode() in received
    with _channel(echo) as channel:
        assert channel.unary_unary("/t/Echo")(b"ok", timeout=10) == b"ok"


def test_a_client_that_floods_pings_without_reading_the_answers_is_disconnected(echo):
    ping = http2.frame(http2.PING, 0, 0, b"12345678")
    burst = ping * 4096  # 100 KiB of PINGs a write
    sent = 0
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(echo.path))
        s.sendall(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0))
        with pytest.raises(OSError):  # reset or broken pipe once the daemon gives up on us
            while sent < 64 * MiB:
                s.sendall(burst)
                sent += len(burst)
    assert sent < 64 * MiB
    with _channel(echo) as channel:
        assert channel.unary_unary("/t/Echo")(b"ok", timeout=10) == b"ok"


def test_pings_answered_while_the_client_reads_nothing_are_held_and_all_delivered_later(echo):
    """While writing is paused, PING acknowledgements wait in one buffer of the connection's
    (not one transport write each: on Python 3.12 each write sums the transport's buffered
    chunks, and 2 MiB of 17-byte answers made a flood quadratic); once the client reads, every
    one arrives, in order."""
    n = 120_000  # ~2 MiB of acknowledgements: past the socket's buffers, under MAX_UNREAD_CONTROL
    pings = b"".join(http2.frame(http2.PING, 0, 0, i.to_bytes(8, "big")) for i in range(n))
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(echo.path))
        s.sendall(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0) + pings)
        (conn,) = echo.connections
        deadline = time.monotonic() + 10
        while not conn._held_control and time.monotonic() < deadline:
            time.sleep(0.01)
        assert conn._held_control, "the acknowledgements went to the transport one by one"
        assert conn.transport is not None and not conn.transport.is_closing()
        received = bytearray()
        acks: list[int] = []
        while len(acks) < n:
            chunk = s.recv(1 << 20)
            assert chunk, f"connection closed after {len(acks)} of {n} acknowledgements"
            received += chunk
            while len(received) >= 9:
                size = int.from_bytes(received[:3], "big")
                if len(received) < 9 + size:
                    break
                kind, flags, payload = received[3], received[4], bytes(received[9:9 + size])
                del received[:9 + size]
                if kind == http2.PING and flags & http2.ACK:
                    acks.append(int.from_bytes(payload, "big"))
    assert acks == list(range(n))


def _echo_calls(n: int) -> tuple[bytes, bytes]:
    """A raw HTTP/2 client's preface, windows opened wide (so only reading limits our answers) and
    `n` /t/Echo calls of one 8 KiB message each; and that message as framed."""
    hpack = pytest.importorskip("hpack")
    encoder = hpack.Encoder()
    message = b"\x00" + (8192).to_bytes(4, "big") + b"x" * 8192
    calls = bytearray(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0, (0x4).to_bytes(2, "big")
                                                  + (2**31 - 1).to_bytes(4, "big"))
                      + http2.frame(http2.WINDOW_UPDATE, 0, 0, (2**31 - 1 - 65535).to_bytes(4, "big")))
    for stream in range(1, 2 * n, 2):
        calls += http2.frame(http2.HEADERS, http2.END_HEADERS, stream, _call_headers(encoder))
        calls += http2.frame(http2.DATA, http2.END_STREAM, stream, message)
    return bytes(calls), message


def test_a_client_that_stops_reading_its_answers_is_disconnected(tmp_path):
    """1,000 echo calls of 8 KiB whose answers the client never reads (its windows wide open):
    once the server's writes have waited idle_timeout_s, the connection is aborted."""
    calls, _ = _echo_calls(1000)
    with EchoServer(tmp_path / "stall.sock", idle_timeout_s=0.5) as server, socket.socket(socket.AF_UNIX) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(str(server.path))
        s.sendall(calls)
        time.sleep(2)  # the server's writes wait on us for longer than 0.5 s
        received, closed = 0, False
        s.settimeout(10)
        try:
            while chunk := s.recv(65536):
                received += len(chunk)
            closed = True
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            pass
        assert closed and received < len(calls) / 4, f"{received} bytes of answers, closed={closed}"
        with _channel(server) as channel:
            assert channel.unary_unary("/t/Echo")(b"ok", timeout=10) == b"ok"


@pytest.mark.parametrize("before, now, verdict", [
    ((1000, 5000), (1000, 5000), True),   # nothing taken by the kernel, nothing read from it
    ((1000, 5000), (1000, 4000), False),  # the client read: the kernel holds less
    ((1000, 5000), (3000, 5000), False),  # the client read and the kernel took more from us
    ((1000, 0), (1000, 0), True),         # a transport whose kernel queue cannot be asked
])
def test_a_stall_is_nothing_read_whatever_the_write_buffer_did(before, now, verdict):
    """The look every idle_timeout_s (CI failure: calls finishing while writing was paused added
    their headers to the buffer faster than a slow reader drained it, so it was cut)."""
    assert http2.stalled(before, now) is verdict


def test_a_slow_reader_keeps_its_connection_while_it_makes_progress(tmp_path):
    """The same 1,000 answers read 16 KiB at a time every 20 ms (longer in all than idle_timeout_s):
    bytes leave between every two looks, so nothing is aborted and every answer arrives whole."""
    calls, message = _echo_calls(1000)
    with EchoServer(tmp_path / "slow.sock", idle_timeout_s=0.5) as server, socket.socket(socket.AF_UNIX) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(str(server.path))
        s.sendall(calls)
        s.settimeout(10)
        received, started = 0, time.monotonic()
        while received < 1000 * len(message) and time.monotonic() - started < 60:
            chunk = s.recv(16384)
            if not chunk:
                break
            received += len(chunk)
            time.sleep(0.02)
        assert received >= 1000 * len(message), f"{received} bytes of answers before the connection ended"
        assert time.monotonic() - started > 0.5  # slower than idle_timeout_s, and not cut


def test_an_idle_connection_is_closed_after_the_idle_timeout(tmp_path):
    with EchoServer(tmp_path / "idle.sock", idle_timeout_s=0.5) as server:
        with socket.socket(socket.AF_UNIX) as silent:
            silent.connect(str(server.path))
            silent.settimeout(5)
            started = time.monotonic()
            while silent.recv(65536):  # SETTINGS, then the close
                pass
            assert time.monotonic() - started < 3
        with _channel(server) as channel:  # and a new connection is served
            assert channel.unary_unary("/t/Echo")(b"x", timeout=10) == b"x"


@pytest.mark.parametrize(("header", "seconds"), [("100m", 0.1), ("5S", 5.0), ("2M", 120.0), ("1H", 3600.0),
                                                 ("250u", 250e-6), ("7n", 7e-9)])
def test_grpc_timeouts_are_read_in_their_units(header, seconds):
    assert parse_grpc_timeout(header) == pytest.approx(seconds)


@pytest.mark.parametrize("header", ["", "m", "100", "100x", "123456789S", "-5S"])
def test_malformed_grpc_timeouts_are_ignored(header):
    assert parse_grpc_timeout(header) is None


def test_a_remembered_header_block_is_decoded_again_once_the_table_has_changed():
    hpack = pytest.importorskip("hpack")
    encoder, decoder = hpack.Encoder(), grpc_headers.HeaderDecoder()
    newest_entry = b"\xbe"  # HPACK index 62: the dynamic table's most recent entry
    first = decoder.decode(encoder.encode([(":path", "/a/B"), ("x-user", "ann")]))  # both indexed: the table changes
    assert first.path == "/a/B" and first.metadata == (("x-user", "ann"),)
    assert decoder.decode(newest_entry).metadata == (("x-user", "ann"),)
    assert decoder.decode(newest_entry) is decoder.decode(newest_entry)  # unchanged table: remembered
    decoder.decode(encoder.encode([("x-user", "bob")]))  # a new newest entry
    assert decoder.decode(newest_entry).metadata == (("x-user", "bob"),)


def test_header_blocks_are_read_into_a_calls_path_metadata_deadline_and_refusal():
    hpack = pytest.importorskip("hpack")
    encoder, decoder = hpack.Encoder(), grpc_headers.HeaderDecoder()
    call = decoder.decode(encoder.encode([(":method", "POST"), (":path", "/s/M"), ("content-type", "application/grpc"),
                                          ("grpc-timeout", "250m"), ("authorization", "Bearer t")]))
    metadata = (("content-type", "application/grpc"), ("authorization", "Bearer t"))
    assert call == grpc_headers.CallHeaders("/s/M", metadata, None, 0.25)
    refused = decoder.decode(encoder.encode([(":method", "GET"), (":path", "/s/M")]))
    assert refused.refusal == "method GET: gRPC calls are POST"


def test_a_block_may_open_with_two_table_size_updates_not_more():
    """RFC 7541 allows two (after a SETTINGS_HEADER_TABLE_SIZE change); hpack takes any number,
    each decoding to nothing: 16 KiB of them kept the event loop 28 ms."""
    hpack = pytest.importorskip("hpack")
    decoder = grpc_headers.HeaderDecoder()
    path = hpack.Encoder().encode([(":path", "/s/M")], huffman=False)
    two = b"\x3f\xe1\x1f" + b"\x20"  # size 4096 (a multi-byte integer), then 0
    assert decoder.decode(two + path).path == "/s/M"
    with pytest.raises(hpack.HPACKDecodingError, match="more than 2 dynamic table size updates"):
        grpc_headers.HeaderDecoder().decode(two + b"\x20" + path)


def test_a_padded_data_frame_gives_its_message_without_the_padding(echo):
    """DATA frames are appended to their call from the connection's buffer (no copy first):
    the PADDED flag's length byte and padding must still stay out of the message."""
    hpack = pytest.importorskip("hpack")
    message = b"\x00" + (5).to_bytes(4, "big") + b"hello"
    headers = _call_headers(hpack.Encoder())
    padded = bytes([7]) + message + b"\xff" * 7
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(echo.path))
        s.sendall(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0)
                  + http2.frame(http2.HEADERS, http2.END_HEADERS, 1, headers)
                  + http2.frame(http2.DATA, http2.PADDED | http2.END_STREAM, 1, padded))
        answer = _answer(s, 1)
    assert answer == message


def test_bytes_after_a_calls_message_are_dropped_and_the_connection_serves_on(echo):
    """The handler gets its message as a view of the call's body, not a copy, so the body cannot
    grow any more: a client that sends more after the message was read (a unary call carries
    one) has those bytes dropped, and its connection serves its next call."""
    hpack = pytest.importorskip("hpack")
    encoder = hpack.Encoder()
    message = b"\x00" + (5).to_bytes(4, "big") + b"hello"
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(echo.path))
        s.sendall(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0)
                  + http2.frame(http2.HEADERS, http2.END_HEADERS, 1, _call_headers(encoder, "/t/Hold"))
                  + http2.frame(http2.DATA, 0, 1, message))
        time.sleep(0.3)  # the handler has read its message and holds the call
        s.sendall(http2.frame(http2.DATA, 0, 1, b"trailing bytes")
                  + http2.frame(http2.HEADERS, http2.END_HEADERS, 3, _call_headers(encoder))
                  + http2.frame(http2.DATA, http2.END_STREAM, 3, message))
        answer = _answer(s, 3)
    assert answer == message
