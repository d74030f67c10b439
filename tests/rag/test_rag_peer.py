"""Generation on a nearby server: the rag model streaming from an OpenAI-compatible
chat-completions peer (a real aiohttp app in this test, speaking that API over a real socket),
and the fallback to extractive answers when the peer is down or its breaker is open."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from edge_batcher.config import DaemonConfig, MemorySettings, ModelsSettings
from edge_batcher.runtime import Runtime
from edge_batcher.transports.http import create_app
from edge_batcher.transports.http_generate import add_generate_routes

pytestmark = pytest.mark.asyncio(loop_scope="module")
QUESTION = "When does the sensor battery need to be replaced?"
PIECES = ["Replace", " the", " battery", " below", " 3.3", " V", " [1]."]
TOKEN = "s3cret"


class ChatPeerApp:
    """Plays an OpenAI-compatible server (vLLM, llama.cpp, Ollama): /v1/models and streaming
    /v1/chat/completions; `down` makes it answer 503 to everything."""

    def __init__(self):
        self.down = False
        self.requests: list[dict] = []
        self.app = web.Application()
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/chat/completions", self.chat)

    async def models(self, request):
        if self.down:
            return web.json_response({"error": "loading"}, status=503)
        return web.json_response({"object": "list", "data": [{"id": "tiny-chat"}]})

    async def chat(self, request):
        if self.down:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": {"message": "bad token"}}, status=401)
        body = await request.json()
        self.requests.append(body)
        assert body["stream"] is True
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        pieces = PIECES[: body.get("max_tokens", len(PIECES))]
        for i, piece in enumerate(pieces):
            finish = ("stop" if len(pieces) == len(PIECES) else "length") if i == len(pieces) - 1 else None
            chunk = {"object": "chat.completion.chunk", "model": body["model"],
                     "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": finish}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.01)  # tokens arrive over time, as from a real server
        usage = {"choices": [], "usage": {"prompt_tokens": 321, "completion_tokens": len(pieces)}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response


PEER_TOML = """\
backend = "rag"
[batching]
default_timeout_ms = 30000
[rag]
embedding_model = "minilm"
index_dir = "{index}"
top_k = 2
generator = "{generator}"
[rag.peer]
url = "{url}"
model = "tiny-chat"
token = "{token}"
health_interval_s = 0.2
breaker_failures = 2
breaker_reset_s = 60
first_token_timeout_s = 5
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def setup(rag_repo, tmp_path_factory):
    peer = ChatPeerApp()
    server = TestServer(peer.app)
    await server.start_server()
    repo = tmp_path_factory.mktemp("peer_repo")
    for name in ("minilm", "tinylm"):
        (repo / name).symlink_to(rag_repo / name)
    url = str(server.make_url("")).rstrip("/")
    for name, generator in (("ragpeer", ""), ("raghybrid", "tinylm")):
        (repo / name).mkdir()
        (repo / name / "model.toml").write_text(PEER_TOML.format(index=rag_repo / "index", generator=generator,
                                                                 url=url, token=TOKEN))
    runtime = Runtime(DaemonConfig(models=ModelsSettings(repository=str(repo), warmup=False),
                                   memory=MemorySettings(probe="fixed", budget_mb=1024)))
    await runtime.start()
    app = create_app(runtime, max_body_bytes=1 << 20)
    add_generate_routes(app)
    async with TestClient(TestServer(app)) as client:
        yield peer, client, runtime
    await runtime.close()
    await server.close()


async def sse(response) -> list[dict]:
    assert response.status == 200, await response.text()
    body = (await response.read()).decode()
    return [json.loads(block.removeprefix("data: ")) for block in body.strip().split("\n\n")]


async def test_the_peer_generates_the_answer_from_the_retrieved_passages(setup):
    peer, client, _ = setup
    r = await client.post("/v2/models/ragpeer/generate", json={"text_input": QUESTION, "max_new_tokens": 50})
    body = await r.json()
    assert r.status == 200, body
    assert body["answer"] == body["text_output"] == "".join(PIECES)
    assert body["mode"] == "generated" and body["route"] == "peer" and body["finish_reason"] == "stop"
    assert body["prompt_tokens"] == 321 and body["completion_tokens"] == len(PIECES)
    sent = peer.requests[-1]
    assert sent["model"] == "tiny-chat" and sent["max_tokens"] == 50
    prompt = sent["messages"][0]["content"]
    assert QUESTION in prompt and "3.3 V" in prompt  # the battery passage went into the prompt
    assert body["sources"][0]["id"] == "vibration-sensor-manual#battery"


async def test_the_peer_streams_token_by_token_over_http(setup):
    peer, client, _ = setup
    r = await client.post("/v2/models/ragpeer/generate_stream", json={"text_input": QUESTION,
                                                                       "parameters": {"max_new_tokens": 4}})
    chunks = await sse(r)
    assert chunks[0]["sources"][0]["id"] == "vibration-sensor-manual#battery" and chunks[0]["route"] == "peer"
    pieces = [c["text_output"] for c in chunks[1:-1]]
    assert pieces == PIECES[:4]  # one event per piece the peer sent, in order
    assert chunks[-1]["final"] is True and chunks[-1]["finish_reason"] == "length" and chunks[-1]["peer"]


async def test_local_generator_first_peer_when_it_cannot_take_the_sequence_now(setup):
    _, client, runtime = setup
    payload = {"text_input": QUESTION, "parameters": {"max_new_tokens": 4, "ignore_stop": True}}
    local = await (await client.post("/v2/models/raghybrid/generate", json=payload)).json()
    assert local["route"] == "local" and local["completion_tokens"] == 4
    # Keep the local generator busy: every decode slot taken and sequences waiting for one.
    gen = runtime.runners["tinylm"]
    busy = [await gen.submit("Bearing faults", {"max_new_tokens": 256, "ignore_stop": True}) for _ in range(64)]
    try:
        offloaded = await (await client.post("/v2/models/raghybrid/generate", json=payload)).json()
    finally:
        for seq in busy:
            seq.cancelled = True
        gen._loop.wake()  # the decode loop drops the cancelled sequences (rag/decode_loop.py)
    assert offloaded["route"] == "peer" and offloaded["answer"] == "".join(PIECES[:4])
    stats = (await (await client.get("/v2/models/raghybrid/stats")).json())["model_stats"][0]
    assert stats["routes"]["local"] == 1 and stats["routes"]["peer"] == 1


async def test_a_peer_that_is_down_falls_back_to_an_extractive_answer_and_opens_its_breaker(setup):
    peer, client, _ = setup
    peer.down = True
    try:
        answers = []
        for _ in range(3):
            r = await client.post("/v2/models/ragpeer/generate", json={"text_input": QUESTION})
            answers.append(await r.json())
            assert r.status == 200, answers[-1]
        for body in answers:
            assert body["mode"] == "extractive" and body["route"] == "extractive"
            assert "3.3 V" in body["answer"] and body["sources"][0]["id"] == "vibration-sensor-manual#battery"
        assert "503" in answers[0]["route_reason"] or "unhealthy" in answers[0]["route_reason"]
        assert "breaker open" in answers[-1]["route_reason"] or "unhealthy" in answers[-1]["route_reason"]
        # Streaming falls back the same way: one final chunk with the extractive answer.
        chunks = await sse(await client.post("/v2/models/ragpeer/generate_stream", json={"text_input": QUESTION}))
        assert len(chunks) == 1 and chunks[0]["final"] is True and chunks[0]["route"] == "extractive"
        # The health check (every 0.2 s) marks the peer down too, and each failed check counts against
        # the breaker: the answers may all come before it runs, or (on a busy machine) after its first
        # failure, when they no longer reach the peer; the second failed check opens it then.
        for _ in range(100):
            stats = (await (await client.get("/v2/models/ragpeer/stats")).json())["model_stats"][0]
            if stats["peer"]["healthy"] is False and stats["peer"]["breaker"]["state"] == "open":
                break
            await asyncio.sleep(0.05)
        assert stats["peer"]["breaker"]["state"] == "open" and stats["peer"]["healthy"] is False
        assert stats["routes"]["extractive"] >= 4 and stats["fallbacks"]["peer"] >= 4
    finally:
        peer.down = False
    # A passing health check lets the open breaker go half-open: the next request is the trial.
    for _ in range(100):
        stats = (await (await client.get("/v2/models/ragpeer/stats")).json())["model_stats"][0]
        if stats["peer"]["healthy"]:
            break
        await asyncio.sleep(0.05)
    body = await (await client.post("/v2/models/ragpeer/generate", json={"text_input": QUESTION})).json()
    assert body["route"] == "peer" and body["answer"] == "".join(PIECES)
