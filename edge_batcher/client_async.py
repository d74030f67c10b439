"""The asyncio client: ``AsyncClient``, the same API as client.py's ``Client`` awaited, on one
pooled aiohttp session (aiohttp imported only when the session is first made, inside the running
loop). Requests and answers are built and read by client_requests.py, as the sync client's are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import client_requests as req
from . import client_shared_memory as shm
from .client_requests import DaemonUnreachable
from .client_shared_memory import RegionInput, RegionOutput, SharedMemoryRegion
from .protocol.endpoint import parse_url
from .protocol.v2 import HEADER_LENGTH, JSON_CONTENT_TYPE, DecodedResponse

if TYPE_CHECKING:
    import aiohttp


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
        self.url = url or req.default_url()
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
        body, headers = req.infer_body(
            inputs, outputs=outputs, id=id, priority=priority, timeout_ms=timeout_ms,
            binary=self.binary,
        )
        status, resp_headers, data = await self._request(
            "POST", req.model_path(model, "/infer"), body, headers
        )
        return req.infer_result(status, resp_headers.get(HEADER_LENGTH), data)

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
        body, headers = req.region_infer_body(inputs, regions, outputs=outputs, id=id, priority=priority,
                                              timeout_ms=timeout_ms, binary=self.binary)
        status, resp_headers, data = await self._request("POST", req.model_path(model, "/infer"), body, headers)
        return req.infer_result(status, resp_headers.get(HEADER_LENGTH), data, shm.output_reader(regions))

    async def register_region(self, region: SharedMemoryRegion, offset: int = 0,
                              byte_size: int | None = None) -> None:
        """Client.register_region, awaited."""
        status, _, data = await self._request("POST", req.region_path(region.name, "register"),
                                              req.register_body(region, offset, byte_size),
                                              {"Content-Type": JSON_CONTENT_TYPE})
        req.json_answer(status, data)

    async def unregister_region(self, name: str | None = None) -> None:
        """Client.unregister_region, awaited."""
        status, _, data = await self._request("POST", req.region_path(name, "unregister"), b"{}",
                                              {"Content-Type": JSON_CONTENT_TYPE})
        req.json_answer(status, data)

    async def region_status(self, name: str | None = None) -> list[dict]:
        """Client.region_status, awaited."""
        status, _, data = await self._request("GET", req.region_path(name, "status"))
        return req.json_answer(status, data)

    async def models(self) -> list[dict]:
        status, _, data = await self._request(
            "POST", "/v2/repository/index", b"{}", {"Content-Type": JSON_CONTENT_TYPE}
        )
        return req.json_answer(status, data)

    async def model_metadata(self, model: str) -> dict:
        status, _, data = await self._request("GET", req.model_path(model))
        return req.json_answer(status, data)

    async def stats(self, model: str) -> dict:
        status, _, data = await self._request("GET", req.model_path(model, "/stats"))
        return req.json_answer(status, data)

    async def all_stats(self) -> dict:
        status, _, data = await self._request("GET", "/v2/models/stats")
        return req.json_answer(status, data)

    async def repository_index(self) -> list[dict]:
        headers = {"Content-Type": JSON_CONTENT_TYPE}
        status, _, data = await self._request("POST", "/v2/repository/index", b"{}", headers)
        return req.json_answer(status, data)

    async def load_model(self, model: str) -> None:
        await self._repository("load", model)

    async def unload_model(self, model: str) -> None:
        await self._repository("unload", model)

    async def _repository(self, action: str, model: str) -> None:
        status, _, data = await self._request("POST", req.repository_path(model, action), b"{}",
                                              {"Content-Type": JSON_CONTENT_TYPE})
        req.json_answer(status, data)

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
