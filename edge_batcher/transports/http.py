"""The HTTP API (KServe v2 + Triton's extensions), one aiohttp app for the Unix socket and TCP.

This is the HTTP edge of the error tree: EdgeBatcherError subclasses become their status code
and `{"error": "..."}`; aiohttp's own HTTP errors (unknown route, body too large) get the same
shape; anything unexpected is logged and answered 500 while the daemon keeps serving.
Connection limits and framing errors live in `http_connections.py`, body limits in `http_body.py`,
Triton's generate extension in `http_generate.py`; request parameters are read by
`protocol/parameters.py`, as for every transport.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from .. import __version__
from ..errors import EdgeBatcherError
from ..protocol import v2
from ..protocol.parameters import to_infer_request
from ..runtime import Runtime
from ..shared_memory.cuda_regions import CudaRegionRegistry, link_namespaces
from ..shared_memory.lease import Lease
from ..shared_memory.regions import RegionRegistry
from .body_budget import BodyBudget
from .http_body import ClientGone, read_body
from .http_connections import connection_state_middleware
from .http_generate import add_generate_routes
from .http_index import add_index_routes
from .http_keys import BODY_BUDGET, CUDA_SHARED_MEMORY, HEALTH_CHECKS, RUNTIME, SHARED_MEMORY
from .http_repository import add_repository_routes
from .http_shared_memory import add_shared_memory_routes
from .triton_config import MODEL_VERSION, PLATFORMS, model_config, servable_for
from .v2_decode import decode_request

log = logging.getLogger(__name__)


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except EdgeBatcherError as exc:
        return error_response(exc.status, exc.message)
    except web.HTTPRequestEntityTooLarge as exc:
        limit = request.app._client_max_size  # aiohttp keeps the limit here
        return error_response(413, f"request body too large: limit is {limit} bytes ({exc.text})")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404:
            return error_response(404, f"no such endpoint: {request.method} {request.path}")
        if exc.status == 405:
            return error_response(405, f"method {request.method} not allowed on {request.path}")
        return error_response(exc.status, exc.text or exc.reason)
    except ClientGone:  # logged where it happened; nobody is left to read an answer
        return error_response(400, "the client closed the connection before its request body was complete")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a bug, not bad input: keep serving, say what happened
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def create_app(
    runtime: Runtime, *, max_body_bytes: int, middlewares: tuple = (), health_checks: dict | None = None,
    max_inflight_body_bytes: int | None = None, body_timeout_s: float = 60.0, body_budget: BodyBudget | None = None,
    shared_memory: RegionRegistry | None = None, cuda_shared_memory: CudaRegionRegistry | None = None,
) -> web.Application:
    """The app; `body_budget` is the daemon's one budget shared with the other transports (the
    edge's), else one of its own from the three body settings; `shared_memory` and
    `cuda_shared_memory` likewise the daemon's registries of regions (gRPC uses them too), else
    its own."""
    app = web.Application(client_max_size=max_body_bytes,
                          middlewares=[connection_state_middleware, error_middleware, *middlewares])
    app[RUNTIME] = runtime
    app[BODY_BUDGET] = body_budget or BodyBudget(max_body_bytes=max_body_bytes, timeout_s=body_timeout_s,
                                                 max_inflight_bytes=max_inflight_body_bytes or 4 * max_body_bytes)
    app[HEALTH_CHECKS] = health_checks if health_checks is not None else {}
    app[SHARED_MEMORY] = shared_memory or RegionRegistry()
    if cuda_shared_memory is None:
        cuda_shared_memory = CudaRegionRegistry()
        link_namespaces(app[SHARED_MEMORY], cuda_shared_memory)
    app[CUDA_SHARED_MEMORY] = cuda_shared_memory
    # aiohttp tries the routes under one path prefix in the order they were added: inference
    # first, so that the hot path matches one pattern instead of five.
    model_routes = ("/v2/models/{model}", "/v2/models/{model}/versions/{version}")  # KServe v2's two forms
    app.add_routes([web.post(model + "/infer", infer) for model in model_routes])
    app.add_routes([
        web.get("/v2/health/live", live),
        web.get("/v2/health/ready", ready),
        web.get("/v2", server_metadata),
        web.post("/v2/repository/index", repository_index),
        web.get("/v2/models/stats", all_stats),
        web.get("/metrics", metrics),
    ])  # fmt: skip
    for model in model_routes:
        app.add_routes([
            web.get(model, model_metadata),
            web.get(model + "/ready", model_ready),
            web.get(model + "/config", model_configuration),
            web.get(model + "/stats", model_stats),
        ])  # fmt: skip
    add_generate_routes(app)
    add_repository_routes(app)
    add_index_routes(app)
    add_shared_memory_routes(app)
    return app


async def live(request: web.Request) -> web.Response:
    return web.json_response({"live": True})


async def ready(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    body = {"ready": runtime.ready, "models": sorted(runtime.runners)}
    # A model that cannot serve now is listed with why (the others still serve: the daemon stays ready).
    not_ready = runtime.not_ready() if runtime.ready else {}
    if not_ready:
        body["not_ready"] = not_ready
    # Other transports' states ("mqtt": "connected" | "disconnected" | "disabled") are reported but
    # do not decide readiness: while the broker is away this socket still serves every model.
    for name, check in request.app[HEALTH_CHECKS].items():
        body[name] = check()
    return web.json_response(body, status=200 if runtime.ready else 503)


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response({
        "name": "edge-batcher",
        "version": __version__,
        "extensions": ["binary_tensor_data", "statistics", "model_repository", "model_configuration", "generate",
                       "system_shared_memory", "cuda_shared_memory"],
    })


async def repository_index(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    not_ready = runtime.not_ready()
    return web.json_response([
        {"name": name, "version": MODEL_VERSION, "state": "UNAVAILABLE" if name in not_ready else "READY"}
        | ({"reason": not_ready[name]} if name in not_ready else {})
        for name in sorted(runtime.runners)
    ])


def _servable(request: web.Request):
    """The model a /v2/models/{model}[/versions/{version}] route names (404 for another version)."""
    return servable_for(request.app[RUNTIME], request.match_info["model"], request.match_info.get("version", ""))


async def model_metadata(request: web.Request) -> web.Response:
    runner = _servable(request)
    c = runner.config
    return web.json_response({
        "name": runner.name,
        "versions": [MODEL_VERSION],
        "platform": PLATFORMS.get(c.backend, c.backend),  # Triton's name, as in /config
        "inputs": [s.to_json() for s in runner.inputs],
        "outputs": [s.to_json() for s in runner.outputs],
        "parameters": {
            "description": c.description,
            "labels": c.labels,
            "preferred_batch_sizes": c.batching.preferred_batch_sizes,
            "max_batch_size": c.batching.max_batch_size,
            "max_queue_delay_ms": c.batching.max_queue_delay_ms,
            "dispatch_when_idle": c.batching.dispatch_when_idle,
            "priority_levels": c.batching.priority_levels,
            "sequence_buckets": c.sequence.buckets if c.sequence else [],
        },
    })


async def model_ready(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    why = _servable(request).not_ready() if runtime.ready else "the daemon is not ready"  # 404: unknown model
    body: dict[str, object] = {"ready": why is None}
    if why is not None:
        body["reason"] = why
    return web.json_response(body, status=200 if why is None else 503)


async def model_configuration(request: web.Request) -> web.Response:
    return web.json_response(model_config(_servable(request)))


async def model_stats(request: web.Request) -> web.Response:
    return web.json_response({"model_stats": [_servable(request).statistics()]})


async def all_stats(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    body = {"model_stats": [r.statistics() for _, r in sorted(runtime.runners.items())]}
    if runtime.offload is not None:
        body["offload_peers"] = runtime.offload.status()
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    text = request.app[RUNTIME].metrics.render()
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def infer(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME]
    model = request.match_info["model"]
    servable = _servable(request)  # 404 before reading the body
    servable.refuse_if_full()  # 429 before reading and decoding the body
    header_length = v2.parse_header_length(request.headers.get(v2.HEADER_LENGTH))
    async with read_body(request.app[BODY_BUDGET], request) as body:  # 413/503/408 before holding it
        # the regions it uses stay mapped (CUDA ones open) until it ends
        with Lease(request.app[SHARED_MEMORY], request.app[CUDA_SHARED_MEMORY]) as regions:
            decoded = await decode_request(body, header_length, regions.read_input)
            targets = regions.output_targets(decoded.outputs)
            infer_request = to_infer_request(model, decoded, servable.config.batching.priority_levels)
            infer_request.finish_outputs = regions.device_outputs(targets)
            response = await runtime.infer(infer_request)
            outputs, in_regions = await regions.write_outputs(response.outputs, targets)
    binary = v2.binary_outputs_for(decoded, list(outputs))
    payload, json_length = v2.encode_response(model, response.id, outputs, binary=binary, without_data=in_regions,
                                              parameters=response.parameters or None, model_version=MODEL_VERSION)
    if json_length is None:
        return web.Response(body=payload, content_type="application/json")
    return web.Response(
        body=payload, content_type=v2.BINARY_CONTENT_TYPE, headers={v2.HEADER_LENGTH: str(json_length)}
    )
