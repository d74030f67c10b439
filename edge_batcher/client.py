"""Python clients for the edge-batcher HTTP API (KServe v2 / Open Inference Protocol).

``Client`` is synchronous and uses only the standard library (``http.client``), so scripts on
a device need nothing but numpy. ``AsyncClient`` uses aiohttp (imported only when it is first
used) with one pooled session. Both talk to the daemon over its Unix socket (the default) or
over TCP::

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
import os
import socket
import ssl
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import numpy as np

from . import client_shared_memory as shm
from .client_shared_memory import RegionInput as RegionInput  # re-exported: part of the client API
from .client_shared_memory import RegionOutput as RegionOutput
from .client_shared_memory import SharedMemoryRegion as SharedMemoryRegion
from .errors import InvalidInput
from .protocol.endpoint import Endpoint as Endpoint  # re-exported: part of the client API
from .protocol.endpoint import parse_url
from .protocol.error_body import error_message
from .protocol.tensor_decode import RegionReader
from .protocol.v2 import (
    BINARY_CONTENT_TYPE,
    HEADER_LENGTH,
    JSON_CONTENT_TYPE,
    DecodedResponse,
    decode_response,
    encode_request,
    parse_header_length,
)

if TYPE_CHECKING:
    import aiohttp

DEFAULT_URL = "unix:///run/edge-batcher/edge-batcher.sock"  # the systemd service's socket


def default_url(service_url: str = DEFAULT_URL) -> str:
    """The local daemon: the systemd service's socket when it exists, else the socket a daemon
    started by hand listens on (config.resolve_socket_path("auto"), the daemon's own rule)."""
    from .config import resolve_socket_path

    if os.path.exists(parse_url(service_url).socket_path or ""):
        return service_url
    return f"unix://{resolve_socket_path('auto')}"


class ClientError(Exception):
    """The daemon answered with a non-2xx status (or with a body the client cannot decode),
    or could not be reached at all (``DaemonUnreachable``, status 0).

    ``message`` is the daemon's ``{"error": "..."}`` text when there is one.
    """

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message


class DaemonUnreachable(ClientError):
    """No connection to the daemon: no socket, nothing listening, no permission, unknown host.

    Status 0 (no HTTP answer); the message names the address and what to do about it.
    ``address`` is the URL the client was given, ``reason`` the OS error behind it.
    """

    def __init__(self, address: str, reason: BaseException):
        self.address = address
        self.reason = reason
        super().__init__(0, unreachable_message(address, reason))


_START_HINT = (
    "start it (`edge-batcher serve`, or `sudo systemctl start edge-batcher` for the service) "
    "or give its address (--url / Client(url=...)); `edge-batcher config` prints the socket "
    "path a daemon started with the same configuration uses"
)


def unreachable_message(address: str, reason: BaseException) -> str:
    """One sentence for a failed connection: what was tried, what went wrong, what to do."""
    if isinstance(reason, FileNotFoundError):
        return f"no daemon at {address}: the socket does not exist; {_START_HINT}"
    if isinstance(reason, ConnectionRefusedError):
        if address.startswith("unix:"):
            return (f"no daemon at {address}: the socket exists but nothing accepts on it "
                    f"(left behind by a daemon that stopped?); {_START_HINT}")
        return (f"no daemon at {address}: connection refused; start it with "
                f"`edge-batcher serve --http HOST:PORT --token-file FILE`, or check the address")
    if isinstance(reason, PermissionError):
        return (f"cannot connect to {address}: permission denied; the service's socket is for "
                f"the edge-batcher group: `sudo usermod -aG edge-batcher $USER`, then log in again")
    if isinstance(reason, socket.gaierror):
        return f"cannot connect to {address}: unknown host ({reason.strerror or reason}); check the address"
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"cannot connect to {address}: timed out; is the daemon up and the address right?"
    detail = getattr(reason, "strerror", None) or str(reason) or type(reason).__name__
    return f"cannot connect to {address}: {detail}"


# --------------------------------------------------------------------------- shared helpers


def _repository_path(model: str, action: str) -> str:
    """Triton's repository extension: /v2/repository/models/{model}/load or unload."""
    return f"/v2/repository/models/{quote(model, safe='')}/{action}"


def _region_path(name: str | None, action: str) -> str:
    """Triton's system shared memory extension: /v2/systemsharedmemory[/region/{name}]/{action}."""
    return "/v2/systemsharedmemory" + (f"/region/{quote(name, safe='')}" if name else "") + f"/{action}"


def _model_path(model: str, suffix: str = "") -> str:
    return f"/v2/models/{quote(model, safe='')}{suffix}"


def _infer_body(
    inputs: dict[str, np.ndarray],
    *,
    outputs: list[str] | None,
    id: str | None,
    priority: int | None,
    timeout_ms: float | None,
    binary: bool,
) -> tuple[bytes, dict[str, str]]:
    """Encode an infer request; return the body and the content headers it needs."""
    parameters: dict[str, Any] = {}
    if priority is not None:
        parameters["priority"] = priority
    if timeout_ms is not None:
        parameters["timeout_ms"] = timeout_ms
    body, header_length = encode_request(inputs, id=id, parameters=parameters or None, outputs=outputs,
                                         binary_inputs=binary, binary_outputs=binary)
    if header_length is None:
        return body, {"Content-Type": JSON_CONTENT_TYPE}
    # JSON mode can still produce a binary body (BYTES that are not utf-8).
    return body, {"Content-Type": BINARY_CONTENT_TYPE, HEADER_LENGTH: str(header_length)}


def _region_infer_body(
    inputs: dict[str, np.ndarray | RegionInput],
    output_regions: dict[str, RegionOutput],
    *,
    outputs: list[str] | None,
    id: str | None,
    priority: int | None,
    timeout_ms: float | None,
    binary: bool,
) -> tuple[bytes, dict[str, str]]:
    """Encode an infer request whose inputs and outputs may name shared memory regions."""
    parameters = {k: v for k, v in (("priority", priority), ("timeout_ms", timeout_ms)) if v is not None}
    body, header_length = shm.encode_request(inputs, output_regions, outputs=outputs, id=id, parameters=parameters,
                                             binary=binary)
    if header_length is None:
        return body, {"Content-Type": JSON_CONTENT_TYPE}
    return body, {"Content-Type": BINARY_CONTENT_TYPE, HEADER_LENGTH: str(header_length)}


def _register_body(region: SharedMemoryRegion, offset: int, byte_size: int | None) -> bytes:
    size = region.byte_size - offset if byte_size is None else byte_size
    return json.dumps({"key": region.key, "offset": offset, "byte_size": size}).encode()


def _check(status: int, body: bytes) -> None:
    if not 200 <= status < 300:
        raise ClientError(status, error_message(body))


def _json(status: int, body: bytes) -> Any:
    _check(status, body)
    try:
        return json.loads(body) if body else None
    except ValueError as e:
        raise ClientError(status, f"response is not valid JSON: {e}") from None


def _infer_result(status: int, header_length: str | None, body: bytes,
                  regions: RegionReader | None = None) -> DecodedResponse:
    _check(status, body)
    try:
        return decode_response(body, parse_header_length(header_length), regions)
    except InvalidInput as e:
        raise ClientError(status, f"invalid inference response: {e.message}") from None


# --------------------------------------------------------------------------- sync client


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
        self.url = url or default_url()
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
        body, headers = _infer_body(
            inputs, outputs=outputs, id=id, priority=priority, timeout_ms=timeout_ms,
            binary=self.binary,
        )
        status, resp_headers, data = self._request(
            "POST", _model_path(model, "/infer"), body, headers
        )
        return _infer_result(status, resp_headers.get(HEADER_LENGTH), data)

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
        body, headers = _region_infer_body(inputs, regions, outputs=outputs, id=id, priority=priority,
                                           timeout_ms=timeout_ms, binary=self.binary)
        status, resp_headers, data = self._request("POST", _model_path(model, "/infer"), body, headers)
        return _infer_result(status, resp_headers.get(HEADER_LENGTH), data, shm.output_reader(regions))

    def register_region(self, region: SharedMemoryRegion, offset: int = 0, byte_size: int | None = None) -> None:
        """Register a region with the daemon (Triton's system shared memory extension)."""
        _json(*self._request_json("POST", _region_path(region.name, "register"),
                                  _register_body(region, offset, byte_size)))

    def unregister_region(self, name: str | None = None) -> None:
        """Unregister one region, or every one (None)."""
        _json(*self._request_json("POST", _region_path(name, "unregister"), b"{}"))

    def region_status(self, name: str | None = None) -> list[dict]:
        """[{"name", "key", "offset", "byte_size"}] of one region, or of every one (None)."""
        return _json(*self._request_json("GET", _region_path(name, "status")))

    def models(self) -> list[dict]:
        """The model repository index: [{"name", "version"?, "state", ...}, ...]."""
        return _json(*self._request_json("POST", "/v2/repository/index", b"{}"))

    def model_metadata(self, model: str) -> dict:
        return _json(*self._request_json("GET", _model_path(model)))

    def stats(self, model: str) -> dict:
        return _json(*self._request_json("GET", _model_path(model, "/stats")))

    def all_stats(self) -> dict:
        """Every model's statistics (GET /v2/models/stats)."""
        return _json(*self._request_json("GET", "/v2/models/stats"))

    def repository_index(self) -> list[dict]:
        """The loaded models with their state (Triton's POST /v2/repository/index)."""
        return _json(*self._request_json("POST", "/v2/repository/index", b"{}"))

    def index_add(self, model: str, documents: list[tuple[str, str]], rebuild: bool = False) -> dict:
        """Add (source, text) documents to a rag model's index; the daemon embeds and writes it
        (give the Client a timeout that fits: about 20 passages a second on a small CPU)."""
        body = json.dumps({"documents": [{"source": s, "text": t} for s, t in documents], "rebuild": rebuild})
        return _json(*self._request_json("POST", _model_path(model, "/index"), body.encode()))

    def index_remove(self, model: str, sources: list[str]) -> dict:
        body = json.dumps({"sources": sources}).encode()
        return _json(*self._request_json("POST", _model_path(model, "/index/remove"), body))

    def index_info(self, model: str) -> dict:
        return _json(*self._request_json("GET", _model_path(model, "/index")))

    def load_model(self, model: str) -> None:
        """Load (or load again) a model of the daemon's repository (Triton's repository extension)."""
        _json(*self._request_json("POST", _repository_path(model, "load"), b"{}"))

    def unload_model(self, model: str) -> None:
        _json(*self._request_json("POST", _repository_path(model, "unload"), b"{}"))

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


# --------------------------------------------------------------------------- async client


class AsyncClient:
    """asyncio client on one pooled aiohttp session; use ``async with`` or ``await close()``.

    The session is created on first use, inside the running event loop.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        timeout: float = 30.0,
        token: str | None = None,
        binary: bool = True,
    ):
        self.url = url or default_url()
        self.endpoint = parse_url(self.url)
        self.timeout = timeout
        self.binary = binary
        self._headers: dict[str, str] = {}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._session: aiohttp.ClientSession | None = None

    # -- API

    async def infer(
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
        response = await self.infer_response(
            model, inputs, outputs=outputs, id=id, priority=priority, timeout_ms=timeout_ms
        )
        return response.outputs

    async def infer_response(
        self,
        model: str,
        inputs: dict[str, np.ndarray],
        *,
        outputs: list[str] | None = None,
        id: str | None = None,
        priority: int | None = None,
        timeout_ms: float | None = None,
    ) -> DecodedResponse:
        body, headers = _infer_body(
            inputs, outputs=outputs, id=id, priority=priority, timeout_ms=timeout_ms,
            binary=self.binary,
        )
        status, resp_headers, data = await self._request(
            "POST", _model_path(model, "/infer"), body, headers
        )
        return _infer_result(status, resp_headers.get(HEADER_LENGTH), data)

    async def infer_with_regions(
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
        """Client.infer_with_regions, awaited."""
        regions = output_regions or {}
        body, headers = _region_infer_body(inputs, regions, outputs=outputs, id=id, priority=priority,
                                           timeout_ms=timeout_ms, binary=self.binary)
        status, resp_headers, data = await self._request("POST", _model_path(model, "/infer"), body, headers)
        return _infer_result(status, resp_headers.get(HEADER_LENGTH), data, shm.output_reader(regions))

    async def register_region(self, region: SharedMemoryRegion, offset: int = 0,
                              byte_size: int | None = None) -> None:
        """Client.register_region, awaited."""
        status, _, data = await self._request("POST", _region_path(region.name, "register"),
                                              _register_body(region, offset, byte_size),
                                              {"Content-Type": JSON_CONTENT_TYPE})
        _json(status, data)

    async def unregister_region(self, name: str | None = None) -> None:
        """Client.unregister_region, awaited."""
        status, _, data = await self._request("POST", _region_path(name, "unregister"), b"{}",
                                              {"Content-Type": JSON_CONTENT_TYPE})
        _json(status, data)

    async def region_status(self, name: str | None = None) -> list[dict]:
        """Client.region_status, awaited."""
        status, _, data = await self._request("GET", _region_path(name, "status"))
        return _json(status, data)

    async def models(self) -> list[dict]:
        status, _, data = await self._request(
            "POST", "/v2/repository/index", b"{}", {"Content-Type": JSON_CONTENT_TYPE}
        )
        return _json(status, data)

    async def model_metadata(self, model: str) -> dict:
        status, _, data = await self._request("GET", _model_path(model))
        return _json(status, data)

    async def stats(self, model: str) -> dict:
        status, _, data = await self._request("GET", _model_path(model, "/stats"))
        return _json(status, data)

    async def all_stats(self) -> dict:
        status, _, data = await self._request("GET", "/v2/models/stats")
        return _json(status, data)

    async def repository_index(self) -> list[dict]:
        headers = {"Content-Type": JSON_CONTENT_TYPE}
        status, _, data = await self._request("POST", "/v2/repository/index", b"{}", headers)
        return _json(status, data)

    async def load_model(self, model: str) -> None:
        await self._repository("load", model)

    async def unload_model(self, model: str) -> None:
        await self._repository("unload", model)

    async def _repository(self, action: str, model: str) -> None:
        status, _, data = await self._request("POST", _repository_path(model, action), b"{}",
                                              {"Content-Type": JSON_CONTENT_TYPE})
        _json(status, data)

    async def live(self) -> bool:
        return await self._health("/v2/health/live")

    async def ready(self) -> bool:
        return await self._health("/v2/health/ready")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- transport

    async def _health(self, path: str) -> bool:
        import asyncio

        import aiohttp

        try:
            status, _, _ = await self._request("GET", path)
        except (DaemonUnreachable, aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False
        return status == 200

    def _get_session(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            if self.endpoint.scheme == "unix":
                assert self.endpoint.socket_path is not None
                connector: aiohttp.BaseConnector = aiohttp.UnixConnector(
                    path=self.endpoint.socket_path
                )
            else:
                connector = aiohttp.TCPConnector()
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                headers=self._headers,
            )
        return self._session

    async def _request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, bytes]:
        """Send one request; a pooled connection the daemon dropped is retried once. A
        connection that cannot be opened raises DaemonUnreachable."""
        import aiohttp

        url = self.endpoint.base_url + path
        for attempt in (1, 2):
            session = self._get_session()
            try:
                async with session.request(method, url, data=body, headers=headers) as resp:
                    return resp.status, resp.headers, await resp.read()
            except aiohttp.ServerDisconnectedError:
                if attempt == 2:
                    raise
            except aiohttp.ClientConnectorError as exc:
                raise DaemonUnreachable(self.url, exc.os_error) from exc
        raise AssertionError("unreachable")
