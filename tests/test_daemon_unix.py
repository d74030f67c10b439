"""End to end over the Unix socket: a real daemon process, real ONNX Runtime sessions."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading

import numpy as np
import onnxruntime as ort
import pytest

from edge_batcher.client import AsyncClient, ClientError
from tests.support import rawhttp
from tests.support.faulty_engine import FAIL, SLOW
from tests.support.signals import windows


def alone(model_repo, x: np.ndarray) -> dict[str, np.ndarray]:
    """Each row run on its own (batch of 1) straight through ONNX Runtime."""
    sess = ort.InferenceSession(str(model_repo / "vibration" / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    rows = [dict(zip(names, sess.run(None, {"signal": x[i:i + 1]}))) for i in range(len(x))]
    return {n: np.concatenate([r[n] for r in rows]) for n in names}


async def _concurrent(url: str, x: np.ndarray, *, binary: bool) -> list[dict[str, np.ndarray]]:
    async with AsyncClient(url, binary=binary) as client:
        return await asyncio.gather(*(client.infer("vibration", {"signal": x[i:i + 1]}) for i in range(len(x))))


def test_concurrent_clients_form_preferred_batches_and_match_single_runs(daemon, model_repo):
    x = windows(240)
    results = asyncio.run(_concurrent(daemon.url, x[:160], binary=True))
    results += asyncio.run(_concurrent(daemon.url, x[160:], binary=False))
    expected = alone(model_repo, x)
    got_ids = np.concatenate([r["class_id"] for r in results])
    got_probs = np.concatenate([r["class_probs"] for r in results])
    np.testing.assert_array_equal(got_ids, expected["class_id"])
    np.testing.assert_allclose(got_probs, expected["class_probs"], rtol=1e-5, atol=1e-6)

    with daemon.client() as client:
        stats = client.stats("vibration")["model_stats"][0]
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}
    assert set(sizes) <= {2, 4, 8}, sizes
    assert sizes.get(8, 0) > 0, f"no full batch of 8 was formed: {sizes}"
    assert stats["inference_count"] == 240
    assert sum(size * count for size, count in sizes.items()) >= 240  # padded rows included

    status, text = rawhttp.request(daemon.socket, "GET", "/metrics")
    assert status == 200
    assert 'edge_batcher_batches_total{model="vibration",size="8",reason="full",target="local"}' in text
    assert 'edge_batcher_requests_total{model="vibration",status="200"} 240' in text
    assert "edge_batcher_queue_seconds_bucket" in text and "edge_batcher_padding_ratio" in text


def test_health_metadata_index_and_stats_endpoints(daemon):
    assert rawhttp.request(daemon.socket, "GET", "/v2/health/live") == (200, {"live": True})
    status, body = rawhttp.request(daemon.socket, "GET", "/v2/health/ready")
    assert status == 200 and body["ready"] is True
    status, body = rawhttp.request(daemon.socket, "GET", "/v2")
    assert status == 200 and "binary_tensor_data" in body["extensions"]
    assert {"system_shared_memory", "cuda_shared_memory"} <= set(body["extensions"])  # as Triton lists them
    status, body = rawhttp.request(daemon.socket, "POST", "/v2/repository/index", "")
    assert status == 200 and {m["name"] for m in body} == {"vibration", "seqsum", "faulty", "oomy"}
    status, body = rawhttp.request(daemon.socket, "GET", "/v2/models/vibration")
    assert status == 200
    assert body["inputs"] == [{"name": "signal", "datatype": "FP32", "shape": [-1, 256]}]
    assert [o["name"] for o in body["outputs"]] == ["class_probs", "class_id", "anomaly_score"]
    assert body["parameters"]["preferred_batch_sizes"] == [2, 4, 8]
    assert rawhttp.request(daemon.socket, "GET", "/v2/models/vibration/ready")[0] == 200
    status, body = rawhttp.request(daemon.socket, "GET", "/v2/models/vibration/stats")
    assert status == 200 and body["model_stats"][0]["name"] == "vibration"


def test_unix_socket_file_mode_is_0660(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o660


def _infer_json(inputs, **extra) -> str:
    return json.dumps({"inputs": inputs, **extra})


def _signal(shape, datatype="FP32", name="signal"):
    n = int(np.prod(shape))
    return [{"name": name, "shape": shape, "datatype": datatype, "data": [0.1] * n}]


@pytest.mark.parametrize(
    "url, body, status, words",
    [
        ("/v2/models/vibration/infer", "{not json", 400, "not valid JSON"),
        ("/v2/models/vibration/infer", _infer_json(_signal([1, 255])), 400, "dimension 1 must be 256"),
        ("/v2/models/vibration/infer", _infer_json(_signal([1, 256], "FP64")), 400,
         "datatype FP64, model 'vibration' expects FP32"),
        ("/v2/models/vibration/infer", _infer_json(_signal([1, 256], name="sig")), 400, "has no input 'sig'"),
        ("/v2/models/vibration/infer", _infer_json([]), 400, "no inputs"),
        ("/v2/models/vibration/infer", _infer_json(_signal([9, 256])), 400,
         "more than model 'vibration' max_batch_size 8"),
        ("/v2/models/vibration/infer", _infer_json(_signal([1, 256]), outputs=[{"name": "nope"}]), 400,
         "has no output 'nope'"),
        ("/v2/models/vibration/infer", _infer_json(_signal([1, 256]), parameters={"timeout_ms": 0}), 504,
         "already passed"),
        ("/v2/models/vibration/infer", _infer_json(_signal([1, 256]), parameters={"priority": 5}), 400,
         "priority 5 is out of range"),
        ("/v2/models/nosuch/infer", _infer_json(_signal([1, 256])), 404, "unknown model 'nosuch'"),
        ("/v2/models/nosuch", None, 404, "unknown model 'nosuch'"),
        ("/v2/nothing/here", None, 404, "no such endpoint"),
    ],
)
def test_bad_requests_get_a_clear_error_and_the_daemon_keeps_serving(daemon, url, body, status, words):
    method = "GET" if body is None else "POST"
    got_status, got = rawhttp.request(daemon.socket, method, url, body)
    assert got_status == status, got
    assert isinstance(got, dict) and words in got["error"], got
    with daemon.client() as client:
        out = client.infer("vibration", {"signal": windows(1)})
    assert out["class_id"].shape == (1,)


def test_wrong_binary_sizes_and_oversized_bodies(daemon):
    header = json.dumps({"inputs": [{"name": "signal", "shape": [1, 256], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 1024}}]}).encode()
    status, got = rawhttp.request(daemon.socket, "POST", "/v2/models/vibration/infer", header + b"\0" * 1000,
                                  {"Inference-Header-Content-Length": str(len(header)),
                                   "Content-Type": "application/octet-stream"})
    assert status == 400 and "short" in got["error"]
    big = b"x" * (2 * 1024 * 1024)  # the test daemon's limit is 1 MiB
    status, got = rawhttp.request(daemon.socket, "POST", "/v2/models/vibration/infer", big)
    assert status == 413 and "too large" in got["error"] and "1048576" in got["error"]
    with daemon.client() as client:
        assert client.infer("vibration", {"signal": windows(2)})["class_id"].shape == (2,)


def test_engine_failure_answers_its_batch_with_500_and_the_daemon_keeps_serving(daemon):
    bad = windows(1)
    bad[0, 0] = FAIL
    with daemon.client() as client:
        with pytest.raises(ClientError) as info:
            client.infer("faulty", {"signal": bad})
        assert info.value.status == 500 and "injected fault" in info.value.message
        assert client.infer("faulty", {"signal": windows(1)})["class_id"].shape == (1,)
        assert client.infer("vibration", {"signal": windows(1)})["class_id"].shape == (1,)
        stats = client.stats("faulty")["model_stats"][0]
    assert stats["inference_stats"]["fail"]["count"] >= 1


def test_request_expires_in_the_queue_behind_a_slow_batch(daemon):
    slow = windows(8)
    slow[:, 0] = SLOW

    async def run():
        async with AsyncClient(daemon.url) as client:
            # Two slow batches (requests of 8 rows: full at once) occupy both batch slots of
            # the single instance for about 1 s.
            blockers = [asyncio.create_task(client.infer("faulty", {"signal": slow})) for _ in range(2)]
            for _ in range(300):
                if (await client.stats("faulty"))["model_stats"][0]["queue_depth"] == 0:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(ClientError) as info:
                await client.infer("faulty", {"signal": windows(1)}, timeout_ms=100)
            await asyncio.gather(*blockers)
            return info.value

    error = asyncio.run(run())
    assert error.status == 504 and "deadline passed after" in error.message and "in the queue" in error.message


def test_a_client_that_disconnects_does_not_break_its_batch(daemon, model_repo):
    x = windows(8, seed=3)
    header = json.dumps({"inputs": [{"name": "signal", "shape": [1, 256], "datatype": "FP32",
                                     "data": x[0].tolist()}]}).encode()

    def hang_up() -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(daemon.socket))
        s.sendall(b"POST /v2/models/vibration/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(header)}\r\n\r\n".encode() + header)
        s.close()  # gone before the answer

    quitters = [threading.Thread(target=hang_up) for _ in range(3)]
    for t in quitters:
        t.start()
    results = asyncio.run(_concurrent(daemon.url, x[1:], binary=True))
    for t in quitters:
        t.join()
    expected = alone(model_repo, x[1:])
    np.testing.assert_array_equal(np.concatenate([r["class_id"] for r in results]), expected["class_id"])
    with daemon.client() as client:
        assert client.live()


def test_variable_length_requests_batch_by_bucket(start_daemon):
    d = start_daemon()
    rng = np.random.default_rng(7)
    lengths = [int(n) for n in rng.integers(1, 33, size=60)]
    rows = [rng.standard_normal((1, n)).astype(np.float32) for n in lengths]

    async def run():
        async with AsyncClient(d.url) as client:
            return await asyncio.gather(*(client.infer("seqsum", {"x": r}) for r in rows))

    results = asyncio.run(run())
    for r, x in zip(results, rows):
        np.testing.assert_allclose(r["sum"], x.sum(axis=1), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(r["peak"], np.abs(x).max(axis=1), rtol=1e-6)
    with d.client() as client:
        stats = client.stats("seqsum")["model_stats"][0]
        with pytest.raises(ClientError) as info:
            client.infer("seqsum", {"x": np.zeros((1, 33), np.float32)})
    assert info.value.status == 400 and "largest bucket" in info.value.message
    assert {b["batch_size"] for b in stats["batch_stats"]} <= {2, 4, 8}
    assert stats["inference_count"] == 60
    assert 0.0 < stats["padding_ratio"] < 1.0


def test_sigterm_drains_queued_requests_before_exit(start_daemon):
    d = start_daemon()
    slow = windows(16)
    slow[:, 0] = SLOW
    answers: list = []

    async def queue_depth(client) -> int:
        return (await client.stats("faulty"))["model_stats"][0]["queue_depth"]

    async def wait_for_depth(client, depth: int) -> None:
        for _ in range(300):
            if await queue_depth(client) == depth:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"queue depth never reached {depth}")

    async def run():
        async with AsyncClient(d.url) as client:
            # Two slow batches of 8 (requests of 8 rows: full at once) take both batch slots of
            # the single instance (0.5 s each)...
            tasks = [asyncio.create_task(client.infer("faulty", {"signal": half}, timeout_ms=20000))
                     for half in (slow[:8], slow[8:])]
            await wait_for_depth(client, 0)
            # ...so these 20 wait in the queue when SIGTERM arrives.
            tasks += [asyncio.create_task(client.infer("faulty", {"signal": x[None]}, timeout_ms=20000))
                      for x in windows(20, seed=5)]
            await wait_for_depth(client, 20)
            d.proc.send_signal(signal.SIGTERM)
            answers.extend(await asyncio.gather(*tasks, return_exceptions=True))

    asyncio.run(run())
    errors = [a for a in answers if isinstance(a, BaseException)]
    assert not errors, errors
    assert len(answers) == 22
    assert d.proc.wait(timeout=30) == 0
    assert not d.socket.exists()
    log = d.log_text()
    assert "draining" in log and "stopped" in log


def test_a_stale_socket_file_is_replaced_but_a_live_one_is_not(start_daemon, model_repo):
    first = start_daemon()
    proc = subprocess.run(
        [sys.executable, "-m", "edge_batcher.cli", "serve", "--unix-socket", str(first.socket),
         "--models", str(model_repo)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "another process is serving" in proc.stderr
    first.proc.kill()  # dies without cleaning up: the socket file stays behind, stale
    first.proc.wait()
    assert first.socket.exists()
    second = start_daemon(socket=first.socket)
    with second.client() as client:
        assert client.infer("vibration", {"signal": windows(1)})["class_id"].shape == (1,)
    assert "removing stale socket" in second.log_text()
