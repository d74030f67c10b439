"""Python clients for the edge-batcher HTTP API (KServe v2 / Open Inference Protocol).

``Client`` (here) is synchronous and uses only the standard library (``http.client``), so
scripts on a device need nothing but numpy. ``AsyncClient`` (client_async.py, importable from
here) uses aiohttp (imported only when it is first used) with one pooled session; what both
send and how they read the answers is client_requests.py. Both talk to the daemon over its
Unix socket (the default) or over TCP::

    with Client() as c:                                  # unix:///run/edge-batcher/...
        out = c.infer("resnet", {"input": batch})["output"]

    async with AsyncClient("http://jetson.local:8000", token="...") as c:
        out = await c.infer("resnet", {"input": batch})

Requests use Triton's binary tensor extension by default (``binary=True``): tensors travel as
raw bytes after a JSON header, which is far cheaper than JSON numbers for real payloads.
``binary=False`` sends and asks for plain JSON, handy for debugging.

Errors: ``ClientError`` for any non-2xx answer (``status``, ``message``); its subclass
``DaemonUnreachable`` (status 0) when no connection can be opened, naming the address and what
to do. ``priority`` is on Triton's scale: 1 is the highest, None the model's default level.
docs/client.md is the reference.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
from typing import Any

import numpy as np

from . import client_requests as req
from . import client_shared_memory as shm
from .client_async import AsyncClient as AsyncClient  # re-exported: part of the client API
from .client_requests import DEFAULT_URL as DEFAULT_URL
from .client_requests import ClientError as ClientError
from .client_requests import DaemonUnreachable as DaemonUnreachable
from .client_requests import default_url as default_url
from .client_shared_memory import RegionInput as RegionInput
from .client_shared_memory import RegionOutput as RegionOutput
from .client_shared_memory import SharedMemoryRegion as SharedMemoryRegion
from .protocol.endpoint import Endpoint as Endpoint
from .protocol.endpoint import parse_url as parse_url
from .protocol.v2 import HEADER_LENGTH, JSON_CONTENT_TYPE, DecodedResponse


class _UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix domain socket (the daemon's default, no TCP port needed)."""

    def __init__(self, socket_path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class Client:
    """Synchronous client; keeps one keep-alive connection. Not safe to share across threads
    (use one client per thread)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        timeout: float = 30.0,
        token: str | None = None,
        binary: bool = True,
    ):
        self.url = url or req.default_url()
        self.endpoint = parse_url(self.url)
        self.timeout = timeout
        self.binary = binary
        self._headers: dict[str, str] = {}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None

    # -- API

    def infer(
        self,
        model: str,
        inputs: dict[str, np.ndarray],
        *,
        outputs: list[str] | None = None,
        id: str | None = None,
        priority: int | None = None,
        timeout_ms: float | None = None,
    ) -> dict[str, np.ndarray]:
        """Run one inference request; returns the outputs by name."""
        return self.infer_response(
            model, inputs, outputs=outputs, id=id, priority=priority, timeout_ms=timeout_ms
        ).outputs

    def infer_response(
        self,
        model: str,
        inputs: dict[str, np.ndarray],
        *,
        outputs: list[str] | None = None,
        id: str | None = None,
        priority: int | None = None,
        timeout_ms: float | None = None,
    ) -> DecodedResponse:
        """Like infer, but returns the whole response (model version, id, parameters)."""
        body, headers = req.infer_body(
            inputs, outputs=outputs, id=id, priority=priority, timeout_ms=timeout_ms,
            binary=self.binary,
        )
        status, resp_headers, data = self._request(
            "POST", req.model_path(model, "/infer"), body, headers
        )
        return req.infer_result(status, resp_headers.get(HEADER_LENGTH), data)

    def infer_with_regions(
        self,
        model: str,
        inputs: dict[str, np.ndarray | RegionInput],
        *,
        output_regions: dict[str, RegionOutput] | None = None,
        outputs: list[str] | None = None,
        id: str | None = None,
        priority: int | None = None,
        timeout_ms: float | None = None,
    ) -> DecodedResponse:
        """Like infer_response, with inputs in registered shared memory regions (RegionInput) and
        outputs written into them (`output_regions`; read back as views of the regions)."""
        regions = output_regions or {}
        body, headers = req.region_infer_body(inputs, regions, outputs=outputs, id=id, priority=priority,
                                              timeout_ms=timeout_ms, binary=self.binary)
        status, resp_headers, data = self._request("POST", req.model_path(model, "/infer"), body, headers)
        return req.infer_result(status, resp_headers.get(HEADER_LENGTH), data, shm.output_reader(regions))

    def register_region(self, region: SharedMemoryRegion, offset: int = 0, byte_size: int | None = None) -> None:
        """Register a region with the daemon (Triton's system shared memory extension)."""
        req.json_answer(*self._request_json("POST", req.region_path(region.name, "register"),
                                            req.register_body(region, offset, byte_size)))

    def unregister_region(self, name: str | None = None) -> None:
        """Unregister one region, or every one (None)."""
        req.json_answer(*self._request_json("POST", req.region_path(name, "unregister"), b"{}"))

    def region_status(self, name: str | None = None) -> list[dict]:
        """[{"name", "key", "offset", "byte_size"}] of one region, or of every one (None)."""
        return req.json_answer(*self._request_json("GET", req.region_path(name, "status")))

    def models(self) -> list[dict]:
        """The model repository index: [{"name", "version"?, "state", ...}, ...]."""
        return req.json_answer(*self._request_json("POST", "/v2/repository/index", b"{}"))

    def model_metadata(self, model: str) -> dict:
        return req.json_answer(*self._request_json("GET", req.model_path(model)))

    def stats(self, model: str) -> dict:
        return req.json_answer(*self._request_json("GET", req.model_path(model, "/stats")))

    def all_stats(self) -> dict:
        """Every model's statistics (GET /v2/models/stats)."""
        return req.json_answer(*self._request_json("GET", "/v2/models/stats"))

    def repository_index(self) -> list[dict]:
        """The loaded models with their state (Triton's POST /v2/repository/index)."""
        return req.json_answer(*self._request_json("POST", "/v2/repository/index", b"{}"))

    def index_add(self, model: str, documents: list[tuple[str, str]], rebuild: bool = False) -> dict:
        """Add (source, text) documents to a rag model's index; the daemon embeds and writes it
        (give the Client a timeout that fits: about 20 passages a second on a small CPU)."""
        body = json.dumps({"documents": [{"source": s, "text": t} for s, t in documents], "rebuild": rebuild})
        return req.json_answer(*self._request_json("POST", req.model_path(model, "/index"), body.encode()))

    def index_remove(self, model: str, sources: list[str]) -> dict:
        body = json.dumps({"sources": sources}).encode()
        return req.json_answer(*self._request_json("POST", req.model_path(model, "/index/remove"), body))

    def index_info(self, model: str) -> dict:
        return req.json_answer(*self._request_json("GET", req.model_path(model, "/index")))

    def load_model(self, model: str) -> None:
        """Load (or load again) a model of the daemon's repository (Triton's repository extension)."""
        req.json_answer(*self._request_json("POST", req.repository_path(model, "load"), b"{}"))

    def unload_model(self, model: str) -> None:
        req.json_answer(*self._request_json("POST", req.repository_path(model, "unload"), b"{}"))

    def metrics(self) -> str:
        """The daemon's Prometheus metrics, as text (GET /metrics; docs/observability.md)."""
        status, _, data = self._request("GET", "/metrics")
        req.check(status, data)  # ClientError naming the daemon's error
        return data.decode()

    def live(self) -> bool:
        return self._health("/v2/health/live")

    def ready(self) -> bool:
        return self._health("/v2/health/ready")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport

    def _health(self, path: str) -> bool:
        try:
            status, _, _ = self._request("GET", path)
        except (DaemonUnreachable, OSError, http.client.HTTPException):
            return False  # not reachable counts as not live / not ready
        return status == 200

    def _request_json(
        self, method: str, path: str, body: bytes | None = None
    ) -> tuple[int, bytes]:
        headers = {"Content-Type": JSON_CONTENT_TYPE} if body is not None else {}
        status, _, data = self._request(method, path, body, headers)
        return status, data

    def _connect(self) -> http.client.HTTPConnection:
        ep = self.endpoint
        if ep.scheme == "unix":
            assert ep.socket_path is not None
            return _UnixHTTPConnection(ep.socket_path, self.timeout)
        if ep.scheme == "https":
            return http.client.HTTPSConnection(
                ep.host, ep.port, timeout=self.timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(ep.host, ep.port, timeout=self.timeout)

    def _open(self) -> http.client.HTTPConnection:
        """A connected connection, or DaemonUnreachable."""
        conn = self._connect()
        try:
            conn.connect()
        except OSError as exc:  # FileNotFoundError, ConnectionRefusedError, gaierror, timeout...
            conn.close()
            raise DaemonUnreachable(self.url, exc) from exc
        return conn

    def _request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, bytes]:
        """Send one request on the kept-alive connection; returns (status, headers, body).

        If a *reused* connection fails (the daemon closed it while idle, or restarted), the
        request is retried once on a fresh connection. A fresh connection that cannot be
        opened raises DaemonUnreachable (naming the address and the fix); errors after that
        (a timeout waiting for the answer, a protocol error) propagate as they are.
        """
        all_headers = {**self._headers, **(headers or {})}
        full_path = self.endpoint.base_path + path
        for attempt in (1, 2):
            reused = self._conn is not None
            if self._conn is None:
                self._conn = self._open()
            conn = self._conn
            try:
                conn.request(method, full_path, body=body, headers=all_headers)
                response = conn.getresponse()
                data = response.read()
            except ConnectionError:  # reset, broken pipe, RemoteDisconnected
                self.close()
                if reused and attempt == 1:
                    continue
                raise
            except BaseException:  # timeout, protocol error: the connection state is unknown
                self.close()
                raise
            return response.status, response.headers, data  # headers: case-insensitive .get
        raise AssertionError("unreachable")
