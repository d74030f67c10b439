"""Triton's generate extension on the HTTP API, for the generation services (rag, generator).

    POST /v2/models/{m}/generate          {"text_input": "...", "parameters": {...}}
                                          -> {"model_name", "model_version", "text_output", ...}
    POST /v2/models/{m}/generate_stream   same body -> text/event-stream, chunked: one
                                          `data: {...}` event per piece of text as it is generated

The body's keys: `text_input` (the model's text input, whatever its name: `question` for a
rag model, `text_input` for a generator) or the input's own name; `parameters` (an object);
`id`; any other key is taken as a parameter too (as Triton does), e.g. "max_new_tokens": 64.
`priority` and the deadline (`timeout_ms`, or Triton's `timeout` in microseconds) are read by
protocol/parameters.py, as for /infer and MQTT.

Responses carry every output by name (BYTES as strings; `sources` as the JSON list it holds),
`text_output` (the text output, for clients written for Triton), and the service's parameters
(finish_reason, prompt_tokens, completion_tokens, mode). Each stream event has the piece in
`text_output` (and the output's own name); the first event of a rag stream has `sources`;
the last has "final": true and finish_reason. An error before the first event is an ordinary
JSON error with its status; one during the stream is a last event {"error": ..., "status": ...}.
A client that disconnects cancels its generation (its KV memory is released at once).

The body is read like /infer's (http_body.py): the model's 429 and the 413/503 of the body
budget come before a byte of it is read, it must arrive within body_timeout_s (408), and its
bytes stay charged to the budget until the answer (or the stream) is complete.
"""

from __future__ import annotations

import json
import logging
from contextlib import aclosing

import numpy as np
from aiohttp import web

from ..errors import EdgeBatcherError, InvalidInput
from ..protocol.parameters import priority_parameter, timeout_parameter
from ..types import InferRequest, InferResponse
from .http_body import read_body
from .http_keys import BODY_BUDGET, RUNTIME
from .v2_decode import off_loop_if_large

log = logging.getLogger(__name__)

FINAL = "triton_final_response"
RESERVED_KEYS = ("id", "parameters")


def add_generate_routes(app: web.Application) -> None:
    app.router.add_post("/v2/models/{model}/generate", generate)
    app.router.add_post("/v2/models/{model}/generate_stream", generate_stream)


def _service(request: web.Request):
    model = request.match_info["model"]
    runner = request.app[RUNTIME].runner(model)  # 404 for an unknown model
    if not callable(getattr(runner, "stream", None)):
        raise InvalidInput(f"model {model!r} does not generate text: the generate extension serves rag and "
                           "generator models; use POST /v2/models/{m}/infer for it")
    return model, runner


async def _parse_json(raw: bytes | bytearray):
    """The body as JSON; a large one is parsed on a worker thread, off the event loop."""
    return await off_loop_if_large(len(raw), _loads, raw)


def _loads(raw: bytes | bytearray):
    try:
        return json.loads(raw or b"null")
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, too deep
        raise InvalidInput(f"request body is not valid JSON: {exc}") from None


async def _to_request(raw: bytes | bytearray, model: str, runner) -> InferRequest:
    body = await _parse_json(raw)
    if not isinstance(body, dict):
        raise InvalidInput('request body must be a JSON object like {"text_input": "...", "parameters": {}}')
    spec = runner.inputs[0]
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput("'parameters' must be a JSON object")
    parameters = dict(parameters)
    text = None
    for key, value in body.items():
        if key in ("text_input", spec.name):
            if text is not None:
                raise InvalidInput(f"give the text once, as 'text_input' or {spec.name!r}")
            text = value
        elif key not in RESERVED_KEYS:
            parameters[key] = value
    if text is None:
        raise InvalidInput(f"missing 'text_input' (the text for model {model!r})")
    if not isinstance(text, str):
        raise InvalidInput(f"'text_input' must be a string, got {type(text).__name__}")
    request_id = body.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidInput("'id' must be a string")
    timeout_s = timeout_parameter(parameters)  # timeout_ms, or Triton's timeout in microseconds
    priority = priority_parameter(parameters, runner.config.batching.priority_levels)
    array = np.empty(1, dtype=object)
    try:
        array[0] = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, e.g. the JSON escape "\ud800"
        raise InvalidInput("'text_input' is not valid unicode (it has a lone surrogate)") from None
    return InferRequest(model=model, inputs={spec.name: array}, id=request_id, priority=priority,
                        timeout_s=timeout_s, parameters=parameters)


def _text_output_name(runner) -> str:
    names = [o.name for o in runner.outputs if o.datatype == "BYTES"]
    for preferred in ("text_output", "answer"):
        if preferred in names:
            return preferred
    return names[0] if names else runner.outputs[0].name


def to_json(model: str, runner, response: InferResponse) -> dict:
    out: dict = {"model_name": model, "model_version": "1"}
    if response.id is not None:
        out["id"] = response.id
    for name, value in response.outputs.items():
        out[name] = _json_value(name, value)
    main = _text_output_name(runner)
    if main in out:
        out["text_output"] = out[main]
    for key, value in response.parameters.items():
        if key == FINAL:
            out["final"] = bool(value)
        else:
            out.setdefault(key, value)
    return out


def _json_value(name: str, value: np.ndarray):
    items = value.reshape(-1).tolist()
    if value.dtype == object:
        items = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in items]
        if name == "sources":
            items = [json.loads(v) if isinstance(v, str) and v else v for v in items]
    return items[0] if len(items) == 1 else items


async def generate(request: web.Request) -> web.Response:
    model, runner = _service(request)
    runner.refuse_if_full()  # 429 before reading the body
    async with read_body(request.app[BODY_BUDGET], request) as raw:  # 413/503/408 before holding it
        response = await runner.infer(await _to_request(raw, model, runner))
    return web.json_response(to_json(model, runner, response))


async def generate_stream(request: web.Request) -> web.StreamResponse:
    model, runner = _service(request)
    runner.refuse_if_full()
    async with read_body(request.app[BODY_BUDGET], request) as raw:
        return await _stream(request, model, runner, await _to_request(raw, model, runner))


async def _stream(request: web.Request, model: str, runner, infer_request: InferRequest) -> web.StreamResponse:
    async with aclosing(runner.stream(infer_request)) as chunks:  # closing it cancels the generation
        iterator = chunks.__aiter__()
        # The first chunk comes before any byte is sent: a bad request, an unknown parameter or a
        # request that cannot fit still gets its ordinary status code and JSON error.
        first = await iterator.__anext__()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        response.enable_chunked_encoding()
        try:
            await response.prepare(request)  # the client may be gone already: the headers fail too
            await _event(response, to_json(model, runner, first))
            async for chunk in iterator:
                await _event(response, to_json(model, runner, chunk))
        except EdgeBatcherError as exc:
            await _event(response, {"model_name": model, "error": exc.message, "status": exc.status, "final": True})
        except (ConnectionResetError, ConnectionError):
            log.info("model %s: stream client went away; generation cancelled", model)
            return response
        await response.write_eof()
        return response


async def _event(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n")
