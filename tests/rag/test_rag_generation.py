"""Generation with the tiny random-weight decoder (tools/build_tiny_decoder.py): the KV cache,
continuous batching and KV admission, in process with a real Runtime and ONNX Runtime."""

from __future__ import annotations

import asyncio
import shutil
from contextlib import aclosing
from pathlib import Path

import numpy as np
import pytest

from edge_batcher.config import DaemonConfig, MemorySettings, load_model_config
from edge_batcher.errors import DoesNotFit, InvalidInput
from edge_batcher.rag.decoder import Decoder, join, keep
from edge_batcher.runtime import Runtime
from edge_batcher.types import InferRequest

MiB = 1 << 20
PROMPTS = ["How do I replace the battery?", "Bearing faults ring", "The MQTT topic for raw windows is",
           "Misalignment shows as"]
NO_STOP = {"ignore_stop": True}


async def start_service(model_dir, budget_bytes: int = 256 * MiB, prefill_memory_mb: float = 0.0):
    """The generator under a fixed budget. A prefill run's own memory is reserved as 0 by
    default (the tests' budgets are the KV arithmetic: tests/rag/test_prefill_memory.py
    measures it, with -1)."""
    from edge_batcher.rag.generate import GenerationService

    runtime = Runtime(DaemonConfig(memory=MemorySettings(probe="fixed", budget_mb=budget_bytes / MiB)))
    config = load_model_config(model_dir)
    config.generator = {**config.generator, "prefill_memory_mb": prefill_memory_mb}
    service = GenerationService(config, runtime)
    await service.start()
    return service


@pytest.fixture
async def generator(tiny_repo):
    service = await start_service(tiny_repo / "tinylm")
    yield service
    await service.close()


@pytest.fixture(scope="module")
def decoder(tiny_repo):
    d = Decoder(load_model_config(tiny_repo / "tinylm"))
    d.load()
    yield d
    d.close()


def test_logits_with_the_kv_cache_equal_a_full_recompute(decoder):
    tokens = list(np.random.default_rng(0).integers(0, decoder.vocab, size=40))
    full, _ = decoder.prefill(tokens, all_logits=True)
    logits, cache = decoder.prefill(tokens[:7], all_logits=True)
    steps = [logits]
    for t in range(7, 40):
        step_logits, cache = decoder.step(cache, np.array([tokens[t]]))
        steps.append(step_logits)
    np.testing.assert_allclose(np.concatenate(steps), full, atol=1e-4)
    assert cache.width == 40 and cache.positions.tolist() == [40]
    assert decoder.kv.bytes_per_token == 2 * 2 * 2 * 16 * 4  # 2 x layers x kv_heads x head_dim x fp32


def test_left_padded_batch_rows_compute_what_they_compute_alone(decoder):
    a, b = [5, 9, 13, 2, 77, 31, 8, 100, 42], [300, 4, 18]
    logits_a, cache_a = decoder.prefill(a)
    logits_b, cache_b = decoder.prefill(b)
    batch = join(cache_a, cache_b)
    assert batch.width == 9 and batch.mask[1].tolist() == [0] * 6 + [1] * 3
    next_a, next_b = 11, 12
    both, batch = decoder.step(batch, np.array([next_a, next_b]))
    alone_a, _ = decoder.step(cache_a, np.array([next_a]))
    alone_b, cache_b = decoder.step(cache_b, np.array([next_b]))
    np.testing.assert_allclose(both[0], alone_a[0], atol=1e-4)
    np.testing.assert_allclose(both[1], alone_b[0], atol=1e-4)
    # a leaves: the columns that were padding for b only are trimmed away
    only_b = keep(batch, [1])
    assert only_b.width == 4 and only_b.mask.all()
    again, _ = decoder.step(only_b, np.array([7]))
    np.testing.assert_allclose(again[0], decoder.step(cache_b, np.array([7]))[0][0], atol=1e-4)


async def test_sequences_arriving_mid_generation_join_the_batch_and_match_generating_alone(generator):
    first = await generator.submit(PROMPTS[0], {"max_new_tokens": 250, **NO_STOP})
    events = generator.events(first)
    kind, _ = await events.__anext__()  # the first sequence is decoding now
    assert kind == "token" and generator.statistics()["running"] == 1

    async def rest():
        async for kind, payload in events:
            if kind == "done":
                return payload

    others = [generator.generate(p, {"max_new_tokens": 40, **NO_STOP}) for p in PROMPTS[1:]]
    together = await asyncio.gather(rest(), *others)
    stats = generator.statistics()
    assert stats["joined_mid_generation"] >= 1, stats
    assert stats["max_running_seen"] >= 2
    assert max(b["batch_size"] for b in stats["batch_stats"]) >= 2
    assert stats["running"] == 0 and stats["kv"]["reserved_bytes"] == 0

    for prompt, result in zip(PROMPTS, together):
        max_new = 250 if prompt == PROMPTS[0] else 40
        alone = await generator.generate(prompt, {"max_new_tokens": max_new, **NO_STOP})
        assert result.token_ids == alone.token_ids, prompt
        assert result.text == alone.text and result.finish_reason == "length"
        assert len(result.token_ids) == max_new
    assert generator.runtime.budget.reserved == 0


async def test_sampling_with_a_seed_is_reproducible_whatever_the_batch(generator):
    params = {"max_new_tokens": 30, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 7, **NO_STOP}
    alone = await generator.generate(PROMPTS[1], params)
    batched = await asyncio.gather(generator.generate(PROMPTS[1], params),
                                   *(generator.generate(p, {"max_new_tokens": 30, **NO_STOP}) for p in PROMPTS))
    assert batched[0].token_ids == alone.token_ids
    greedy = await generator.generate(PROMPTS[1], {"max_new_tokens": 30, **NO_STOP})
    assert greedy.token_ids != alone.token_ids  # sampling did sample
    other_seed = await generator.generate(PROMPTS[1], {**params, "seed": 8})
    assert other_seed.token_ids != alone.token_ids


async def test_stop_tokens_end_a_sequence(tiny_repo, tmp_path, generator):
    from tokenizers import Tokenizer

    greedy = (await generator.generate(PROMPTS[0], {"max_new_tokens": 20, **NO_STOP})).token_ids
    k = next(i for i in range(3, 20) if greedy[i] not in greedy[:i])
    stop = Tokenizer.from_file(str(tiny_repo / "tinylm" / "tokenizer.json")).id_to_token(greedy[k])
    model = tmp_path / "tinylm"
    shutil.copytree(tiny_repo / "tinylm", model)
    toml = (model / "model.toml").read_text().replace('stop_tokens = ["<|endoftext|>"]', f"stop_tokens = [{stop!r}]")
    (model / "model.toml").write_text(toml)
    service = await start_service(model)
    try:
        result = await service.generate(PROMPTS[0], {"max_new_tokens": 20})
        assert result.finish_reason == "stop" and result.token_ids == greedy[:k]
        assert result.text == service.tokenizer.decode(greedy[:k])
        assert (await service.generate(PROMPTS[0], {"max_new_tokens": 2})).finish_reason == "length"
    finally:
        await service.close()


async def test_kv_admission_holds_a_sequence_back_until_memory_frees(tiny_repo):
    model = tiny_repo / "tinylm"
    probe = await start_service(model)
    tokens = probe.count_tokens(PROMPTS[0]) + 120
    footprint = probe.decoder.footprint()  # Optimum's layout: rows x the longest row, twice during a step
    await probe.close()
    need, both = footprint.batch_bytes([tokens]), footprint.batch_bytes([tokens, tokens])
    weights = (model / "model.onnx").stat().st_size
    service = await start_service(model, budget_bytes=weights + (need + both) // 2)  # room for one, not two
    try:
        budget = service.runtime.budget
        assert need <= budget.available() < both
        first = asyncio.ensure_future(service.generate(PROMPTS[0], {"max_new_tokens": 120, **NO_STOP}))
        while service.statistics()["running"] == 0:
            await asyncio.sleep(0.001)
        second = asyncio.ensure_future(service.generate(PROMPTS[0], {"max_new_tokens": 120, **NO_STOP}))
        while service.statistics()["held_back_for_memory"] == 0 and not first.done():
            await asyncio.sleep(0.001)
        stats = service.statistics()
        assert stats["held_back_for_memory"] == 1 and stats["waiting"] == 1, stats

        # One that could never fit is refused at once, with the arithmetic.
        with pytest.raises(DoesNotFit, match="KV cache") as info:
            await service.submit(PROMPTS[0], {"max_new_tokens": 256})
        assert "512 bytes per token" in str(info.value)

        a, b = await asyncio.gather(first, second)
        stats = service.statistics()
        assert stats["admitted"] == 2 and stats["max_running_seen"] == 1  # never both at once
        assert stats["rejected_does_not_fit"] == 1
        assert b.queue_s > 0 and a.token_ids == b.token_ids  # held back, then generated exactly as alone
        assert budget.reserved == 0
    finally:
        await service.close()


async def test_bad_inputs_get_clear_errors(generator):
    def request(value, **kw):
        return InferRequest("tinylm", {"text_input": value}, **kw)

    cases = [
        (request(np.array([b"   "], dtype=object)), "is empty"),
        (request(np.array([1.0], dtype=np.float32)), "datatype FP32, model 'tinylm' expects BYTES"),
        (request(np.array([[b"a", b"b"]], dtype=object)), "shape [1, 2]"),
        (InferRequest("tinylm", {"prompt": np.array([b"x"], dtype=object)}), "has no input 'prompt'"),
        (request(np.array([("word " * 1200).encode()], dtype=object)), "more than the context of 1024 tokens"),
        (request(np.array([b"hello"], dtype=object), parameters={"temperature": -1}), "parameters.temperature"),
        (request(np.array([b"hello"], dtype=object), parameters={"max_new_tokens": 10_000}),
         "parameters.max_new_tokens"),
    ]
    for req, message in cases:
        with pytest.raises(InvalidInput) as info:
            await generator.infer(req)
        assert message in str(info.value)
    ok = await generator.infer(
        request(np.array([b"hello", b"battery"], dtype=object), parameters={"max_new_tokens": 3}))
    assert ok.outputs["text_output"].shape == (2,)
    assert generator.statistics()["failures_by_status"] == {"400": len(cases)}


async def test_a_stream_closed_early_cancels_its_sequence_and_frees_memory(generator):
    request = InferRequest("tinylm", {"text_input": np.array([PROMPTS[0].encode()], dtype=object)},
                           parameters={"max_new_tokens": 250, **NO_STOP})
    chunks = []
    async with aclosing(generator.stream(request)) as stream:
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                break
    assert all(c.parameters["triton_final_response"] is False for c in chunks)
    for _ in range(2000):
        stats = generator.statistics()
        if stats["running"] == 0:
            break
        await asyncio.sleep(0.001)
    assert stats["running"] == 0 and stats["cancelled"] == 1
    assert generator.runtime.budget.reserved == 0
    # A stream read to its end: pieces join to the whole text, the last chunk is final.
    request.parameters = {"max_new_tokens": 12, **NO_STOP}
    pieces = [c async for c in generator.stream(request)]
    assert pieces[-1].parameters["triton_final_response"] is True
    assert pieces[-1].parameters["finish_reason"] == "length" and pieces[-1].parameters["completion_tokens"] == 12
    text = "".join(c.outputs["text_output"][0].decode() for c in pieces)
    assert text == (await generator.generate(PROMPTS[0], {"max_new_tokens": 12, **NO_STOP})).text


def test_the_decoder_s_memory_is_measured_and_a_budget_too_small_refuses_it(tiny_repo):
    """With the cpu probe the decoder's load is measured in the process's memory (its engine's
    copy of the weights and its state, not the file's size), in a fresh interpreter so that the
    growth is the load's alone; a budget below what loading needs refuses it."""
    import os
    import subprocess
    import sys

    script = (
        "import asyncio, sys\n"
        "from edge_batcher.config import DaemonConfig, MemorySettings, load_model_config\n"
        "from edge_batcher.memory.device import ModelDoesNotFit\n"
        "from edge_batcher.rag.generate import GenerationService\n"
        "from edge_batcher.runtime import Runtime\n"
        "from pathlib import Path\n"
        "async def main():\n"
        "    runtime = Runtime(DaemonConfig(memory=MemorySettings(probe='cpu', headroom_mb=0, reserve_fraction=0.0)))\n"
        "    service = GenerationService(load_model_config(Path(sys.argv[1])), runtime)\n"
        "    await service.start()\n"
        "    print(service.resident_bytes, service.decoder.weights_bytes, runtime.budget.resident)\n"
        "    await service.close()\n"
        "    tight = Runtime(DaemonConfig(memory=MemorySettings(probe='cpu', budget_mb=0.01)))\n"
        "    try:\n"
        "        await GenerationService(load_model_config(Path(sys.argv[1])), tight).start()\n"
        "    except ModelDoesNotFit as exc:\n"
        "        print(exc)\n"
        "asyncio.run(main())\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", script, str(tiny_repo / "tinylm")], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0, proc.stderr
    figures, refusal = proc.stdout.splitlines()
    resident, weights, counted = (int(n) for n in figures.split())
    assert resident > 0 and resident != weights and counted == resident
    assert "model 'tinylm': loading it needs about" in refusal


async def test_a_generator_s_decoder_load_is_held_in_the_budget(tiny_repo, monkeypatch):
    """What loading the decoder needs is held in the budget while it loads (memory/device.py
    DeviceLoad.held), then given back: its measured figure is what stays."""
    from edge_batcher.memory.device import load_need
    from edge_batcher.rag import decoder as decoder_module
    from edge_batcher.rag.generate import GenerationService

    runtime = Runtime(DaemonConfig(memory=MemorySettings(probe="cpu")))
    config = load_model_config(tiny_repo / "tinylm")
    held_while_loading = []
    load = decoder_module.Decoder.load

    def loading(decoder):
        held_while_loading.append(runtime.budget.reserved)
        return load(decoder)

    monkeypatch.setattr(decoder_module.Decoder, "load", loading)
    service = GenerationService(config, runtime)
    await service.start()
    try:
        assert held_while_loading == [load_need(config, runtime.budget.probe, 1)[0]]
        assert runtime.budget.reserved == 0
    finally:
        await service.close()


async def test_a_moment_of_less_free_memory_holds_a_sequence_back_instead_of_refusing_it(tiny_repo):
    """The budget's capacity follows the probe, which dips whenever something else holds memory
    for a moment: a sequence that fits what the budget could give since the load waits for the
    memory (held back) instead of being refused as never fitting (a soak in a 200 MiB cgroup saw
    4 such refusals in 233 requests)."""
    service = await start_service(tiny_repo / "tinylm")
    try:
        budget = service.runtime.budget
        free = budget.probe.free_bytes
        budget.probe.free_bytes = 0  # for a moment: nothing free
        budget.refresh()
        assert budget.capacity() == 0
        generating = asyncio.ensure_future(service.generate(PROMPTS[0], {"max_new_tokens": 8, **NO_STOP}))
        while service.statistics()["held_back_for_memory"] == 0 and not generating.done():
            await asyncio.sleep(0.001)
        assert not generating.done(), generating.exception()  # refused as never fitting, before
        budget.probe.free_bytes = free  # the memory is back
        budget.refresh()
        result = await generating
        assert len(result.token_ids) == 8 and service.statistics()["rejected_does_not_fit"] == 0
    finally:
        await service.close()


async def test_a_generator_is_built_off_the_event_loop(tiny_repo, tmp_path, monkeypatch):
    """Building a generator service reads its tokenizer and sets up ONNX Runtime (0.2 s for
    SmolLM2 here): a load over the repository API must not hold the loop that serves the other
    models meanwhile, so the runtime builds it on a worker thread."""
    import threading

    from edge_batcher.config import ModelsSettings
    from edge_batcher.rag.generate import GenerationService

    shutil.copytree(tiny_repo / "tinylm", tmp_path / "tinylm")
    built_on = []
    build = GenerationService.__init__

    def recording(self, *args, **kwargs):
        built_on.append(threading.current_thread())
        build(self, *args, **kwargs)

    monkeypatch.setattr(GenerationService, "__init__", recording)
    runtime = Runtime(DaemonConfig(models=ModelsSettings(repository=str(tmp_path), warmup=False),
                                   memory=MemorySettings(probe="fixed", budget_mb=256)))
    await runtime.start()  # loads the repository's one model
    try:
        assert await runtime.load_model("tinylm") == "reloaded"
        assert len(built_on) == 2 and threading.current_thread() not in built_on, built_on
    finally:
        await runtime.close()
