"""What both clients (client.py's Client, client_async.py's AsyncClient) send and how they read
the answers: the daemon's default address, the error classes (``ClientError``, and
``DaemonUnreachable`` with a sentence naming the address and the fix), the API's paths, and the
bodies of infer and shared memory requests, built and decoded here once for both transports.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any
from urllib.parse import quote

import numpy as np

from . import client_shared_memory as shm
from .client_shared_memory import RegionInput, RegionOutput, SharedMemoryRegion
from .errors import InvalidInput
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


def repository_path(model: str, action: str) -> str:
    """Triton's repository extension: /v2/repository/models/{model}/load or unload."""
    return f"/v2/repository/models/{quote(model, safe='')}/{action}"


def region_path(name: str | None, action: str) -> str:
    """Triton's system shared memory extension: /v2/systemsharedmemory[/region/{name}]/{action}."""
    return "/v2/systemsharedmemory" + (f"/region/{quote(name, safe='')}" if name else "") + f"/{action}"


def model_path(model: str, suffix: str = "") -> str:
    return f"/v2/models/{quote(model, safe='')}{suffix}"


def infer_body(
    inputs: dict[str, np.ndarray],
    *,
    outputs: list[str] | None,
    id: str | None,
    priority: int | None,
    timeout_ms: float | None,
    binary: bool,
) -> tuple[bytes, dict[str, str]]:
    """Encode an infer request; return the body and the content headers it needs."""
    body, header_length = encode_request(inputs, id=id, parameters=_parameters(priority, timeout_ms), outputs=outputs,
                                         binary_inputs=binary, binary_outputs=binary)
    return body, content_headers(header_length)  # JSON mode can still be binary (BYTES not utf-8)


def region_infer_body(
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
    body, header_length = shm.encode_request(inputs, output_regions, outputs=outputs, id=id,
                                             parameters=_parameters(priority, timeout_ms), binary=binary)
    return body, content_headers(header_length)


def _parameters(priority: int | None, timeout_ms: float | None) -> dict[str, Any] | None:
    """A request's parameters: those given, or None."""
    given = {k: v for k, v in (("priority", priority), ("timeout_ms", timeout_ms)) if v is not None}
    return given or None


def content_headers(header_length: int | None) -> dict[str, str]:
    """A JSON body's content type, or a binary one's with the length of its JSON header."""
    if header_length is None:
        return {"Content-Type": JSON_CONTENT_TYPE}
    return {"Content-Type": BINARY_CONTENT_TYPE, HEADER_LENGTH: str(header_length)}


def register_body(region: SharedMemoryRegion, offset: int, byte_size: int | None) -> bytes:
    size = region.byte_size - offset if byte_size is None else byte_size
    return json.dumps({"key": region.key, "offset": offset, "byte_size": size}).encode()


def check(status: int, body: bytes) -> None:
    if not 200 <= status < 300:
        raise ClientError(status, error_message(body))


def json_answer(status: int, body: bytes) -> Any:
    check(status, body)
    try:
        return json.loads(body) if body else None
    except ValueError as e:
        raise ClientError(status, f"response is not valid JSON: {e}") from None


def infer_result(status: int, header_length: str | None, body: bytes,
                  regions: RegionReader | None = None) -> DecodedResponse:
    check(status, body)
    try:
        return decode_response(body, parse_header_length(header_length), regions)
    except InvalidInput as e:
        raise ClientError(status, f"invalid inference response: {e.message}") from None
