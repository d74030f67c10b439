"""A rag model's document index over the HTTP API (edge-batcher's own; Triton has none):

    GET  /v2/models/{rag}/index          -> {"dir", "count", "version", "embedding_model", "sources", "updated"}
    POST /v2/models/{rag}/index          {"documents": [{"source": "notes.md", "text": "..."}], "rebuild": false}
                                         -> {"added", "replaced", "count", "version", "empty"}
    POST /v2/models/{rag}/index/remove   {"sources": ["notes.md"]} -> {"removed", "count", "version", "unknown"}

The daemon splits, embeds and writes its own index (rag/documents.py), so an operator adds
documents to the installed service through its socket (`edge-batcher index add --url ...`) and
never writes its files. Adding a source again replaces its passages; a `.md` / `.markdown`
source is split as markdown, anything else as plain text. Embedding takes time (about 20 texts a
second on a 2-core CPU): the answer comes when the index is written and loaded. The body is read
like every other (http_body.py: its size limit, budget and timeout) and decoded off the event
loop when large.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from ..errors import InvalidInput
from ..rag.index_update import Document
from .http_body import read_body
from .http_keys import BODY_BUDGET, RUNTIME
from .v2_decode import off_loop_if_large


def add_index_routes(app: web.Application) -> None:
    app.router.add_get("/v2/models/{model}/index", info)
    app.router.add_post("/v2/models/{model}/index", add)
    app.router.add_post("/v2/models/{model}/index/remove", remove)


def _documents_of(request: web.Request):
    model = request.match_info["model"]
    servable = request.app[RUNTIME].runner(model)  # 404 for an unknown model
    documents = getattr(servable, "documents", None)
    if documents is None:
        raise InvalidInput(f"model {model!r} has no document index: only rag models do")
    return documents


async def info(request: web.Request) -> web.Response:
    return web.json_response(_documents_of(request).info())


async def add(request: web.Request) -> web.Response:
    documents = _documents_of(request)
    doc = await _json_body(request)
    items = doc.get("documents")
    if not isinstance(items, list) or not items:
        raise InvalidInput("documents: expected a non-empty list of {\"source\": ..., \"text\": ...}")
    parsed = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("source"), str) or not item["source"] \
                or not isinstance(item.get("text"), str):
            raise InvalidInput(f"documents[{i}]: expected {{\"source\": a non-empty string, \"text\": a string}}")
        parsed.append(Document(item["source"], item["text"]))
    rebuild = doc.get("rebuild", False)
    if not isinstance(rebuild, bool):
        raise InvalidInput("rebuild: expected true or false")
    return web.json_response(await documents.add(parsed, rebuild))


async def remove(request: web.Request) -> web.Response:
    documents = _documents_of(request)
    sources = (await _json_body(request)).get("sources")
    if not isinstance(sources, list) or not sources or not all(isinstance(s, str) for s in sources):
        raise InvalidInput("sources: expected a non-empty list of source names")
    return web.json_response(await documents.remove(sources))


async def _json_body(request: web.Request) -> dict[str, Any]:
    async with read_body(request.app[BODY_BUDGET], request) as body:
        data = bytes(body)
    try:
        doc = await off_loop_if_large(len(data), json.loads, data)  # a manual's worth of text: not on the loop
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"the body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput("the body must be a JSON object")
    return doc
