"""The route decision checks the deadline: a local generation estimated (from the generator's
measured prefill and decode-step times) to take longer than the request has left goes to the
peer, or is answered extractively, and route_reason says why.

The generator is a slower random-weight decoder than tinylm (tools/build_tiny_decoder.py at
hidden 512, 4 layers: a few ms per decode step here), so that 256 new tokens take long enough
that a deadline below the estimate still leaves retrieval plenty of time. The peer is the real
aiohttp chat-completions app of test_rag_peer.py."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from edge_batcher.config import DaemonConfig, MemorySettings, ModelsSettings
from edge_batcher.rag.deadline import EXTRACTIVE_RESERVE_S, LocalEstimate, estimate, start_within, too_slow
from edge_batcher.runtime import Runtime
from edge_batcher.transports.http import create_app
from edge_batcher.transports.http_generate import add_generate_routes
from tests.rag.conftest import RAG_TOML, _tool
from tests.rag.test_rag_peer import PEER_TOML, PIECES, QUESTION, TOKEN, ChatPeerApp, sse

LONG = 256  # new tokens asked for: the estimate grows with them

@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def setup(rag_repo, tmp_path_factory):
    peer = ChatPeerApp()
    server = TestServer(peer.app)
    await server.start_server()
    repo = tmp_path_factory.mktemp("deadline_repo")
    (repo / "minilm").symlink_to(rag_repo / "minilm")
    _tool("build_tiny_decoder").build(repo, "slowlm", quiet=True, hidden=512, layers=4, heads=8, kv_heads=4,
                                      ffn=2048)
    shutil.copytree(repo / "slowlm", repo / "slowlm2")  # a twin running one sequence at a time
    toml = repo / "slowlm2" / "model.toml"
    toml.write_text(toml.read_text().replace("max_running = 8", "max_running = 1"))
    url = str(server.make_url("")).rstrip("/")
    (repo / "ragslow").mkdir()
    (repo / "ragslow" / "model.toml").write_text(RAG_TOML.format(index=rag_repo / "index", generator="slowlm"))
    (repo / "ragslowpeer").mkdir()
    (repo / "ragslowpeer" / "model.toml").write_text(
        PEER_TOML.format(index=rag_repo / "index", generator="slowlm", url=url, token=TOKEN))
    runtime = Runtime(DaemonConfig(models=ModelsSettings(repository=str(repo), warmup=False),
                                   memory=MemorySettings(probe="fixed", budget_mb=1024)))
    await runtime.start()
    app = create_app(runtime, max_body_bytes=1 << 20)
    add_generate_routes(app)
    async with TestClient(TestServer(app)) as client:
        yield client, runtime
    await runtime.close()
    await server.close()


async def generate(client, model: str, max_new_tokens: int, timeout_ms: float | None) -> dict:
    timeout = {"timeout_ms": timeout_ms} if timeout_ms is not None else {}
    r = await client.post(f"/v2/models/{model}/generate", json={"text_input": QUESTION, "parameters": {
        "max_new_tokens": max_new_tokens, "ignore_stop": True, **timeout}})
    body = await r.json()
    assert r.status == 200, body
    return body


def test_the_estimate_is_the_prompt_s_prefill_and_a_step_per_new_token():
    local = estimate((0.0005, 0.005), 200, prompt_tokens=200)  # 0.5 ms a prompt token, 5 ms a step
    assert local == LocalEstimate(0.1, 0.005, 200) and local.seconds == pytest.approx(1.1)
    assert too_slow("g", local, 2.0) is None
    reason = too_slow("g", local, 0.5)
    assert "~1.10 s" in reason and "200 steps x 5.00 ms" in reason and "0.50 s left" in reason
    assert estimate(None, 200) is None and too_slow("g", None, 0.0) is None  # nothing measured: no veto


def test_a_local_sequence_may_wait_to_start_what_its_generation_and_the_reserve_leave():
    local = LocalEstimate(prefill_s=0.5, step_s=0.01, max_new_tokens=100)
    assert start_within(10.0, local) == pytest.approx(10.0 - 1.5 - EXTRACTIVE_RESERVE_S)
    assert start_within(10.0, None) == pytest.approx(10.0 - EXTRACTIVE_RESERVE_S)
    assert start_within(0.04, None) == pytest.approx(0.02)  # half of what is left at most
    assert start_within(1.0, local) == 1e-3  # not a moment to wait: it starts now or not at all


def test_a_prompt_prefilled_in_chunks_waits_a_step_of_the_running_batch_between_them():
    alone = estimate((0.0005, 0.005), 200, prompt_tokens=300, chunk_tokens=128)
    assert alone.waits == 0 and alone.seconds == pytest.approx(0.15 + 1.0)  # nothing runs: chunks back to back
    beside = estimate((0.0005, 0.005), 200, prompt_tokens=300, chunk_tokens=128, running=3)
    assert beside.waits == 2 and beside.seconds == pytest.approx(0.15 + 1.0 + 0.01)
    assert "2 steps of the running batch between its chunks" in beside.describe()
    assert estimate((0.0005, 0.005), 200, prompt_tokens=300, chunk_tokens=0, running=3).waits == 0  # whole


@pytest.mark.asyncio(loop_scope="module")
async def test_a_generation_that_would_miss_the_deadline_goes_to_the_peer_else_extractive(setup):
    client, runtime = setup
    gen = runtime.runners["slowlm"]
    assert gen.step_times() is None
    # Nothing measured yet: the deadline cannot veto, and this first request measures.
    first = await generate(client, "ragslowpeer", 8, 60_000)
    assert first["route"] == "local" and "route_reason" not in first
    local = gen.estimate(0, LONG)  # a lower bound: without the prompt's prefill
    assert local is not None and local.seconds > 0.2, local
    roomy = await generate(client, "ragslowpeer", LONG, 60_000 + local.seconds * 4000)
    assert roomy["route"] == "local" and roomy["completion_tokens"] == LONG

    local = gen.estimate(0, LONG)  # now from 264 steps
    tight_ms = local.seconds * 600  # 60% of the estimate: retrieval still has long enough
    offloaded = await generate(client, "ragslowpeer", LONG, tight_ms)
    assert offloaded["route"] == "peer" and offloaded["answer"] == "".join(PIECES)
    assert "local generator 'slowlm': generation would take ~" in offloaded["route_reason"]
    assert "s left" in offloaded["route_reason"]

    alone = await generate(client, "ragslow", LONG, tight_ms)  # no peer: extractive, in time
    assert alone["route"] == "extractive" and alone["mode"] == "extractive"
    assert "generation would take" in alone["route_reason"] and "3.3 V" in alone["answer"]
    stats = (await (await client.get("/v2/models/ragslow/stats")).json())["model_stats"][0]
    assert stats["routes"]["extractive"] == 1 and stats["fallbacks"] == {"deadline": 1}
    # A short answer fits the same deadline: local again.
    short = await generate(client, "ragslow", 4, tight_ms)
    assert short["route"] == "local" and short["completion_tokens"] == 4


@pytest.mark.asyncio(loop_scope="module")
async def test_a_rag_request_waits_for_the_generator_only_until_its_own_deadline(setup):
    """A rag request without a timeout has its model's default_timeout_ms (here 60% of what a
    long generation takes) from its arrival; the sequence it submits waits for admission only as
    long as that leaves, less the time kept back for an extractive answer, which it then gets
    (streamed too: one chunk). Before, the generator was given the request's own timeout, None
    here, so its default (30 s; SmolLM2's 60 s, where a soak's rag questions outlived a 60 s
    client timeout with the rag model's default at 30 s); then a 504 at the deadline. The twin
    generator runs one sequence at a time: a long generation holds it."""
    client, runtime = setup
    started = time.monotonic()  # how long LONG new tokens take here
    await generate(client, "slowlm", LONG, 60_000)
    took = time.monotonic() - started
    repo = Path(runtime.config.models.repository)
    (repo / "ragshort").mkdir()
    (repo / "ragshort" / "model.toml").write_text(
        (repo / "ragslow" / "model.toml").read_text().replace('generator = "slowlm"', 'generator = "slowlm2"')
        .replace("top_k = 3", "top_k = 1")  # a short prompt: the route's estimate well within the deadline
        .replace("default_timeout_ms = 30000", f"default_timeout_ms = {took * 1000 * 0.6:.0f}"))
    assert await runtime.load_model("ragshort") == "loaded"

    async def hold():
        holder = asyncio.create_task(client.post("/v2/models/slowlm2/generate", json={
            "text_input": QUESTION, "parameters": {"max_new_tokens": LONG, "ignore_stop": True}}))
        while not runtime.runners["slowlm2"].statistics()["running"] and not holder.done():
            await asyncio.sleep(0.005)
        return holder

    holder = await hold()
    started = time.monotonic()
    body = await generate(client, "ragshort", 1, None)
    waited = time.monotonic() - started
    assert not holder.done()  # the long generation still holds the generator's one place
    # (The route's estimate, a prefill and a step, left it local: it does not count a wait for
    # admission.)
    assert body["route"] == "extractive" and body["mode"] == "extractive" and "3.3 V" in body["answer"], body
    assert "local generator 'slowlm2': model 'slowlm2': waited" in body["route_reason"]
    assert "to start (a place among its 1 running sequences" in body["route_reason"]
    assert waited < took * 0.9
    assert (await holder).status == 200
    holder = await hold()
    chunks = await sse(await client.post("/v2/models/ragshort/generate_stream", json={
        "text_input": QUESTION, "parameters": {"max_new_tokens": 1}}))
    assert not holder.done() and len(chunks) == 1, chunks
    assert chunks[0]["route"] == "extractive" and "3.3 V" in chunks[0]["answer"] and chunks[0]["sources"]
    assert (await holder).status == 200
    assert runtime.runners["ragshort"].statistics()["fallbacks"] == {"deadline": 2}


@pytest.mark.asyncio(loop_scope="module")
async def test_a_longer_answer_s_estimated_generation_comes_off_its_wait(setup, monkeypatch):
    """Started any later than its deadline less its estimated generation, a sequence would end
    after the deadline (a soak saw rag requests admitted just before theirs, then generating for
    30 s more, past their clients' timeout): that is as long as it may wait to start."""
    client, runtime = setup
    gen = runtime.runners["slowlm"]
    waits = []
    submit = type(gen).submit

    async def submitting(self, prompt, parameters=None, **kwargs):
        waits.append(kwargs["timeout_s"])
        return await submit(self, prompt, parameters, **kwargs)

    await generate(client, "slowlm", 16, 60_000)  # measured: an estimate
    local = gen.estimate(0, LONG // 2)  # without the prompt's prefill, which the rag request's adds
    assert local is not None
    monkeypatch.setattr(type(gen), "submit", submitting)
    body = await generate(client, "ragslow", LONG // 2, 5_000)
    assert body["route"] == "local", body
    # less what retrieval took and the prompt's prefill, which the rag request's estimate adds
    assert 5.0 - 3.0 - local.seconds < waits[0] < 5.0 - EXTRACTIVE_RESERVE_S - local.seconds, (waits, local)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_sequence_waiting_for_a_running_place_fails_at_its_deadline(setup):
    """A generation request waiting while every running place is taken gets its 504 when its
    timeout passes, not when a place frees (before: only the head of the line, and only once a
    place had freed, was checked against its deadline)."""
    client, runtime = setup
    await generate(client, "slowlm2", 16, 60_000)  # measured: the estimate below
    started = time.monotonic()
    holder = asyncio.create_task(client.post("/v2/models/slowlm2/generate", json={
        "text_input": QUESTION, "parameters": {"max_new_tokens": LONG, "ignore_stop": True}}))
    while not runtime.runners["slowlm2"].statistics()["running"] and not holder.done():
        await asyncio.sleep(0.005)
    local = runtime.runners["slowlm2"].estimate(0, LONG)
    assert local is not None
    r = await client.post("/v2/models/slowlm2/generate", json={"text_input": QUESTION, "parameters": {
        "max_new_tokens": 1, "timeout_ms": local.seconds * 300}})
    body = await r.json()
    assert not holder.done()
    assert r.status == 504 and "to start (a place among its 1 running sequences" in body["error"], body
    assert time.monotonic() - started < local.seconds * 0.9
    assert (await holder).status == 200


@pytest.mark.asyncio(loop_scope="module")
async def test_a_deadline_that_passes_while_the_prompt_is_built_is_a_504(setup, monkeypatch):
    """Passed once the prompt is built, the deadline is a 504 whether or not the generator has an
    estimate (before: with one, and no peer, the estimate's veto sent it to a late extractive
    answer, while without one it was a 504)."""
    client, runtime = setup
    await generate(client, "slowlm", 16, 60_000)  # measured: an estimate
    service = runtime.runners["ragslow"]
    build = type(service)._prompt

    def slow_prompt(self, *args):
        time.sleep(1.2)  # a loaded machine: the deadline (1 s) passes while the prompt is built
        return build(self, *args)

    monkeypatch.setattr(type(service), "_prompt", slow_prompt)
    r = await client.post("/v2/models/ragslow/generate", json={"text_input": QUESTION, "parameters": {
        "max_new_tokens": 4, "timeout_ms": 1000}})
    body = await r.json()
    assert r.status == 504 and "deadline passed before generation" in body["error"], body
