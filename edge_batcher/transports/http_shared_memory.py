"""Triton's shared memory extensions on the HTTP API (Unix socket and TCP, one set of handlers):

    POST /v2/systemsharedmemory/region/{name}/register   {"key", "offset", "byte_size"} -> 200 {}
    POST /v2/systemsharedmemory[/region/{name}]/unregister                               -> 200 {}
    GET  /v2/systemsharedmemory[/region/{name}]/status   -> [{"name", "key", "offset", "byte_size"}]
    POST /v2/cudasharedmemory/region/{name}/register     {"raw_handle": {"b64"}, "device_id", "byte_size"} -> 200 {}
    POST /v2/cudasharedmemory[/region/{name}]/unregister                               -> 200 {}
    GET  /v2/cudasharedmemory[/region/{name}]/status     -> [{"name", "device_id", "byte_size"}]

The registries (shared_memory/regions.py, cuda_regions.py) are the daemon's, shared with gRPC;
their rules and errors are docs/api.md's "Shared memory". CUDA registration and unregistration
open and close IPC mappings, blocking calls: they run on a thread. The body is read like every
other (http_body.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from typing import Any

from aiohttp import web

from ..errors import InvalidInput
from .http_body import read_body
from .http_keys import BODY_BUDGET, CUDA_SHARED_MEMORY, SHARED_MEMORY

SYSTEM = "/v2/systemsharedmemory"
CUDA = "/v2/cudasharedmemory"


def add_shared_memory_routes(app: web.Application) -> None:
    app.router.add_post(SYSTEM + "/region/{name}/register", register)
    app.router.add_post(SYSTEM + "/region/{name}/unregister", unregister)
    app.router.add_post(SYSTEM + "/unregister", unregister)
    app.router.add_get(SYSTEM + "/region/{name}/status", status)
    app.router.add_get(SYSTEM + "/status", status)
    app.router.add_post(CUDA + "/region/{name}/register", cuda_register)
    app.router.add_post(CUDA + "/region/{name}/unregister", cuda_unregister)
    app.router.add_post(CUDA + "/unregister", cuda_unregister)
    app.router.add_get(CUDA + "/region/{name}/status", cuda_status)
    app.router.add_get(CUDA + "/status", cuda_status)


async def register(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    doc = await _json_object(request, "register")
    if "key" not in doc or "byte_size" not in doc:
        raise InvalidInput(f"register {name!r}: the body needs \"key\" and \"byte_size\" (and may give \"offset\")")
    request.app[SHARED_MEMORY].register(name, doc["key"], doc.get("offset", 0), doc["byte_size"])
    return web.json_response({})


async def unregister(request: web.Request) -> web.Response:
    await _json_object(request, "unregister")  # read (and checked) before answering, as any body
    request.app[SHARED_MEMORY].unregister(request.match_info.get("name"))
    return web.json_response({})


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[SHARED_MEMORY].status(request.match_info.get("name")))


async def cuda_register(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    doc = await _json_object(request, "register")
    if "raw_handle" not in doc or "device_id" not in doc or "byte_size" not in doc:
        raise InvalidInput(f"register {name!r}: the body needs \"raw_handle\" ({{\"b64\": the base64 of the "
                           "cudaIpcMemHandle_t}), \"device_id\" and \"byte_size\"")
    raw = decode_raw_handle(doc["raw_handle"], name)
    registry = request.app[CUDA_SHARED_MEMORY]
    await asyncio.get_running_loop().run_in_executor(None, registry.register, name, raw, doc["device_id"],
                                                     doc["byte_size"])
    return web.json_response({})


async def cuda_unregister(request: web.Request) -> web.Response:
    await _json_object(request, "unregister")
    registry = request.app[CUDA_SHARED_MEMORY]
    await asyncio.get_running_loop().run_in_executor(None, registry.unregister, request.match_info.get("name"))
    return web.json_response({})


async def cuda_status(request: web.Request) -> web.Response:
    return web.json_response(request.app[CUDA_SHARED_MEMORY].status(request.match_info.get("name")))


def decode_raw_handle(raw_handle: Any, name: str) -> bytes:
    """Triton's {"b64": "..."} -> the handle's bytes (their length is the registry's to check).
    Line breaks and spaces are dropped first: Triton's C++ client (perf_analyzer's) encodes with
    libb64, which breaks lines every 72 characters and ends with one, and Triton accepts that."""
    b64 = raw_handle.get("b64") if isinstance(raw_handle, dict) else None
    if not isinstance(b64, str):
        raise InvalidInput(f"register {name!r}: raw_handle must be {{\"b64\": the base64 of the cudaIpcMemHandle_t}}, "
                           f"got {str(raw_handle)[:80]!r}")
    try:
        return base64.b64decode("".join(b64.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"register {name!r}: raw_handle.b64 is not base64") from None


async def _json_object(request: web.Request, what: str) -> dict[str, Any]:
    """The body as a JSON object ({} when empty)."""
    async with read_body(request.app[BODY_BUDGET], request) as body:
        if not body.strip():
            return {}
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"{what}: the body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput(f"{what}: the body must be a JSON object")
    return doc
