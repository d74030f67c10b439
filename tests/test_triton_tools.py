"""Triton's own clients against a daemon subprocess: tritonclient.http on TCP and tritonclient.grpc
on TCP and on the Unix socket. Model config, versioned paths, Triton's priority scale under load,
statistics counts, binary and JSON tensors, bad input mapped to the right status.

tritonclient is blocking (gevent for HTTP), so these tests are plain functions, and concurrent
requests go through the clients' own async_infer.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tests.support.daemon import DaemonProcess
from tests.support.faulty_engine import HELD, RELEASE_ENV, SLOW
from tests.support.models import add_vibration_variant
from tests.support.ports import free_port

httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the dev extra")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is in the dev extra")
pytest.importorskip("edge_batcher.transports.grpc_v2.server", reason="the grpc extra is not installed")
from google.protobuf import json_format  # noqa: E402
from tritonclient.grpc import model_config_pb2  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

TOKEN = "triton-tools-token"
GRPC_HEADERS = {"authorization": f"Bearer {TOKEN}"}
OUTPUTS = ("class_probs", "class_id", "anomaly_score")


def headers() -> dict[str, str]:
    """A fresh dict per call: tritonclient.http's infer() adds Inference-Header-Content-Length to
    the dict it is given, which a later JSON request must not carry."""
    return {"Authorization": f"Bearer {TOKEN}"}


class Endpoints:
    def __init__(self, home: Path, model_repo: Path):
        self.http = f"127.0.0.1:{free_port()}"
        self.grpc_tcp = f"127.0.0.1:{free_port()}"
        self.grpc_unix = f"unix:{home / 'grpc.sock'}"
        (home / "token").write_text(TOKEN + "\n")
        config = (f'[server]\nhttp = "{self.http}"\ntoken_file = "{home / "token"}"\n'
                  f'grpc = ["{self.grpc_tcp}", "{self.grpc_unix}"]\n'
                  '[models]\nload = ["vibration", "faulty"]\n')
        self.release = home / "release"  # tests/support/faulty_engine.py: HELD batches wait for it
        self.daemon = DaemonProcess(home, config, repo=model_repo, env={RELEASE_ENV: str(self.release)})
        self.model_repo = model_repo

    def http_client(self):
        return httpclient.InferenceServerClient(self.http, concurrency=32)

    def grpc_client(self, where: str = "tcp"):
        return grpcclient.InferenceServerClient(self.grpc_tcp if where == "tcp" else self.grpc_unix)


@pytest.fixture(scope="module")
def endpoints(tmp_path_factory, model_repo):
    repo = tmp_path_factory.mktemp("triton-repo")
    shutil.copytree(model_repo / "vibration", repo / "vibration")
    # Three levels with the middle one as the default: on Triton's scale priority 1 is the top
    # level (the scheduler's 2), not the default (the scheduler's 1, which the old scale gave).
    add_vibration_variant(repo, "faulty", "tests.support.faulty_engine:FaultyOnnxEngine",
                          "max_queue_delay_ms = 2.0\npriority_levels = 3\ndefault_priority = 1\nqueue_capacity = 64\n"
                          "default_timeout_ms = 15000\n")  # the queue waits behind two held batches
    e = Endpoints(tmp_path_factory.mktemp("triton-tools"), repo)
    e.daemon.start().wait_ready()
    yield e
    assert e.daemon.stop() == 0


def _windows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 256)).astype(np.float32)


def _expected(model_repo: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(str(model_repo / "vibration" / "model.onnx"), providers=["CPUExecutionProvider"])
    rows = [dict(zip(OUTPUTS, sess.run(list(OUTPUTS), {"signal": x[i:i + 1]}), strict=True)) for i in range(len(x))]
    return {n: np.concatenate([r[n] for r in rows]) for n in OUTPUTS}


def _http_infer(client, x, *, binary=True, model="vibration", **kwargs):
    inp = httpclient.InferInput("signal", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in OUTPUTS]
    return client.infer(model, [inp], outputs=outs, headers=headers(), **kwargs)


def _grpc_input(x):
    inp = grpcclient.InferInput("signal", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def _grpc_infer(client, x, *, model="vibration", **kwargs):
    return client.infer(model, [_grpc_input(x)], headers=GRPC_HEADERS, **kwargs)


@pytest.mark.parametrize("transport", ["http-binary", "http-json", "grpc-tcp", "grpc-unix"])
def test_outputs_equal_onnx_runtime_run_alone(endpoints, transport) -> None:
    x = _windows(3, seed=5)
    if transport.startswith("http"):
        client = endpoints.http_client()
        result = _http_infer(client, x, binary=transport == "http-binary", model_version="1")
    else:
        client = endpoints.grpc_client(transport.split("-")[1])
        result = _grpc_infer(client, x, model_version="1")
    got = {n: result.as_numpy(n) for n in OUTPUTS}
    client.close()
    want = _expected(endpoints.model_repo, x)
    np.testing.assert_array_equal(got["class_id"], want["class_id"])
    for name in ("class_probs", "anomaly_score"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_model_config_is_the_same_tritons_config_on_http_and_grpc(endpoints) -> None:
    http, grpc = endpoints.http_client(), endpoints.grpc_client()
    configs = {}
    for model in ("vibration", "faulty"):
        over_http = http.get_model_config(model, headers=headers())
        assert over_http == http.get_model_config(model, model_version="1", headers=headers())
        # Triton's own message accepts every key (unknown ones would raise)
        configs[model] = json_format.ParseDict(over_http, model_config_pb2.ModelConfig())
        assert grpc.get_model_config(model, headers=GRPC_HEADERS).config == configs[model]
    http.close(), grpc.close()
    vibration, faulty = configs["vibration"], configs["faulty"]
    assert vibration.max_batch_size == 8 and vibration.platform == "onnxruntime_onnx"
    assert [(i.name, list(i.dims)) for i in vibration.input] == [("signal", [256])]
    assert list(vibration.dynamic_batching.preferred_batch_size) == [2, 4, 8]
    assert vibration.dynamic_batching.max_queue_delay_microseconds == 2000
    assert vibration.dynamic_batching.priority_levels == 1
    # faulty's model.toml: priority_levels = 3, default_priority = 1 (the middle level)
    assert faulty.dynamic_batching.priority_levels == 3 and faulty.dynamic_batching.default_priority_level == 2
    assert not vibration.optimization.cuda.graphs  # the CPU provider: no graphs to replay


def test_a_grpc_token_with_a_leading_space_is_accepted_as_perf_analyzer_sends_it(endpoints) -> None:
    """docs/api.md's `perf_analyzer -i grpc -H "authorization: Bearer $TOKEN"` sends the value
    with the space after the colon: it was refused UNAUTHENTICATED (HTTP tolerated it)."""
    grpc = endpoints.grpc_client()
    spaced = {k: " " + v for k, v in GRPC_HEADERS.items()}
    assert grpc.infer("vibration", [_grpc_input(_windows(1, 0))], headers=spaced).as_numpy("class_id").shape == (1,)
    with pytest.raises(InferenceServerException, match="missing or invalid bearer token"):
        grpc.infer("vibration", [_grpc_input(_windows(1, 0))], headers={"authorization": " Bearer wrong"})
    grpc.close()


def test_metadata_names_tritons_platform_and_answers_name_their_version(endpoints) -> None:
    """Issue 32: metadata said "onnxruntime" where /config says "onnxruntime_onnx" (Triton: both),
    and HTTP infer responses carried no model_version."""
    http, grpc = endpoints.http_client(), endpoints.grpc_client()
    assert http.get_model_metadata("vibration", headers=headers())["platform"] == "onnxruntime_onnx"
    assert grpc.get_model_metadata("vibration", headers=GRPC_HEADERS).platform == "onnxruntime_onnx"
    for binary in (True, False):
        assert _http_infer(http, _windows(1, 0), binary=binary).get_response()["model_version"] == "1"
    assert _grpc_infer(grpc, _windows(1, 0)).get_response().model_version == "1"
    index = http.get_model_repository_index(headers=headers())
    assert {"name": "vibration", "version": "1", "state": "READY"} in index
    http.close(), grpc.close()


NO_VERSION_2 = "model 'vibration' has no version '2'; it serves version 1"


def test_versioned_paths_accept_version_1_only(endpoints) -> None:
    http, grpc = endpoints.http_client(), endpoints.grpc_client("unix")
    assert http.get_model_metadata("vibration", model_version="1", headers=headers())["versions"] == ["1"]
    assert http.is_model_ready("vibration", model_version="1", headers=headers())
    stats = http.get_inference_statistics("vibration", model_version="1", headers=headers())
    assert stats["model_stats"][0]["name"] == "vibration"
    assert grpc.is_model_ready("vibration", model_version="1")
    assert grpc.get_model_metadata("vibration", model_version="1").versions == ["1"]
    for call in (lambda: http.get_model_metadata("vibration", model_version="2", headers=headers()),
                 lambda: http.get_model_config("vibration", model_version="2", headers=headers()),
                 lambda: _http_infer(http, _windows(1, 1), model_version="2")):
        with pytest.raises(InferenceServerException, match=NO_VERSION_2) as e:
            call()
        assert e.value.status() == "404"
    for call in (lambda: grpc.get_model_config("vibration", model_version="2"),
                 lambda: grpc.infer("vibration", [_grpc_input(_windows(1, 1))], model_version="2")):
        with pytest.raises(InferenceServerException, match="has no version '2'") as e:
            call()
        assert e.value.status() == "StatusCode.NOT_FOUND"
    http.close(), grpc.close()


@pytest.mark.parametrize("transport", ["http-binary", "http-json", "grpc-tcp"])
def test_statistics_counts_are_tritons_after_n_requests(endpoints, transport) -> None:
    n = 12
    http = endpoints.http_client()
    before = http.get_inference_statistics("vibration", headers=headers())["model_stats"][0]
    if transport.startswith("http"):
        for i in range(n):
            _http_infer(http, _windows(1, i), binary=transport == "http-binary")
    else:
        grpc = endpoints.grpc_client()
        for i in range(n):
            _grpc_infer(grpc, _windows(1, i))
        grpc.close()
    after = http.get_inference_statistics("vibration", headers=headers())["model_stats"][0]
    http.close()
    s, s0 = after["inference_stats"], before["inference_stats"]
    for key in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert s[key]["count"] - s0[key]["count"] == n, key
    assert after["inference_count"] - before["inference_count"] == n
    executed = sum(b["compute_infer"]["count"] for b in after["batch_stats"])
    assert executed == after["execution_count"]
    for entry in after["batch_stats"]:  # perf_analyzer requires equal compute counts per entry
        assert entry["compute_input"]["count"] == entry["compute_infer"]["count"] == entry["compute_output"]["count"]
    assert "dispatch_reasons" in after and "padding_ratio" in after  # edge-batcher's own, beside Triton's


def test_grpc_statistics_equal_http_statistics(endpoints) -> None:
    http, grpc = endpoints.http_client(), endpoints.grpc_client()
    _grpc_infer(grpc, _windows(2, 3))
    over_grpc = grpc.get_inference_statistics("vibration", headers=GRPC_HEADERS, as_json=True)["model_stats"][0]
    over_http = http.get_inference_statistics("vibration", headers=headers())["model_stats"][0]
    http.close(), grpc.close()
    for key in ("success", "queue", "compute_input", "compute_infer"):
        assert int(over_grpc["inference_stats"][key]["count"]) == over_http["inference_stats"][key]["count"]
    assert int(over_grpc["execution_count"]) == over_http["execution_count"]


def _queue_depth(endpoints: Endpoints, model: str) -> int:
    request = urllib.request.Request(f"http://{endpoints.http}/v2/models/{model}/stats", headers=headers())
    with urllib.request.urlopen(request, timeout=5) as r:
        return json.load(r)["model_stats"][0]["queue_depth"]


def _slow(x: np.ndarray) -> np.ndarray:
    x[0, 0] = SLOW  # the whole batch it is in sleeps 0.5 s first (tests/support/faulty_engine.py)
    return x


def _completion_order(endpoints: Endpoints, submit, count_default: int) -> list[str]:
    """Hold the engine with two batches that wait for a release file (one in each of its two
    batch slots), queue `count_default` default-priority requests and then two priority-1
    requests behind them, wait until the daemon reports all of them queued, release; the order
    in which they are answered. Deterministic: however slowly the clients connect, nothing is
    dispatched before every request is waiting; and every queued window carries the SLOW
    sentinel, so each batch takes 0.5 s and a busy machine's late-waking client threads cannot
    record an answer of one batch after those of the next (a batch took ~0.1 ms: 11 < 8 failed
    under load)."""
    endpoints.release.unlink(missing_ok=True)
    order: list[str] = []
    lock = threading.Lock()
    done = threading.Event()
    total = count_default + 2

    def answered(tag):
        def callback(*_):
            with lock:
                order.append(tag)
                if len(order) == total:
                    done.set()
        return callback

    held = np.full((1, 256), HELD, np.float32)
    try:
        for _ in range(2):
            submit(held, None, lambda *_: None)
            time.sleep(0.05)  # dispatched alone (after max_queue_delay_ms)
        for i in range(count_default):
            submit(_slow(_windows(1, i)), None, answered("default"))
        for _ in range(2):
            submit(_slow(_windows(1, 99)), 1, answered("urgent"))
        deadline = time.monotonic() + 30
        while _queue_depth(endpoints, "faulty") < total:
            assert time.monotonic() < deadline, f"only {_queue_depth(endpoints, 'faulty')} of {total} queued"
            time.sleep(0.02)
    finally:
        endpoints.release.touch()
    assert done.wait(30), f"only {len(order)} of {total} answered"
    return order


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_priority_1_is_served_before_default_priority_requests_queued_earlier(endpoints, transport) -> None:
    if transport == "http":
        client = endpoints.http_client()

        def infer(x, priority, callback):  # a client per thread: gevent's hub is per thread
            with httpclient.InferenceServerClient(endpoints.http) as own:
                inp = httpclient.InferInput("signal", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                callback(own.infer("faulty", [inp], headers=headers(), priority=priority or 0))

        def submit(x, priority, callback):
            threading.Thread(target=infer, args=(x, priority, callback)).start()
            time.sleep(0.005)  # arrive in this order
    else:
        client = endpoints.grpc_client()

        def submit(x, priority, callback):
            client.async_infer("faulty", [_grpc_input(x)], callback=lambda result, error: callback(result, error),
                               headers=GRPC_HEADERS, priority=priority or 0)

    order = _completion_order(endpoints, submit, count_default=16)
    client.close()
    # The first batch after the slow one (8 rows) takes both urgent requests: the scheduler's
    # higher level first, though 16 default ones were waiting longer.
    assert max(i for i, tag in enumerate(order) if tag == "urgent") < 8, order
    assert order[-8:] == ["default"] * 8


def test_bad_input_gets_the_right_status_and_the_daemon_keeps_serving(endpoints) -> None:
    http, grpc = endpoints.http_client(), endpoints.grpc_client()
    wrong_shape = np.zeros((1, 255), np.float32)
    cases = [
        (lambda: _http_infer(http, wrong_shape), "400", "input 'signal': shape [1, 255]"),
        (lambda: _http_infer(http, _windows(1, 0), model="nope"), "404", "unknown model 'nope'"),
        (lambda: _http_infer(http, _windows(1, 0), priority=5), "400", "parameters.priority 5 is out of range"),
        (lambda: http.get_model_config("vibration"), "401", "missing or invalid bearer token"),
        (lambda: _grpc_infer(grpc, wrong_shape), "StatusCode.INVALID_ARGUMENT", "input 'signal': shape [1, 255]"),
        (lambda: _grpc_infer(grpc, _windows(1, 0), model="nope"), "StatusCode.NOT_FOUND", "unknown model 'nope'"),
        (lambda: _grpc_infer(grpc, _windows(1, 0), priority=5), "StatusCode.INVALID_ARGUMENT",
         "priority 5 is out of range"),
        (lambda: grpc.get_model_config("vibration"), "StatusCode.UNAUTHENTICATED", "missing or invalid bearer token"),
        (lambda: _grpc_infer(grpc, np.full((1, 256), -999.0, np.float32), model="faulty"), "StatusCode.INTERNAL",
         "injected fault"),
    ]
    for call, status, message in cases:
        with pytest.raises(InferenceServerException, match=re.escape(message)) as e:
            call()
        assert e.value.status() == status, message
    assert grpc.is_server_live()  # liveness needs no token, as HTTP's /v2/health/live
    assert grpc.is_server_ready(headers=GRPC_HEADERS) and http.is_server_ready(headers=headers())
    assert _grpc_infer(grpc, _windows(1, 0)).as_numpy("class_id").shape == (1,)
    http.close(), grpc.close()


def test_grpc_over_tls_with_the_token(tmp_path, model_repo) -> None:
    import shutil as sh
    import subprocess

    openssl = sh.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: cannot make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=30)
    address = f"127.0.0.1:{free_port()}"
    (tmp_path / "token").write_text(TOKEN)
    daemon = DaemonProcess(tmp_path / "d", f'[server]\ntoken_file = "{tmp_path / "token"}"\ngrpc = ["{address}"]\n'
                                          f'tls_cert = "{cert}"\ntls_key = "{key}"\n[models]\nload = ["vibration"]\n',
                           repo=model_repo)
    daemon.start().wait_ready()
    try:
        secure = grpcclient.InferenceServerClient(address, ssl=True, root_certificates=str(cert))
        x = _windows(2, seed=8)
        got = _grpc_infer(secure, x).as_numpy("class_id")
        np.testing.assert_array_equal(got, _expected(model_repo, x)["class_id"])
        with pytest.raises(InferenceServerException) as e:
            secure.get_model_config("vibration")  # TLS is not a token
        assert e.value.status() == "StatusCode.UNAUTHENTICATED"
        secure.close()
        plain = grpcclient.InferenceServerClient(address)
        with pytest.raises(InferenceServerException) as e:
            plain.is_server_live(client_timeout=5)
        assert e.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
        plain.close()
    finally:
        assert daemon.stop() == 0


def test_grpc_on_tcp_without_a_token_refuses_to_start(tmp_path, model_repo) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "edge_batcher.cli", "serve", "--models", str(model_repo), "--unix-socket",
         str(tmp_path / "s.sock"), "--grpc", f"127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "needs a bearer token" in proc.stderr and "127.0.0.1:" in proc.stderr


@pytest.mark.parametrize(("value", "message"), [
    ('["8001"]', "expected HOST:PORT"),
    ('["unix:"]', "expected unix:PATH"),
    ('"127.0.0.1:8001"', "grpc"),  # a list, even of one
])  # fmt: skip
def test_bad_grpc_addresses_are_named(tmp_path, value, message) -> None:
    from edge_batcher.config import load_config
    from edge_batcher.errors import ConfigError

    path = tmp_path / "c.toml"
    path.write_text(f"[server]\ngrpc = {value}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(str(path))


def test_the_python_client_sends_tritons_priority_scale(endpoints) -> None:
    from edge_batcher.client import ClientError

    with endpoints.daemon.client() as client:  # the Unix socket: no token
        assert client.infer("faulty", {"signal": _windows(1, 2)}, priority=1)["class_id"].shape == (1,)
        with pytest.raises(ClientError, match="priority levels 1..3") as e:
            client.infer("faulty", {"signal": _windows(1, 2)}, priority=4)
        assert e.value.status == 400
