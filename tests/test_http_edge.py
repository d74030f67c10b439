"""The HTTP edge under hostile clients, against a real daemon on its Unix socket (and its HTTPS
listener): connection limits and timeouts, the body memory budget, malformed framing and clients
that vanish."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections import Counter

import numpy as np
import psutil
import pytest

from edge_batcher.transports.http_connections import EVICT_AFTER_IDLE_S
from tests.support import rawhttp
from tests.support.daemon import DaemonProcess, allow_descriptors, require_listen_queue
from tests.support.rawhttp import connect, read_response
from tests.support.signals import windows

INFER = "/v2/models/vibration/infer"


def raw(path, data: bytes) -> tuple[int, dict | str]:
    with connect(path) as s:
        s.sendall(data)
        return read_response(s)


def infer_body(rows: int = 1) -> bytes:
    x = windows(rows)
    return json.dumps({"inputs": [{"name": "signal", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()


def post_head(length: int | None = None, chunked: bool = False) -> bytes:
    head = f"POST {INFER} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    if chunked:
        head += "Transfer-Encoding: chunked\r\n"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + "\r\n").encode()


def closed_by_peer(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        while s.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def limit_lines(daemon) -> list[str]:
    return [line for line in daemon.log_text().splitlines() if "connection limit" in line]


# --------------------------------------------------------------------------- connections


def test_twice_the_connection_limit_held_open_while_a_valid_request_succeeds(start_daemon):
    limit = 20
    daemon = start_daemon(f"[server]\nmax_connections = {limit}\nidle_timeout_s = 60\n")
    held = []
    try:
        for i in range(2 * limit):
            s = connect(daemon.socket)
            if i % 2:  # half of them stop in the middle of their request header
                s.sendall(f"POST {INFER} HTTP/1.1\r\nHost: localhost\r\nX-Slow: ".encode())
            held.append(s)
        time.sleep(EVICT_AFTER_IDLE_S + 0.5)  # a connection gets this long to send its request
        # On a busy machine the daemon may accept the last held connections late, and each is
        # evictable only EVICT_AFTER_IDLE_S after its accept: a 503 then, and 200 soon after.
        deadline = time.monotonic() + 10
        status, body = rawhttp.request(daemon.socket, "POST", INFER, infer_body())
        while status == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
            status, body = rawhttp.request(daemon.socket, "POST", INFER, infer_body())
        assert status == 200, body
        assert [o["name"] for o in body["outputs"]]
        daemon_fds = psutil.Process(daemon.proc.pid).num_fds()
        still_open = sum(not closed_by_peer(s, 0.01) for s in held)
    finally:
        for s in held:
            s.close()
    # The daemon closed the oldest idle connections to stay at its limit, whatever the client does.
    assert still_open <= limit
    assert daemon_fds < 2 * limit + 40, f"{daemon_fds} descriptors open in the daemon"
    lines = limit_lines(daemon)
    assert 1 <= len(lines) <= 2, lines  # one line, then one summary per interval: no flood


def test_a_flood_of_complete_requests_is_answered_none_is_reset(start_daemon):
    # Issue 31 row 9: of 1,500 connections at once, 119 whose complete request was already
    # waiting were reset without an answer (evicted as "idle"), and none got the documented 503.
    limit, n = 64, 600
    daemon = start_daemon(f"[server]\nmax_connections = {limit}\n")
    request = b"GET /v2/health/live HTTP/1.1\r\nHost: localhost\r\n\r\n"
    conns = []
    try:
        for _ in range(n):  # each sends its whole request as soon as it is connected
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(daemon.socket))  # blocking: waits while the listen backlog is full
            s.sendall(request)
            s.settimeout(10)
            conns.append(s)
        answers = Counter()
        for s in conns:
            try:
                status, body = read_response(s)
                answers[status] += 1
                if status == 503:
                    assert "too many connections" in body["error"], body
            except (ConnectionError, OSError) as exc:
                answers[type(exc).__name__] += 1
    finally:
        for s in conns:
            s.close()
    assert set(answers) == {200, 503}, answers
    assert answers[200] >= limit, answers
    assert len(limit_lines(daemon)) <= 2


def test_at_the_limit_with_every_connection_busy_a_new_one_gets_a_json_503(start_daemon):
    limit = 8
    daemon = start_daemon(f"[server]\nmax_connections = {limit}\nbody_timeout_s = 60\n")
    held = []
    try:
        for _ in range(limit):  # each is in the middle of its body: busy, not evictable
            s = connect(daemon.socket)
            s.sendall(post_head(length=1000) + b'{"inputs": [')
            held.append(s)
        time.sleep(0.5)
        status, body = raw(daemon.socket, b"GET /v2/health/live HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert status == 503
        assert "too many connections" in body["error"] and str(limit) in body["error"]
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)  # their disconnects are seen: room again
    assert rawhttp.request(daemon.socket, "GET", "/v2/health/live") == (200, {"live": True})
    log = daemon.log_text()
    assert "Traceback" not in log
    assert len(limit_lines(daemon)) == 1


def test_idle_half_sent_header_and_half_sent_body_connections_time_out(start_daemon):
    daemon = start_daemon("[server]\nidle_timeout_s = 1\nbody_timeout_s = 1\n")
    idle = connect(daemon.socket)
    slow_header = connect(daemon.socket)
    slow_header.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: local")
    after_request = connect(daemon.socket)  # keep-alive after one answered request
    after_request.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert read_response(after_request)[0] == 200
    slow_body = connect(daemon.socket)
    slow_body.sendall(post_head(length=5000) + b'{"inputs": [')
    try:
        status, body = read_response(slow_body)
        assert status == 408 and "body_timeout_s" in body["error"]
        for s in (idle, slow_header, after_request, slow_body):
            assert closed_by_peer(s, 10), "the daemon kept a stalled connection open"
    finally:
        for s in (idle, slow_header, after_request, slow_body):
            s.close()
    assert rawhttp.request(daemon.socket, "GET", "/v2/health/live") == (200, {"live": True})


def test_a_client_that_stops_reading_its_answers_is_disconnected(start_daemon):
    """Pipelined requests whose answers the client never reads: once the daemon's writes have
    waited idle_timeout_s for the client, the connection is aborted (the answers it holds are
    freed), and everyone else is served meanwhile."""
    daemon = start_daemon("[server]\nidle_timeout_s = 1\n")
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(str(daemon.socket))
    request = b"GET /v2/models/vibration HTTP/1.1\r\nHost: localhost\r\n\r\n"
    sender = threading.Thread(target=lambda: _send_quietly(stalled, request * 20000), daemon=True)
    sender.start()
    try:
        time.sleep(4)  # the daemon's writes stall on the unread answers for longer than 1 s
        assert rawhttp.request(daemon.socket, "GET", "/v2/health/live") == (200, {"live": True})
        one_answer = len(rawhttp_raw_answer(daemon.socket, request))
        received, closed = _read_until_closed(stalled, 20)
        assert closed and received < 20000 * one_answer / 4, (
            f"the daemon went on answering a client that does not read: {received} bytes, closed={closed}")
    finally:
        stalled.close()
    assert "Traceback" not in daemon.log_text()


def test_a_slow_reader_is_not_disconnected_while_it_makes_progress(start_daemon):
    """The same pipelined answers read 16 KiB at a time every 50 ms, for longer than
    idle_timeout_s in all: each look finds bytes gone, so the connection stays and every
    answer arrives."""
    daemon = start_daemon("[server]\nidle_timeout_s = 1\n")
    request = b"GET /v2/models/vibration HTTP/1.1\r\nHost: localhost\r\n\r\n"
    n = 3000
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as slow:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(str(daemon.socket))
        threading.Thread(target=lambda: _send_quietly(slow, request * n), daemon=True).start()
        received, started = b"", time.monotonic()
        slow.settimeout(10)
        while received.count(b"HTTP/1.1 200") < n and time.monotonic() - started < 60:
            chunk = slow.recv(16384)
            if not chunk:
                break
            received += chunk
            time.sleep(0.05)
    assert received.count(b"HTTP/1.1 200") == n, f"{received.count(b'HTTP/1.1 200')} of {n} answers"
    assert time.monotonic() - started > 2  # slower than idle_timeout_s, and not cut


def rawhttp_raw_answer(path, request: bytes) -> bytes:
    with connect(path) as s:
        s.sendall(request)
        s.settimeout(10)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _content_length(data):
            data += s.recv(65536)
        return data


def _content_length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].decode().lower()
    return int(head.split("content-length:", 1)[1].split("\r\n", 1)[0])


def _read_until_closed(s: socket.socket, within_s: float) -> tuple[int, bool]:
    received, deadline = 0, time.monotonic() + within_s
    while time.monotonic() < deadline:
        s.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            return received, False
        except ConnectionResetError:
            return received, True
        if not chunk:
            return received, True
        received += len(chunk)
    return received, False


def _send_quietly(s: socket.socket, data: bytes) -> None:
    try:
        s.sendall(data)
    except OSError:
        pass  # the daemon closed it: what the test waits for


# --------------------------------------------------------------------------- framing, disconnects


def test_the_header_deadline_is_kept_whatever_aiohttp_s_keepalive_does(tmp_path):
    """aiohttp before 3.14 leaves a connection open that sends nothing or half a header
    (its keepalive_timeout runs only after an answer): the guard keeps idle_timeout_s itself.
    Here aiohttp's own is an hour, so only the guard's can close them."""
    import asyncio

    from aiohttp import web

    from edge_batcher.transports.http_connections import GuardedAppRunner

    async def run() -> list[bool]:
        async def hello(request: web.Request) -> web.Response:
            return web.json_response({})

        app = web.Application()
        app.router.add_get("/", hello)
        runner = GuardedAppRunner(app, max_connections=8, idle_timeout_s=0.5, keepalive_timeout=3600)
        await runner.setup()
        path = str(tmp_path / "s.sock")
        await web.UnixSite(runner, path).start()
        loop = asyncio.get_running_loop()
        try:
            silent = await loop.run_in_executor(None, connect, path)
            half = await loop.run_in_executor(None, connect, path)
            half.sendall(b"GET / HTTP/1.1\r\nHost: lo")
            return [await loop.run_in_executor(None, closed_by_peer, s, 5) for s in (silent, half)]
        finally:
            await runner.cleanup()

    assert asyncio.run(run()) == [True, True]


def test_malformed_framing_gets_the_json_error_shape(daemon):
    cases = {
        "bad request line": b"HELLO\r\n\r\n",
        "bad method": b"G(T / HTTP/1.1\r\nHost: x\r\n\r\n",
        "bad header": b"GET /v2 HTTP/1.1\r\nHost: x\r\nNo colon here\r\n\r\n",
        "bad version": b"GET /v2 HTTP/9\r\nHost: x\r\n\r\n",
        "bad chunk size": post_head(chunked=True) + b"zz\r\n{}\r\n0\r\n\r\n",
        "chunk without CRLF": post_head(chunked=True) + b"2\r\n{}XX0\r\n\r\n",
        "two lengths": b"POST /v2 HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
    }
    for what, data in cases.items():
        status, body = raw(daemon.socket, data)
        assert status == 400, (what, status, body)
        assert isinstance(body, dict) and body["error"], (what, body)
    assert rawhttp.request(daemon.socket, "GET", "/v2/health/live") == (200, {"live": True})
    log = daemon.log_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_a_client_that_disconnects_mid_body_is_one_info_line(daemon):
    with connect(daemon.socket) as s:
        s.sendall(post_head(length=100_000) + b'{"inputs": [' + b" " * 5000)
        time.sleep(0.3)
    lines = daemon.log_lines_with("closed the connection after", within_s=5)
    log = daemon.log_text()
    assert len(lines) == 1 and "INFO" in lines[0], log[-3000:]
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert rawhttp.request(daemon.socket, "GET", "/v2/health/live") == (200, {"live": True})


# --------------------------------------------------------------------------- body memory


def test_body_size_and_budget_are_answered_before_the_body_is_read(start_daemon):
    mib = 1 << 20
    daemon = start_daemon(f"[server]\nmax_body_bytes = {mib}\nmax_inflight_body_bytes = {2 * mib}\n")
    # Too large: answered from the header alone (nothing of the body is ever sent).
    status, body = raw(daemon.socket, post_head(length=mib + 1))
    assert status == 413 and str(mib) in body["error"]
    held = []
    try:
        for _ in range(2):  # two bodies in progress hold the whole budget
            s = connect(daemon.socket)
            s.sendall(post_head(length=mib) + b"[" * 1000)
            held.append(s)
        time.sleep(0.3)
        status, body = raw(daemon.socket, post_head(length=mib))
        assert status == 503 and "max_inflight_body_bytes" in body["error"], body
        # Small bodies still fit beside them? No: the budget is full, so they wait their turn too.
        status, body = rawhttp.request(daemon.socket, "POST", INFER, infer_body())
        assert status == 503
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    status, body = rawhttp.request(daemon.socket, "POST", INFER, infer_body())
    assert status == 200, body
    # A chunked body over the limit is cut off as it arrives.
    chunk = b"x" * 65536
    data = post_head(chunked=True) + b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(20)) + b"0\r\n\r\n"
    status, body = raw(daemon.socket, data)
    assert status == 413, body


def test_rss_returns_near_baseline_after_a_burst_of_large_bodies(start_daemon):
    # Eight concurrent ~15 MB JSON bodies all admitted at once (a budget of 8 bodies), decoded
    # on threads: the decode needs several times the body size. Bounds are generous on purpose.
    daemon = start_daemon("[server]\nmax_inflight_body_bytes = 134217728\n")
    rows = 2900  # 15 MB of JSON, more rows than the model batches: decoded, then answered 400
    x = np.random.default_rng(0).standard_normal((rows, 256)).astype(np.float32)
    big = json.dumps({"inputs": [{"name": "signal", "shape": [rows, 256], "datatype": "FP32",
                                  "data": x.ravel().tolist()}]}).encode()
    assert 14e6 < len(big) < 16 * 2**20
    proc = psutil.Process(daemon.proc.pid)
    assert rawhttp.request(daemon.socket, "POST", INFER, infer_body())[0] == 200
    baseline = proc.memory_info().rss
    statuses = []

    def send():
        # 120 s: on a loaded machine eight 15 MB bodies decoded at once can hold a send past 30 s
        # (issue 32 saw TimeoutError under a parallel `make test`); the RSS bound is the test.
        statuses.append(rawhttp.request(daemon.socket, "POST", INFER, big, timeout=120)[0])

    for _ in range(2):
        threads = [threading.Thread(target=send) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert statuses == [400] * 16  # decoded, then refused: rows over max_batch_size
    time.sleep(1.0)
    grown = proc.memory_info().rss - baseline
    # Measured here: +29 MB (without the shared malloc heaps and trim: +84 MB; the issue saw +470 MB).
    assert grown < 120e6, f"RSS stayed {grown / 1e6:.0f} MB above its baseline"
    assert rawhttp.request(daemon.socket, "POST", INFER, infer_body())[0] == 200


# --------------------------------------------------------------------------- HTTPS


def test_silent_connections_to_https_are_counted_during_their_handshake(tmp_path, model_repo):
    # asyncio's TLS reaches the handler only after the handshake: 1,200 silent connections to the
    # HTTPS port were never counted, filled the descriptor limit of 1,024, and accept() failed on
    # every listener ("Too many open files" logged 242,359 times in 3 s).
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: cannot make a self-signed certificate")
    allow_descriptors(1400)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=30)
    (tmp_path / "token").write_text("https-token\n")
    (tmp_path / "token").chmod(0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    limit = 64
    daemon = DaemonProcess(tmp_path / "d", f'[server]\nhttp = "127.0.0.1:{port}"\ntoken_file = "{tmp_path / "token"}"\n'
                                          f'tls_cert = "{cert}"\ntls_key = "{key}"\nmax_connections = {limit}\n'
                                          '[models]\nload = ["vibration"]\n', repo=model_repo, nofile=1024)
    daemon.start().wait_ready()
    tls = ssl.create_default_context(cafile=str(cert))

    def https_ready() -> int:
        request = urllib.request.Request(f"https://127.0.0.1:{port}/v2/health/ready",
                                         headers={"Authorization": "Bearer https-token"})
        with urllib.request.urlopen(request, context=tls, timeout=10) as response:
            return response.status

    silent = []
    try:
        assert https_ready() == 200
        proc = psutil.Process(daemon.proc.pid)
        baseline_fds = proc.num_fds()
        for _ in range(1200):
            silent.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        time.sleep(EVICT_AFTER_IDLE_S + 0.5)
        conn = rawhttp.UnixConnection(str(daemon.socket), timeout=5)  # the Unix socket still answers at once
        conn.request("GET", "/v2/health/live")
        assert conn.getresponse().status == 200
        conn.close()
        assert proc.num_fds() <= baseline_fds + limit + 8, "connections in their TLS handshake hold descriptors"
        assert https_ready() == 200  # evicts the oldest silent one
    finally:
        for s in silent:
            s.close()
        daemon.stop()
    log = daemon.log_text()
    assert "Too many open files" not in log and "Traceback" not in log
    assert len(log.splitlines()) < 100, log[-3000:]


def test_a_flood_queued_while_the_daemon_was_stopped_is_accepted_within_the_descriptor_limit(tmp_path, model_repo):
    # As on the gRPC port (test_grpc_edge.py): asyncio accepts as many connections per loop turn
    # as its listen() backlog, each holding a descriptor until admitted or closed. 900 connections
    # queue while the daemon is stopped; it wakes with a limit of 512 descriptors.
    allow_descriptors(1100)
    require_listen_queue(1000)
    (tmp_path / "token").write_text("flood-token\n")
    (tmp_path / "token").chmod(0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = DaemonProcess(tmp_path / "d", f'[server]\nhttp = "127.0.0.1:{port}"\ntoken_file = "{tmp_path / "token"}"\n'
                                          'max_connections = 64\nidle_timeout_s = 2\n[models]\nload = ["vibration"]\n',
                           repo=model_repo, nofile=512)
    daemon.start().wait_ready()
    queued = []
    try:
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            for _ in range(900):
                queued.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while True:  # once the flood is shed, a real client gets through on TCP
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/health/ready",
                                                 headers={"Authorization": "Bearer flood-token"})
                with urllib.request.urlopen(request, timeout=2) as response:
                    assert response.status == 200
                break
            except OSError as exc:
                assert time.monotonic() < deadline, exc
                time.sleep(0.5)
    finally:
        for s in queued:
            s.close()
        daemon.stop()
    log = daemon.log_text()
    assert "Too many open files" not in log and "Traceback" not in log, log[-3000:]
