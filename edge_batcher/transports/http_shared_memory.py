"""Triton's shared memory extensions on the HTTP API (Unix socket and TCP, one set of handlers):

    POST /v2/systemsharedmemory/region/{name}/register   {"key", "offset", "byte_size"} -> 200 {}
    POST /v2/systemsharedmemory[/region/{name}]/unregister                               -> 200 {}
    GET  /v2/systemsharedmemory[/region/{name}]/status   -> [{"name", "key", "offset", "byte_size"}]
    POST /v2/cudasharedmemory/region/{name}/register     -> 400: needs a discrete CUDA GPU
    POST /v2/cudasharedmemory[/region/{name}]/unregister -> 200 {} (nothing is registered)
    GET  /v2/cudasharedmemory[/region/{name}]/status     -> [] (or 400 naming an unknown region)

The registry (shared_memory/regions.py) is the daemon's one, shared with gRPC; its rules and
errors are docs/api.md's "Shared memory". The body is read like every other (http_body.py).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from ..errors import InvalidInput
from .http_body import read_body
from .http_keys import BODY_BUDGET, SHARED_MEMORY

SYSTEM = "/v2/systemsharedmemory"
CUDA = "/v2/cudasharedmemory"
CUDA_REFUSED = ("CUDA shared memory needs a discrete CUDA GPU with CUDA IPC, which this daemon does not serve; "
                "use system shared memory (/v2/systemsharedmemory): on a Jetson the GPU reads host memory "
                "directly, so system shared memory is the zero-copy path there")


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
    await _json_object(request, "register")
    raise InvalidInput(CUDA_REFUSED)


async def cuda_unregister(request: web.Request) -> web.Response:
    await _json_object(request, "unregister")
    return web.json_response({})


async def cuda_status(request: web.Request) -> web.Response:
    name = request.match_info.get("name")
    if name is not None:
        raise InvalidInput(f"no CUDA shared memory region {name!r} is registered (none can be: {CUDA_REFUSED})")
    return web.json_response([])


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
