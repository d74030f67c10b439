"""Generation on a Triton-style peer (`[rag.peer] kind = "triton"`): the rag model streams its
answer from Triton's generate extension, played by a second edge-batcher runtime serving the
tiny decoder on its own /v2/models/tinylm/generate_stream over a real socket."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from edge_batcher.config import DaemonConfig, MemorySettings, ModelsSettings
from edge_batcher.errors import ConfigError
from edge_batcher.rag.peer import ChatPeer, ChatPeerSettings
from edge_batcher.runtime import Runtime
from edge_batcher.transports.http import create_app
from edge_batcher.transports.http_generate import add_generate_routes
from tests.rag.conftest import RAG_TOML
from tests.rag.test_rag_peer import QUESTION, sse

TRITON_PEER_TOML = RAG_TOML.format(index="{index}", generator="") + """\
[rag.peer]
kind = "triton"
url = "{url}"
model = "{model}"
health_interval_s = 0.2
breaker_failures = 2
breaker_reset_s = 60
first_token_timeout_s = 5
[rag.peer.parameter_names]
max_new_tokens = "max_new_tokens"
temperature = "temperature"
top_p = "top_p"
seed = "seed"
"""


def daemon(repo) -> Runtime:
    return Runtime(DaemonConfig(models=ModelsSettings(repository=str(repo), warmup=False),
                                memory=MemorySettings(probe="fixed", budget_mb=1024)))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def setup(rag_repo, tiny_repo, tmp_path_factory):
    # The peer: another daemon with the tiny decoder, recording what it was sent.
    peer_runtime = daemon(tiny_repo)
    await peer_runtime.start()
    sent: list[dict] = []

    @web.middleware
    async def record(request, handler):
        if request.method == "POST":
            sent.append({"path": request.path, **json.loads(await request.read())})
        return await handler(request)

    peer_app = create_app(peer_runtime, max_body_bytes=1 << 20)
    add_generate_routes(peer_app)
    peer_app.middlewares.append(record)
    peer_server = TestServer(peer_app)
    await peer_server.start_server()
    url = str(peer_server.make_url("")).rstrip("/")

    repo = tmp_path_factory.mktemp("triton_peer_repo")
    (repo / "minilm").symlink_to(rag_repo / "minilm")
    for name, model in (("ragtriton", "tinylm"), ("ragtritonwrong", "no-such-model")):
        (repo / name).mkdir()
        (repo / name / "model.toml").write_text(TRITON_PEER_TOML.format(index=rag_repo / "index", url=url, model=model))
    runtime = daemon(repo)
    await runtime.start()
    app = create_app(runtime, max_body_bytes=1 << 20)
    add_generate_routes(app)
    async with TestClient(TestServer(app)) as client, TestClient(peer_server) as peer_client:
        yield client, peer_client, sent
    await runtime.close()
    await peer_runtime.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_the_triton_peer_generates_what_its_model_generates_for_the_prompt(setup):
    client, peer_client, sent = setup
    r = await client.post("/v2/models/ragtriton/generate", json={"text_input": QUESTION, "max_new_tokens": 12,
                                                                 "ignore_stop": True})
    body = await r.json()
    assert r.status == 200, body
    assert body["mode"] == "generated" and body["route"] == "peer" and "route_reason" not in body
    request = sent[-1]
    assert request["path"] == "/v2/models/tinylm/generate_stream" and request["stream"] is True
    assert request["max_new_tokens"] == 12 and QUESTION in request["text_input"]
    assert "3.3 V" in request["text_input"]  # the battery passage went into the prompt
    # The peer's own model, asked directly with the same prompt (greedy), says the same.
    direct = await (await peer_client.post("/v2/models/tinylm/generate", json={
        "text_input": request["text_input"], "max_new_tokens": 12, "ignore_stop": True})).json()
    assert body["answer"] == direct["text_output"] and body["answer"]
    assert body["completion_tokens"] == 12 and body["prompt_tokens"] == direct["prompt_tokens"] > 100
    assert body["finish_reason"] == "length"
    assert body["sources"][0]["id"] == "vibration-sensor-manual#battery"
    stats = (await (await client.get("/v2/models/ragtriton/stats")).json())["model_stats"][0]
    assert stats["peer"]["kind"] == "triton" and stats["peer"]["healthy"] is True
    assert stats["routes"]["peer"] >= 1


@pytest.mark.asyncio(loop_scope="module")
async def test_the_triton_peer_streams_token_by_token(setup):
    client, _, _ = setup
    payload = {"text_input": QUESTION, "parameters": {"max_new_tokens": 6, "ignore_stop": True}}
    whole = await (await client.post("/v2/models/ragtriton/generate", json=payload)).json()
    chunks = await sse(await client.post("/v2/models/ragtriton/generate_stream", json=payload))
    assert chunks[0]["route"] == "peer" and chunks[0]["sources"][0]["id"] == "vibration-sensor-manual#battery"
    pieces = [c["text_output"] for c in chunks[1:-1]]
    assert len(pieces) >= 2 and "".join(pieces) == whole["answer"]
    assert chunks[-1]["final"] is True and chunks[-1]["finish_reason"] == "length"


@pytest.mark.asyncio(loop_scope="module")
async def test_a_triton_peer_without_the_model_falls_back_to_an_extractive_answer(setup):
    client, _, _ = setup
    for _ in range(2):
        r = await client.post("/v2/models/ragtritonwrong/generate", json={"text_input": QUESTION})
        body = await r.json()
        assert r.status == 200, body
        assert body["route"] == "extractive" and "3.3 V" in body["answer"]
        assert "no-such-model" in body["route_reason"] or "unhealthy" in body["route_reason"] \
            or "breaker" in body["route_reason"]
    stats = (await (await client.get("/v2/models/ragtritonwrong/stats")).json())["model_stats"][0]
    assert stats["peer"]["healthy"] is False and "404" in stats["peer"]["last_error"]
    assert stats["fallbacks"]["peer"] == 2


def test_the_peer_kind_and_parameter_names_are_checked_and_the_health_path_follows_the_kind():
    with pytest.raises(ConfigError, match=r"\[rag.peer\] kind: expected one of openai, triton, got 'grpc'"):
        ChatPeer(ChatPeerSettings(url="http://h:1", model="m", kind="grpc"), "[rag.peer]")
    with pytest.raises(ConfigError, match="parameter_names: unknown max_tokens"):
        ChatPeer(ChatPeerSettings(url="http://h:1", model="m", kind="triton",
                                  parameter_names={"max_tokens": "x"}), "[rag.peer]")
    assert ChatPeer(ChatPeerSettings(url="http://h:1", model="llm", kind="triton"), "w").health_path == \
        "/v2/models/llm/ready"
    assert ChatPeer(ChatPeerSettings(url="http://h:1", model="llm"), "w").health_path == "/v1/models"
    no_health = ChatPeerSettings(url="http://h:1", model="llm", kind="triton", health_path="")
    assert ChatPeer(no_health, "w").health_path == ""
