"""A lean KServe v2 HTTP client for one offload peer.

Speaks only the standard Open Inference Protocol over HTTP(S), so the peer can be another
edge-batcher, NVIDIA Triton, MLServer or OpenVINO Model Server:

* ``GET /v2`` (server metadata): when ``extensions`` lists ``binary_tensor_data`` (Triton and
  edge-batcher do) and the peer's settings allow it, tensors travel with the binary tensor
  extension; otherwise as JSON (MLServer, OVMS). Learned on first use, forgotten when the
  peer becomes unreachable (it may come back as another server).
* ``POST /v2/models/{name}/infer`` with the model name mapped through ``model_map``, the
  request's remaining deadline as the HTTP timeout (capped by ``request_timeout_s``) and as
  the request parameter ``timeout`` in microseconds (Triton's name; edge-batcher honours it,
  other servers ignore it).
* ``GET /v2/health/ready`` and ``GET /v2/models/{name}/ready`` for health checks.

One pooled keep-alive ``aiohttp.ClientSession`` per peer, created lazily inside the running
event loop; the bearer token (``token`` or ``token_file``) goes on every request; TLS verifies
the peer against ``ca_file`` (or the system CAs), or not at all with ``tls_insecure``.

Errors, and what they mean for the peer's circuit breaker:

* the peer answered 404 -> :class:`~edge_batcher.errors.ModelNotFound`; another 4xx meaning
  bad input (400, 422, ...) -> :class:`~edge_batcher.errors.InvalidInput`. The message is the
  peer's, prefixed with the peer's name; ``exc.peer`` is set. Not a breaker failure: the peer
  is healthy, the input was bad.
* 5xx, 401/403 (our token is wrong), 408/429 (peer timeout/overloaded), connection errors,
  timeouts and undecodable answers -> :class:`PeerError` (HTTP 502 at our edge) with
  ``breaker_failure = True``. A 413 (the batch is over the peer's body limit) is a PeerError
  with ``breaker_failure = False``: the peer is fine, only this batch cannot go there.
* a deadline that passed before the request could be sent -> DeadlineExceeded (504); the peer
  is not contacted and its breaker is not touched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import numpy as np

from .. import __version__
from ..config import PeerSettings, read_secret
from ..errors import ConfigError, DeadlineExceeded, EdgeBatcherError, InvalidInput, ModelNotFound
from ..protocol import v2
from ..protocol.endpoint import parse_url
from ..protocol.error_body import error_message

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger(__name__)

# Encoding/decoding a body this large would hold the event loop for milliseconds: use a thread.
CODEC_OFF_LOOP_BYTES = 256 * 1024
# Weight of the newest sample in the round-trip latency average.
LATENCY_EWMA_ALPHA = 0.3
BINARY_EXTENSION = "binary_tensor_data"


class PeerError(EdgeBatcherError):
    """An offload peer could not serve a request (down, failing, too slow, misconfigured).

    ``peer`` names the peer (None for a pool-wide error). ``breaker_failure`` says whether it
    counts against the peer's circuit breaker.
    """

    status = 502

    def __init__(self, message: str, *, peer: str | None = None, breaker_failure: bool = True):
        super().__init__(message)
        self.peer = peer
        self.breaker_failure = breaker_failure


def client_ssl_context(settings: PeerSettings, where: str) -> ssl.SSLContext:
    """The TLS context for an https:// peer: verify against ca_file (default: system CAs);
    tls_insecure turns verification off (testing only)."""
    try:
        context = ssl.create_default_context(cafile=settings.ca_file or None)
    except FileNotFoundError:
        raise ConfigError(f"{where} ca_file: {settings.ca_file} not found") from None
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{where} ca_file: cannot load {settings.ca_file}: {exc}") from None
    if settings.tls_insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class PeerClient:
    """KServe v2 HTTP client for one peer; see the module docstring.

    Use ``async with`` or ``await close()``. All methods must run on one event loop.
    """

    def __init__(self, settings: PeerSettings, *, request_timeout_s: float = 30.0):
        self.settings = settings
        self.name = settings.name or settings.url
        self.url = settings.url
        where = f"[[offload.peers]] {self.name}:"
        try:
            self.endpoint = parse_url(settings.url)
        except ValueError as exc:
            raise ConfigError(f"{where} url: {exc}") from None
        if self.endpoint.scheme not in ("http", "https"):
            raise ConfigError(f"{where} url: expected http:// or https://, got {settings.url!r}")
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        self.request_timeout_s = request_timeout_s
        token = read_secret(settings.token, settings.token_file, f"{where} token")
        self._headers = {"User-Agent": f"edge-batcher/{__version__} (offload)"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._ssl = client_ssl_context(settings, where) if self.endpoint.scheme == "https" else None
        self._session: aiohttp.ClientSession | None = None
        self._binary: bool | None = None  # what GET /v2 said; None: not asked yet
        self._latency: dict[str, float] = {}
        self.last_error: str | None = None

    # -- API

    def remote_name(self, model: str) -> str:
        """The peer's name for a local model (``model_map``, else the same name)."""
        return self.settings.model_map.get(model, model)

    async def infer(
        self, model: str, inputs: dict[str, np.ndarray], *, timeout_s: float | None = None
    ) -> dict[str, np.ndarray]:
        """Run one (batched) request on the peer; returns every output by name.

        ``timeout_s`` is what is left of the request's deadline; the call gives up after
        min(timeout_s, request_timeout_s) with a PeerError. A deadline that has already passed
        raises DeadlineExceeded without contacting the peer.
        """
        loop = asyncio.get_running_loop()
        budget = self.request_timeout_s if timeout_s is None else min(timeout_s, self.request_timeout_s)
        if budget <= 0:
            raise DeadlineExceeded(f"the request's deadline passed before it could be sent to peer {self.name}")
        deadline = loop.time() + budget
        binary = self.settings.binary and await self.supports_binary(deadline=deadline)
        parameters = {"timeout": max(1, int(budget * 1e6))}  # Triton's name, in microseconds
        if sum(a.nbytes for a in inputs.values()) > CODEC_OFF_LOOP_BYTES:
            body, header_length = await loop.run_in_executor(
                None, _encode, inputs, parameters, binary
            )
        else:
            body, header_length = _encode(inputs, parameters, binary)
        headers = {"Content-Type": v2.JSON_CONTENT_TYPE}
        if header_length is not None:
            headers = {"Content-Type": v2.BINARY_CONTENT_TYPE, v2.HEADER_LENGTH: str(header_length)}
        started = loop.time()
        status, resp_headers, data = await self._request(
            "POST", _model_path(self.remote_name(model), "/infer"), deadline, body=body, headers=headers
        )
        if status != 200:
            raise self._status_error(status, data, f"model {self.remote_name(model)!r}")
        try:
            length = v2.parse_header_length(resp_headers.get(v2.HEADER_LENGTH))
            if len(data) > CODEC_OFF_LOOP_BYTES:
                decoded = await loop.run_in_executor(None, v2.decode_response, data, length)
            else:
                decoded = v2.decode_response(data, length)
        except InvalidInput as exc:
            raise self._fail(f"peer {self.name}: invalid inference response: {exc.message}") from None
        self._observe(model, loop.time() - started)
        self.last_error = None
        return decoded.outputs

    async def supports_binary(self, *, deadline: float | None = None) -> bool:
        """Whether the peer advertises the binary tensor extension (``GET /v2``), cached."""
        if self._binary is None:
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self.request_timeout_s
            status, _, data = await self._request("GET", "/v2", deadline)
            if status == 200:
                try:
                    doc = json.loads(data)
                except ValueError:
                    doc = None
                extensions = doc.get("extensions") if isinstance(doc, dict) else None
                self._binary = isinstance(extensions, list) and BINARY_EXTENSION in extensions
            elif status in (401, 403) or status >= 500:
                raise self._status_error(status, data, "server metadata")
            else:  # no metadata endpoint: assume plain JSON only
                self._binary = False
            log.debug("peer %s: binary tensor extension %s", self.name,
                      "supported" if self._binary else "not advertised; using JSON")
        return self._binary

    async def health(self, timeout_s: float | None = None) -> bool:
        """``GET /v2/health/ready`` answered 200 within the timeout. Never raises (but for
        cancellation); the reason of a failure is kept in ``last_error``."""
        return await self._ready("/v2/health/ready", timeout_s)

    async def model_ready(self, model: str, timeout_s: float | None = None) -> bool:
        """``GET /v2/models/{name}/ready`` (name mapped) answered 200."""
        return await self._ready(_model_path(self.remote_name(model), "/ready"), timeout_s)

    async def model_metadata(self, model: str, timeout_s: float | None = None) -> dict | None:
        """``GET /v2/models/{name}`` (name mapped): the peer's description of the model, or
        None when it could not be had (the reason is kept in ``last_error``). Never raises
        (but for cancellation)."""
        loop = asyncio.get_running_loop()
        budget = self.request_timeout_s if timeout_s is None else min(timeout_s, self.request_timeout_s)
        path = _model_path(self.remote_name(model))
        try:
            status, _, data = await self._request("GET", path, loop.time() + budget)
            metadata = json.loads(data) if status == 200 else None
        except PeerError as exc:
            self.last_error = exc.message
            return None
        except ValueError:
            metadata = None
        return metadata if isinstance(metadata, dict) else None

    def latency_estimate(self, model: str) -> float | None:
        """Moving average (EWMA) of successful infer round trips for this model, in seconds;
        None before the first one."""
        return self._latency.get(model)

    def latencies(self) -> dict[str, float]:
        return dict(self._latency)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> PeerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals

    def _observe(self, model: str, seconds: float) -> None:
        old = self._latency.get(model)
        self._latency[model] = seconds if old is None else old + LATENCY_EWMA_ALPHA * (seconds - old)

    async def _ready(self, path: str, timeout_s: float | None) -> bool:
        loop = asyncio.get_running_loop()
        budget = self.request_timeout_s if timeout_s is None else min(timeout_s, self.request_timeout_s)
        try:
            status, _, data = await self._request("GET", path, loop.time() + budget)
        except PeerError as exc:
            self.last_error = exc.message
            return False
        if status != 200:
            self.last_error = f"peer {self.name}: GET {path}: HTTP {status}: {error_message(data)}"
            return False
        return True

    def _get_session(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self._ssl if self._ssl is not None else True, limit=32)
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, raise_for_status=False
            )
        return self._session

    async def _request(
        self, method: str, path: str, deadline: float, *, body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, bytes]:
        """One HTTP exchange before `deadline` (loop time); (status, headers, body).

        Every transport failure becomes a PeerError. A pooled connection that the peer closed
        while idle is retried once on a fresh one, if time is left.
        """
        import aiohttp

        loop = asyncio.get_running_loop()
        url = self.endpoint.base_url + path
        for attempt in (1, 2):
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._fail(f"peer {self.name}: no answer to {method} {path} in time")
            session = self._get_session()
            try:
                async with session.request(
                    method, url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=remaining)
                ) as resp:
                    return resp.status, resp.headers, await resp.read()
            except aiohttp.ClientConnectorCertificateError as exc:
                raise self._fail(
                    f"peer {self.name}: TLS certificate of {self.url} not accepted: {exc.certificate_error}"
                ) from None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # A kept-alive connection the peer closed shows up as one of these (not a
                # fresh connect failing: ClientConnectorError); a new connection may work.
                if attempt == 1 and not isinstance(exc, aiohttp.ClientConnectorError):
                    continue
                if isinstance(exc, aiohttp.ServerDisconnectedError):
                    raise self._fail(f"peer {self.name}: {method} {path}: connection closed by the peer") from None
                raise self._fail(f"peer {self.name}: {method} {path}: {type(exc).__name__}: {exc}") from None
            except asyncio.TimeoutError:  # also aiohttp's ServerTimeoutError / ConnectionTimeoutError
                raise self._fail(
                    f"peer {self.name}: no answer to {method} {path} within {remaining:.3f} s"
                ) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise self._fail(f"peer {self.name}: {method} {path}: {type(exc).__name__}: {exc}") from None
        raise AssertionError("unreachable")

    def _fail(self, message: str, breaker_failure: bool = True) -> PeerError:
        # The peer may come back as another server: ask GET /v2 again next time.
        self._binary = None
        self.last_error = message
        return PeerError(message, peer=self.name, breaker_failure=breaker_failure)

    def _status_error(self, status: int, data: bytes, what: str) -> EdgeBatcherError:
        message = f"peer {self.name}: {error_message(data)}"
        if status == 404:
            exc: EdgeBatcherError = ModelNotFound(message)
        elif status in (401, 403):
            return self._fail(
                f"peer {self.name} refused our credentials for {what} (HTTP {status}: {error_message(data)}); "
                f"check its token / token_file"
            )
        elif status == 413:
            return self._fail(f"peer {self.name}: batch too large for the peer (HTTP 413): {error_message(data)}",
                              breaker_failure=False)
        elif status in (408, 429) or status >= 500 or status < 400:
            return self._fail(f"peer {self.name}: HTTP {status} for {what}: {error_message(data)}")
        else:
            exc = InvalidInput(message)
        exc.peer = self.name  # type: ignore[attr-defined]
        return exc


def _encode(inputs: dict[str, np.ndarray], parameters: dict, binary: bool) -> tuple[bytes, int | None]:
    return v2.encode_request(inputs, parameters=parameters, binary_inputs=binary, binary_outputs=binary)


def _model_path(model: str, suffix: str = "") -> str:
    return f"/v2/models/{quote(model, safe='')}{suffix}"
