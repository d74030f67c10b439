"""Triton's model repository extension on the HTTP API: load, reload and unload one model.

    POST /v2/repository/models/{m}/load     [{"parameters": {}}]  -> 200 {}  (the model loaded, or
                                            loaded again from its files: the old version serves
                                            until the new one is warm)
    POST /v2/repository/models/{m}/unload   [{"parameters": {}}]  -> 200 {}

As Triton answers them for tritonclient's `load_model` / `unload_model`; `POST
/v2/repository/index` (http.py) lists the models with their state. The model is the one in the
repository's directory of that name, loaded as at start (its memory measured, refused with the
figures when the budget cannot hold it: the old version, if any, keeps serving). Triton's
parameters that replace a model's config or files are refused (400): edge-batcher loads what
model.toml says; unloading a model a loaded rag model uses is refused until that one is
unloaded. The body is read like every other (http_body.py).
"""

from __future__ import annotations

import json

from aiohttp import web

from ..errors import ConfigError, InvalidInput
from .http_body import read_body
from .http_keys import BODY_BUDGET, RUNTIME


def add_repository_routes(app: web.Application) -> None:
    app.router.add_post("/v2/repository/models/{model}/load", load)
    app.router.add_post("/v2/repository/models/{model}/unload", unload)


async def load(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    await _no_parameters(request, "load")
    try:
        await request.app[RUNTIME].load_model(name)
    except ConfigError as exc:  # a bad model.toml, a missing file, memory the budget cannot give
        raise InvalidInput(f"failed to load {name!r}: {exc}") from None
    return web.json_response({})


async def unload(request: web.Request) -> web.Response:
    await _no_parameters(request, "unload", allowed={"unload_dependents": False})
    await request.app[RUNTIME].unload_model(request.match_info["model"])
    return web.json_response({})


async def _no_parameters(request: web.Request, what: str, allowed: dict | None = None) -> None:
    """The body, if any: a JSON object whose `parameters` must be empty (or absent), but for
    those `allowed` with the value given there (tritonclient's unload sends unload_dependents:
    false; there are no dependents to unload: no ensembles here)."""
    async with read_body(request.app[BODY_BUDGET], request) as body:
        if not body.strip():
            return
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"{what}: the body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput(f"{what}: the body must be a JSON object")
    parameters = doc.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidInput(f"{what}: parameters must be an object")
    unsupported = sorted(k for k, v in parameters.items() if (allowed or {}).get(k, object()) != v)
    if unsupported:
        raise InvalidInput(f"{what}: parameters {', '.join(unsupported)} are not supported: edge-batcher "
                           "loads a model as its directory's model.toml says (change it there)")
