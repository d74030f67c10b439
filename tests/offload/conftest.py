"""Fixtures for the offload tests: real peers served in-process.

A peer is the daemon's own HTTP app (``create_app``) with the bearer-token middleware, around a
real ``Runtime`` running the demo vibration model on ONNX Runtime, listening on a free loopback
TCP port (optionally with TLS), in the test's event loop. It can be stopped and started again on
the same port, made slow, made to fail with a status, or made not to advertise the binary tensor
extension. Nothing is mocked: the offload client talks real HTTP to the real server code.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from aiohttp import web

from edge_batcher.config import DaemonConfig
from edge_batcher.runtime import Runtime
from edge_batcher.transports.auth import bearer_auth_middleware, tls_context
from edge_batcher.transports.http import create_app
from tests.support.ports import free_port

TOKEN = "s3cret-peer-token"


def assert_matches_local(model_repo: Path, x: np.ndarray, got: dict[str, np.ndarray]) -> None:
    """`got` equals ONNX Runtime run locally on each row of `x` alone."""
    sess = ort.InferenceSession(str(model_repo / "vibration" / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    rows = [dict(zip(names, sess.run(None, {"signal": x[i:i + 1]}))) for i in range(len(x))]
    expected = {n: np.concatenate([r[n] for r in rows]) for n in names}
    assert set(got) == set(expected)
    np.testing.assert_array_equal(got["class_id"], expected["class_id"])
    assert got["class_id"].dtype == np.int64
    for name in ("class_probs", "anomaly_score"):
        assert got[name].dtype == np.float32
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)


class PeerServer:
    """The daemon's HTTP app on 127.0.0.1:<port>; restartable on the same port.

    Test knobs (read per request): ``delay_s`` sleeps before answering an infer,
    ``fail_status`` answers every infer with that status, ``advertise_binary = False`` hides
    the binary extension from ``GET /v2``. ``seen`` records (method, path, content type,
    has Inference-Header-Content-Length) of every request that passed authentication.
    """

    def __init__(self, runtime: Runtime, *, token: str = TOKEN, ssl_context=None, port: int | None = None):
        self.runtime = runtime
        self.token = token
        self.ssl_context = ssl_context
        self.port = port or free_port()
        self.delay_s = 0.0
        self.fail_status: int | None = None
        self.advertise_binary = True
        self.seen: list[tuple[str, str, str, bool]] = []
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{self.port}"

    def make_app(self) -> web.Application:
        @web.middleware
        async def knobs(request: web.Request, handler):
            self.seen.append((request.method, request.path, request.content_type,
                              "Inference-Header-Content-Length" in request.headers))
            if request.path.endswith("/infer"):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if self.fail_status:
                    return web.json_response({"error": "injected failure"}, status=self.fail_status)
            if request.path == "/v2" and not self.advertise_binary:
                return web.json_response({"name": "plain-v2", "version": "0", "extensions": []})
            return await handler(request)

        return create_app(self.runtime, max_body_bytes=4 * 1024 * 1024,
                          middlewares=(bearer_auth_middleware(self.token), knobs))

    async def start(self) -> PeerServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(64)
        sock.setblocking(False)
        self._runner = web.AppRunner(self.make_app(), access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, ssl_context=self.ssl_context).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@pytest.fixture(scope="session")
def peer_repo(model_repo, tmp_path_factory) -> Path:
    """The demo vibration model as a bigger peer server would batch it: one batch size, 512.

    One size on purpose: with several preferred sizes the scheduler can currently plan a
    cover smaller than a waiting multi-row request (e.g. size 2 for a 4-row request once a
    fast batch of 4 was measured), which takes no request and spins until the deadline. With
    a single size every request up to 512 rows runs at once, so these tests exercise the
    offload path, not that scheduler corner.
    """
    repo = tmp_path_factory.mktemp("peer-engines")
    (repo / "vibration").mkdir()
    shutil.copy(model_repo / "vibration" / "model.onnx", repo / "vibration" / "model.onnx")
    text = (model_repo / "vibration" / "model.toml").read_text()
    text = text.replace("preferred_batch_sizes = [2, 4, 8]", "preferred_batch_sizes = [512]")
    assert "[512]" in text
    (repo / "vibration" / "model.toml").write_text(text)
    return repo


@pytest.fixture
async def runtime(peer_repo):
    """A started Runtime serving the vibration model (loaded in a worker thread)."""
    config = DaemonConfig()
    config.models.repository = str(peer_repo)
    config.models.load = ["vibration"]
    config.models.warmup = False
    config.memory.probe = "fixed"
    config.memory.budget_mb = 4096
    rt = Runtime(config)
    await rt.start()
    yield rt
    await rt.close()


@pytest.fixture
async def serve_peer(runtime):
    """serve_peer(**PeerServer kwargs) -> a started PeerServer (stopped at teardown)."""
    servers: list[PeerServer] = []

    async def start(**kwargs) -> PeerServer:
        server = PeerServer(runtime, **kwargs)
        servers.append(server)
        return await server.start()

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (EC P-256, one day) and its key, via openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: cannot make a self-signed certificate for the TLS tests")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=30,
    )
    return cert, key


@pytest.fixture
def server_tls(tls_files):
    cert, key = tls_files
    return tls_context(str(cert), str(key))
