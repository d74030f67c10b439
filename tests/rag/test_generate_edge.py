"""The generate extension's bodies under the same edge as /infer (issue 31 row 5), over a real
daemon's Unix socket: the body budget and size answered before the body, body_timeout_s, a
client gone mid-body, and a full generator answered 429 before its body is read."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

from tests.support import rawhttp
from tests.support.rawhttp import connect, read_response

MiB = 1 << 20
PATHS = ("/v2/models/tinylm/generate", "/v2/models/tinylm/generate_stream")


def head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def generate(daemon, **parameters) -> tuple[int, dict]:
    body = json.dumps({"text_input": "Bearing faults ring", "parameters": {"max_new_tokens": 2, **parameters}})
    return rawhttp.request(daemon.socket, "POST", PATHS[0], body)


def _long_tinylm(tiny_repo, tmp_path, **replace: str) -> Path:
    """A repository with the tiny decoder allowed 1000 new tokens (a stream that lasts a while),
    its model.toml's other lines as `replace` says ({"max_running = 8": "max_running = 2"})."""
    repo = tmp_path / "repo"
    shutil.copytree(tiny_repo / "tinylm", repo / "tinylm")
    toml = repo / "tinylm" / "model.toml"
    text = toml.read_text().replace("max_new_tokens_limit = 256", "max_new_tokens_limit = 1000")
    for old, new in replace.items():
        text = text.replace(old, new)
    toml.write_text(text)
    return repo


def _send_stream(s, max_new_tokens: int) -> None:
    """A generate_stream request of the tiny decoder that ignores its stop tokens, sent on `s`."""
    body = json.dumps({"text_input": "Bearing",
                       "parameters": {"max_new_tokens": max_new_tokens, "ignore_stop": True}}).encode()
    s.sendall(head(PATHS[1], len(body)) + body)


def _start_stream(daemon, max_new_tokens: int, events: int = 1):
    """_send_stream's request on a new connection, once its first `events` events have come (it
    is generating): the socket to read the rest from."""
    s = connect(daemon.socket)
    _send_stream(s, max_new_tokens)
    first = b""
    while first.count(b"data: ") < events:
        first += s.recv(65536)
    return s


def _wait_until_queued(daemon, why_not: str) -> None:
    """Until the tiny decoder has a request waiting (within 30 s)."""
    deadline = time.monotonic() + 30
    while rawhttp.request(daemon.socket, "GET", "/v2/models/tinylm/stats")[1]["model_stats"][0]["queue_depth"] < 1:
        assert time.monotonic() < deadline, why_not
        time.sleep(0.005)


def _read_stream(s) -> list[dict]:
    """A generate_stream response read to its end: its events (the connection may then close)."""
    raw = b""
    s.settimeout(60)
    while b'"final": true' not in raw and b'"final":true' not in raw:
        chunk = s.recv(65536)
        if not chunk:
            break
        raw += chunk
    return [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


def test_generate_bodies_meet_the_body_budget_and_timeout_before_they_are_read(start_daemon, tiny_repo):
    daemon = start_daemon(f"[server]\nmax_body_bytes = {MiB}\nmax_inflight_body_bytes = {2 * MiB}\n"
                          "body_timeout_s = 2\n", repo=tiny_repo)
    for path in PATHS:
        with connect(daemon.socket) as s:  # too large: answered from the header alone
            s.sendall(head(path, MiB + 1))
            status, body = read_response(s)
        assert status == 413 and str(MiB) in body["error"], body
        slow = [connect(daemon.socket) for _ in range(2)]  # two bodies in progress hold the whole budget
        try:
            for s in slow:
                s.sendall(head(path, MiB) + b'{"text_input": "')
            time.sleep(0.3)
            with connect(daemon.socket) as s:
                s.sendall(head(path, MiB))
                status, body = read_response(s)
            assert status == 503 and "max_inflight_body_bytes" in body["error"], body
            started = time.monotonic()
            for s in slow:  # and the slow ones are answered 408 once body_timeout_s has passed
                status, body = read_response(s)
                assert status == 408 and "body_timeout_s" in body["error"], body
            assert time.monotonic() - started < 8
        finally:
            for s in slow:
                s.close()
    status, body = generate(daemon)
    assert status == 200 and isinstance(body["text_output"], str), body
    log = daemon.log_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_a_generate_client_gone_mid_body_is_one_info_line(start_daemon, tiny_repo):
    daemon = start_daemon(repo=tiny_repo)
    with connect(daemon.socket) as s:
        s.sendall(head(PATHS[0], 100_000) + b'{"text_input": "' + b"x" * 5000)
        time.sleep(0.3)
    lines = daemon.log_lines_with("closed the connection after", within_s=10)
    log = daemon.log_text()
    assert len(lines) == 1 and "INFO" in lines[0], log[-3000:]
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert generate(daemon)[0] == 200


def test_stream_clients_gone_before_the_first_chunk_are_info_lines(start_daemon, tiny_repo):
    """A client that sends a whole generate_stream request and closes at once is gone before the
    response's headers go out: that write failed outside the handler's guard, and the daemon
    logged an ERROR with a traceback (20 in 300 such clients of a fuzzing run)."""
    daemon = start_daemon(repo=tiny_repo)
    body = json.dumps({"text_input": "Bearing faults ring", "parameters": {"max_new_tokens": 64}}).encode()
    for _ in range(20):
        with connect(daemon.socket) as s:
            s.sendall(head(PATHS[1], len(body)) + body)
    assert daemon.log_lines_with("stream client went away", within_s=10)
    time.sleep(0.5)
    log = daemon.log_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert generate(daemon)[0] == 200


def test_a_full_generator_answers_429_before_the_body(start_daemon, tiny_repo, tmp_path):
    # One sequence generating, one waiting for it (queue_capacity 1): the generator is full, and a
    # request that has sent only its header is answered 429 at once instead of waiting for its body.
    daemon = start_daemon(repo=_long_tinylm(tiny_repo, tmp_path, **{"queue_capacity = 64": "queue_capacity = 1",
                                                                     "max_running = 8": "max_running = 1"}))
    running = _start_stream(daemon, 1000)  # its first event: it is generating
    waiting = connect(daemon.socket)
    try:
        _send_stream(waiting, 1000)
        # Once it waits (its prompt read and tokenized off the loop), and while the first still
        # generates (its 1000 tokens take seconds; a client reading nothing does not slow them):
        _wait_until_queued(daemon, "the second request never waited")
        with connect(daemon.socket) as s:
            s.settimeout(5)
            s.sendall(head(PATHS[0], 1000))  # the header only: a body that would take its time
            status, body = read_response(s)  # before the fix: a timeout, waiting for the body
        assert status == 429 and "queue_capacity 1" in body["error"], (status, body)
    finally:
        running.close()
        waiting.close()
    log = daemon.log_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_sigterm_lets_every_stream_and_waiting_sequence_finish(start_daemon, tiny_repo, tmp_path):
    """Graceful drain with generation under way: two streams generating and a third waiting for
    a decode slot when SIGTERM comes. Each gets all its tokens and its final event, and the
    daemon then exits 0 (within [server] drain_timeout_s)."""
    import signal

    daemon = start_daemon(repo=_long_tinylm(tiny_repo, tmp_path, **{"max_running = 8": "max_running = 2"}))
    streams = [_start_stream(daemon, 600) for _ in range(2)]
    try:
        streams.append(connect(daemon.socket))
        _send_stream(streams[2], 600)
        _wait_until_queued(daemon, "the third request never waited")
        daemon.proc.send_signal(signal.SIGTERM)
        events = [_read_stream(s) for s in streams]
    finally:
        for s in streams:
            s.close()
    for i, stream in enumerate(events):
        final = stream[-1]
        assert final.get("final") is True and final.get("finish_reason") == "length", (i, final)
        assert final.get("completion_tokens") == 600, (i, final)
    assert daemon.proc.wait(timeout=60) == 0
    log = daemon.log_text()
    assert "draining" in log and "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_a_generator_reloaded_mid_stream_finishes_the_stream_on_its_old_version(start_daemon, tiny_repo, tmp_path):
    """Day two: the generator's model.toml changes and it is loaded again through the repository
    API while a stream runs. The stream gets every token from the old version; the next request
    is served by the new one (its new default max_new_tokens)."""
    repo = _long_tinylm(tiny_repo, tmp_path)
    toml = repo / "tinylm" / "model.toml"
    daemon = start_daemon(repo=repo)
    with _start_stream(daemon, 600) as stream:
        text = toml.read_text()
        toml.write_text(re.sub(r"(?m)^max_new_tokens = \d+", "max_new_tokens = 3", text))
        status, answer = rawhttp.request(daemon.socket, "POST", "/v2/repository/models/tinylm/load", b"{}")
        assert status == 200, answer
        events = _read_stream(stream)
    final = events[-1]
    assert final.get("final") is True and final.get("completion_tokens") == 600, final
    status, answer = rawhttp.request(daemon.socket, "POST", PATHS[0], json.dumps(
        {"text_input": "Bearing", "parameters": {"ignore_stop": True}}))
    assert status == 200 and answer.get("completion_tokens") == 3, answer  # the new version's default
    log = daemon.log_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_a_stream_whose_client_leaves_mid_way_stops_generating(start_daemon, tiny_repo, tmp_path):
    """A client that closes its generate_stream connection after a few tokens: its sequence is
    cancelled, its decode slot and KV memory come back, instead of generating its 1000 tokens
    for nobody."""
    daemon = start_daemon(repo=_long_tinylm(tiny_repo, tmp_path))
    _start_stream(daemon, 1000, events=3).close()  # three tokens in, the client leaves

    def stats() -> dict:
        return rawhttp.request(daemon.socket, "GET", "/v2/models/tinylm/stats")[1]["model_stats"][0]

    deadline = time.monotonic() + 10
    while stats()["running"] != 0:
        assert time.monotonic() < deadline, stats()
        time.sleep(0.01)
    now = stats()
    assert now["cancelled"] == 1 and now["kv"]["reserved_bytes"] == 0, now
    assert now["tokens_generated"] < 1000, now


def test_a_stream_still_running_when_the_drain_time_runs_out_ends_with_an_error_event(start_daemon, tiny_repo,
                                                                                       tmp_path):
    """SIGTERM with `drain_timeout_s` shorter than a stream: the stream ran on past the drain
    into the HTTP server's 5 s shutdown, which cut one longer still without a last event. Now the
    generator stops what is left when the drain time runs out (as engine models answer what is
    left queued), and the stream's last event says so."""
    import signal

    daemon = start_daemon("[server]\ndrain_timeout_s = 0.05\n", repo=_long_tinylm(tiny_repo, tmp_path))
    with _start_stream(daemon, 1000) as stream:
        daemon.proc.send_signal(signal.SIGTERM)
        events = _read_stream(stream)
    last = events[-1]
    assert last.get("final") is True and last.get("status") == 503, last
    assert "drain_timeout_s" in last["error"], last
    assert sum(1 for e in events if e.get("text_output") is not None) < 1000
    assert daemon.proc.wait(timeout=60) == 0
    log = daemon.log_text()
    assert "still generating" in log and "Traceback" not in log and " ERROR " not in log, log[-3000:]
