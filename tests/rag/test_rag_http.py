"""The generate extension (POST /v2/models/{m}/generate and /generate_stream) on the real aiohttp
app, with a real Runtime holding minilm, the rag models and the tiny decoder."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from edge_batcher.config import DaemonConfig, MemorySettings, ModelsSettings
from edge_batcher.runtime import Runtime
from edge_batcher.transports.http import create_app
from edge_batcher.transports.http_generate import add_generate_routes

pytestmark = pytest.mark.asyncio(loop_scope="module")
QUESTION = "When does the sensor battery need to be replaced?"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(rag_repo):
    runtime = Runtime(DaemonConfig(models=ModelsSettings(repository=str(rag_repo), warmup=False),
                                   memory=MemorySettings(probe="fixed", budget_mb=1024)))
    await runtime.start()
    app = create_app(runtime, max_body_bytes=1 << 20)
    add_generate_routes(app)
    async with TestClient(TestServer(app)) as c:
        yield c
    await runtime.close()


async def events(response) -> list[dict]:
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    body = (await response.read()).decode()
    assert body.endswith("\n\n")
    return [json.loads(block.removeprefix("data: ")) for block in body.strip().split("\n\n")]


async def test_generate_on_the_generator(client):
    r = await client.post("/v2/models/tinylm/generate",
                          json={"text_input": "Bearing faults",
                                "parameters": {"max_new_tokens": 8, "ignore_stop": True}})
    body = await r.json()
    assert r.status == 200, body
    assert body["model_name"] == "tinylm" and body["finish_reason"] == "length" and body["completion_tokens"] == 8
    assert isinstance(body["text_output"], str) and body["text_output"]
    # Triton style: keys other than the input are parameters too.
    r2 = await client.post("/v2/models/tinylm/generate", json={"text_input": "Bearing faults", "max_new_tokens": 8,
                                                              "ignore_stop": True})
    assert (await r2.json())["text_output"] == body["text_output"]


async def test_generate_stream_sends_pieces_that_join_to_the_whole_answer(client):
    payload = {"text_input": "Bearing faults", "parameters": {"max_new_tokens": 20, "ignore_stop": True}}
    whole = await (await client.post("/v2/models/tinylm/generate", json=payload)).json()
    r = await client.post("/v2/models/tinylm/generate_stream", json=payload)
    assert r.headers.get("Transfer-Encoding") == "chunked"
    chunks = await events(r)
    assert len(chunks) >= 5 and chunks[-1]["final"] is True and chunks[-1]["finish_reason"] == "length"
    assert all(c.get("final") is False for c in chunks[:-1])
    assert "".join(c["text_output"] for c in chunks) == whole["text_output"]


async def test_rag_generate_extractive_and_streamed_with_sources(client):
    r = await client.post("/v2/models/rag/generate", json={"text_input": QUESTION})
    body = await r.json()
    assert r.status == 200, body
    assert body["sources"][0]["id"] == "vibration-sensor-manual#battery"
    assert body["text_output"] == body["answer"] and "3.3 V" in body["answer"] and body["mode"] == "extractive"

    r = await client.post("/v2/models/raggen/generate_stream",
                          json={"question": QUESTION,
                                "parameters": {"max_new_tokens": 12, "ignore_stop": True, "top_k": 1}})
    chunks = await events(r)
    assert [s["id"] for s in chunks[0]["sources"]] == ["vibration-sensor-manual#battery"]
    assert chunks[0]["answer"] == "" and chunks[-1]["final"] is True and chunks[-1]["completion_tokens"] == 12
    streamed = "".join(c["answer"] for c in chunks)
    r = await client.post("/v2/models/raggen/generate",
                          json={"text_input": QUESTION,
                                "parameters": {"max_new_tokens": 12, "ignore_stop": True, "top_k": 1}})
    body = await r.json()
    assert body["answer"] == streamed and body["mode"] == "generated"
    assert [s["id"] for s in body["sources"]] == ["vibration-sensor-manual#battery"]


@pytest.mark.parametrize("path, payload, status, message", [
    ("/v2/models/rag/generate_stream", {"text_input": ""}, 400, "is empty"),
    ("/v2/models/rag/generate", {"parameters": {}}, 400, "missing 'text_input'"),
    ("/v2/models/rag/generate", {"text_input": 5}, 400, "must be a string"),
    ("/v2/models/rag/generate", {"text_input": "battery", "top_k": 0}, 400, "parameters.top_k"),
    ("/v2/models/rag/generate", {"text_input": "battery " * 200}, 400, "tokens, more than the 128"),
    ("/v2/models/raggen/generate_stream", {"text_input": "battery", "max_new_tokens": 2000}, 400, "max_new_tokens"),
    ("/v2/models/minilm/generate", {"text_input": "x"}, 400, "does not generate text"),
    ("/v2/models/nope/generate_stream", {"text_input": "x"}, 404, "unknown model"),
])
async def test_bad_requests_get_a_json_error_before_any_stream(client, path, payload, status, message):
    r = await client.post(path, json=payload)
    body = await r.json()
    assert r.status == status and message in body["error"], body


async def test_body_that_is_not_json(client):
    r = await client.post("/v2/models/tinylm/generate", data=b"{nope")
    assert r.status == 400 and "not valid JSON" in (await r.json())["error"]
