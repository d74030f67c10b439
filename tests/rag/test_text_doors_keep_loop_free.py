"""Issue 31 row 3: the largest texts a client may send, on every door that takes text, never
hold the event loop. A probe asks /v2/health/live on its own connection the whole time; each
answer must come within 250 ms (in one of three attempts per door: the machine is shared).
Before the fix, tokenizing one 15.7 MB text on the loop held it for seconds to minutes (36 s
for the text below on the 2-core VM). What a door still costs the probe is a few tens of ms
(parsing a 16 MiB JSON body holds the GIL ~30 ms on a worker thread: 24-54 ms slowest answers
on a quiet VM), and it grows with the machine's load (60-90 ms beside three busy processes,
over 100 ms while the whole suite ran beside two): the bound leaves room for that, far below
the seconds of stall it guards against.

Embedding texts are cut to `[tokenizer] max_chars` characters before tokenizing (their tokens
beyond max_length are dropped anyway); prompts and questions longer than their character limit
are refused with a 400 naming it, before a token is counted.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from edge_batcher.client import Client
from edge_batcher.protocol import v2
from tests.support import rawhttp
from tests.support.mqtt import TestClient, wait_mqtt

grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the dev extra")
pytest.importorskip("edge_batcher.transports.grpc_v2.server", reason="the grpc extra is not installed")

MAX_BODY = 16 * 1024 * 1024  # [server] max_body_bytes' default, which also bounds MQTT and gRPC messages
SLOWEST_HEALTH_S = 0.250
ATTEMPTS = 3
TEXT = "the bearing fault shows as a peak at the shaft frequency "
PREFIX = "edge-batcher/loopfree"


def long_text(chars: int) -> str:
    return (TEXT * (chars // len(TEXT) + 1))[:chars]


class HealthProbe(threading.Thread):
    """GET /v2/health/live every 10 ms on one keep-alive connection; the slowest answer seen."""

    def __init__(self, socket_path):
        super().__init__(daemon=True)
        self.socket_path = socket_path
        self.stopped = threading.Event()
        self.slowest = 0.0
        self.count = 0

    def run(self) -> None:
        conn = rawhttp.UnixConnection(str(self.socket_path), timeout=120)
        try:
            while not self.stopped.is_set():
                t0 = time.perf_counter()
                conn.request("GET", "/v2/health/live")
                resp = conn.getresponse()
                resp.read()
                assert resp.status == 200
                self.slowest = max(self.slowest, time.perf_counter() - t0)
                self.count += 1
                self.stopped.wait(0.01)
        finally:
            conn.close()

    def __enter__(self) -> HealthProbe:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.join(130)


def v2_text(name: str, texts: list[str]) -> bytes:
    return json.dumps({"inputs": [{"name": name, "shape": [len(texts)], "datatype": "BYTES",
                                   "data": texts}]}).encode()


def test_the_largest_texts_on_every_door_leave_health_answered_within_250_ms(start_daemon, broker, tmp_path):
    daemon = start_daemon(f'[server]\ngrpc = ["unix:{tmp_path / "grpc.sock"}"]\n'
                          '[models]\nload = ["minilm", "tinylm", "rag"]\n'
                          f'[mqtt]\nenabled = true\nhost = "127.0.0.1"\nport = {broker.port}\n'
                          f'topic_prefix = "{PREFIX}"\n')
    wait_mqtt(daemon)
    huge = long_text(MAX_BODY - 1024)  # one text as large as a body may be
    rows = [long_text(MAX_BODY // 8 - 1024).encode()] * 8  # the most rows minilm takes, as large as they may be
    binary_rows, header_length = v2.encode_request({"text": np.array(rows, dtype=object)}, binary_outputs=False)
    bodies = {"http-json": v2_text("text", [huge]), "generate": json.dumps({"text_input": huge}).encode(),
              "question": v2_text("question", [huge]), "prompt": v2_text("text_input", [huge])}
    assert all(len(b) <= MAX_BODY for b in [binary_rows, *bodies.values()])
    grpc_input = grpcclient.InferInput("text", [1], "BYTES")
    grpc_input.set_data_from_numpy(np.array([huge.encode()], dtype=object))
    with Client(daemon.url, timeout=30) as client:
        # Longer than max_length (128) tokens already: truncated to the same first tokens as the huge text.
        short = client.infer("minilm", {"text": np.array([long_text(2000).encode()], dtype=object)})["embedding"][0]

    def post(path: str, body: bytes, headers: dict | None = None):
        return lambda: rawhttp.request(daemon.socket, "POST", path, body, headers)

    def over_mqtt(model: str, body: bytes):
        def send():
            mqtt.publish(f"{PREFIX}/infer/{model}", body, correlation=model.encode())
            (reply,) = mqtt.collect(1, timeout=120)
            return int(reply.status), reply.json()
        return send

    def over_grpc():
        result = grpc.infer("minilm", [grpc_input], client_timeout=120)
        return 200, {"outputs": [{"data": result.as_numpy("embedding").ravel().tolist(), "shape": [1, 384]}]}

    doors = {
        "http-json": post("/v2/models/minilm/infer", bodies["http-json"]),
        "http-binary-rows": post("/v2/models/minilm/infer", binary_rows,
                                 {"Content-Type": "application/octet-stream",
                                  "Inference-Header-Content-Length": str(header_length)}),
        "mqtt": over_mqtt("minilm", bodies["http-json"]),
        "grpc": over_grpc,
        "generate": post("/v2/models/tinylm/generate", bodies["generate"]),
        "prompt-mqtt": over_mqtt("tinylm", bodies["prompt"]),
        "question": post("/v2/models/rag/infer", bodies["question"]),
    }
    mqtt = TestClient(broker.port)
    grpc = grpcclient.InferenceServerClient(f"unix:{tmp_path / 'grpc.sock'}")
    answers: dict = {}
    slowest: dict[str, list[float]] = {}
    try:
        for name, send in doors.items():
            # What a door costs the loop is the same each time; what the other processes on a
            # shared 2-core machine cost it is not: a door passes when one of ATTEMPTS does.
            for _ in range(ATTEMPTS):
                with HealthProbe(daemon.socket) as probe:
                    answers[name] = send()
                    time.sleep(0.2)  # what the daemon does after answering counts too
                assert probe.count >= 10, (name, probe.count)
                slowest.setdefault(name, []).append(round(probe.slowest * 1000, 1))
                if probe.slowest < SLOWEST_HEALTH_S:
                    break
    finally:
        mqtt.close()
        grpc.close()

    for name in ("http-json", "http-binary-rows", "mqtt", "grpc"):
        status, body = answers[name]
        assert status == 200, (name, body)
        embeddings = np.array(body["outputs"][0]["data"], dtype=np.float32).reshape(body["outputs"][0]["shape"])
        # The text is cut, not refused: its embedding is that of its first max_length tokens.
        assert np.allclose(embeddings, short, atol=1e-4), name
    # tinylm's max_context is 1024 tokens: 16 x 1024 characters; rag's max_question_chars is 2000.
    for name, words in (("generate", "model 'tinylm' reads at most 16384 characters"),
                        ("prompt-mqtt", "model 'tinylm' reads at most 16384 characters"),
                        ("question", "model 'rag' reads at most 2000 characters")):
        status, body = answers[name]
        assert status == 400 and words in body["error"], (name, status, body)
    print("slowest health answer (ms) by door and attempt:", slowest)
    assert all(min(ms) < SLOWEST_HEALTH_S * 1000 for ms in slowest.values()), (
        f"slowest health answer (ms) by door and attempt: {slowest}")
    log = daemon.log_text()
    assert "Traceback" not in log, log[-3000:]
