"""A prefill run's own memory (its intermediates beyond the KV cache and the logits): measured
at a generator's load on the real tiny decoder in both layouts (in place, the CPU arena holds
it), and reserved while prompts are prefilled (rag/prefill_memory.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from edge_batcher.config import load_model_config
from edge_batcher.memory.heap import malloc_trim
from edge_batcher.rag import decoder as decoder_module
from edge_batcher.rag.decoder import Decoder
from edge_batcher.rag.prefill_memory import measurable_context, measure_prefill, prefill_scratch
from tests.rag.test_kv_in_place import shared_repo  # noqa: F401  (the in-place tinylm, built once)
from tests.rag.test_rag_generation import NO_STOP, PROMPTS, start_service

MiB = 1 << 20


def _decoder(repo, max_context: int = 1024) -> Decoder:
    decoder = Decoder(load_model_config(repo / "tinylm"), max_context=max_context)
    decoder.load()
    return decoder


def test_a_prompt_as_long_as_the_context_is_measured_in_chunks_twice(tiny_repo):
    """Optimum's layout runs without the CPU arena: a run's intermediates come from the heap and
    go back to it; what a run held beyond its caches and logits is a few MiB for tinylm."""
    decoder = _decoder(tiny_repo)
    try:
        measured = measure_prefill(decoder, 128, 1024, malloc_trim())
        assert (measured.tokens, measured.context) == (128, 1024)
        # attention over 1024 positions for 128 queries alone is 4 heads x 128 x 1024 x 4 B = 2 MiB a layer
        assert measured.scratch >= 1 * MiB, measured.describe()
        assert measured.scratch < 256 * MiB, measured.describe()  # a tiny model: not the heap's whole history
    finally:
        decoder.close()


def test_in_place_a_run_s_intermediates_stay_in_the_arena(shared_repo):  # noqa: F811
    """The in-place layout keeps the CPU arena: what a run needs, the arena took at the first
    prompt and holds (counted in the load), so little is left to reserve."""
    decoder = _decoder(shared_repo)
    try:
        measured = measure_prefill(decoder, 128, 1024, malloc_trim())
        assert measured.scratch < 1 * MiB, measured.describe()
    finally:
        decoder.close()


def test_the_measured_prompt_shrinks_to_what_the_budget_has(tiny_repo):
    decoder = _decoder(tiny_repo)
    try:
        per_token = decoder.kv.bytes_per_token  # 512 bytes for tinylm
        assert measurable_context(decoder, 1 << 40) == 1024
        # its cache and the run's new one (Optimum's layout: two) within half the budget
        assert measurable_context(decoder, 2 * 2 * per_token * 500) == 500
        assert measurable_context(decoder, 0) == 0
        assert prefill_scratch(decoder, 0, 1 << 40, "tinylm") == 0  # whole prompts: not measured
    finally:
        decoder.close()


async def test_a_prefill_run_s_memory_is_reserved_while_prompts_are_prefilled(tiny_repo, monkeypatch, caplog):
    """Every prefill run finds the measured figure reserved on top of its cache and logits;
    decode steps with no prompt being filled do not hold it, and all of it is back at the end."""
    seen: list[tuple[int, int, int]] = []  # (reserved by the loop, the prompt's cache, scratch) at each prefill
    extend = decoder_module.Decoder.extend
    loops = []

    def extending(decoder, cache, tokens, room=0, all_logits=False):
        loop = loops[0]
        seen.append((loop._held, cache.nbytes if cache is not None else 0, loop.prefill_scratch))
        return extend(decoder, cache, tokens, room=room, all_logits=all_logits)

    caplog.set_level(logging.INFO, logger="edge_batcher.rag.prefill_memory")
    service = await start_service(tiny_repo / "tinylm", prefill_memory_mb=-1)
    try:
        loops.append(service._loop)
        scratch = service.prefill_scratch
        assert scratch > 0 and scratch == service._loop.prefill_scratch
        assert service.statistics()["kv"]["prefill_run_bytes"] == scratch  # what an operator sees
        assert "a prefill run of 128 tokens (a 1024-token prompt) held" in caplog.text
        # What the measure gives depends on the heap (0.3-3 MiB seen), about one prompt's cache
        # and logits here; a figure far above those makes a step that still holds it unmistakable.
        scratch = service._loop.prefill_scratch = 16 * MiB
        monkeypatch.setattr(decoder_module.Decoder, "extend", extending)
        steps_held = []
        step = decoder_module.Decoder.step

        def stepping(decoder, cache, tokens):
            steps_held.append((service._loop._held, cache.nbytes))
            return step(decoder, cache, tokens)

        monkeypatch.setattr(decoder_module.Decoder, "step", stepping)
        results = await asyncio.gather(*(service.generate(p * 30, {"max_new_tokens": 30 + i, **NO_STOP})
                                         for i, p in enumerate(PROMPTS)))
        assert all(len(r.token_ids) == 30 + i for i, r in enumerate(results))
        assert len(seen) >= len(PROMPTS) * 2  # prompts of 2+ chunks each
        for held, cache, measured in seen:
            assert held >= measured + cache, (held, measured, cache)
        # once every prompt is in, the steps run with the caches and logits reserved, not the prefill's
        assert steps_held[-1][0] < scratch, steps_held[-1]
        assert service.runtime.budget.reserved == 0
    finally:
        await service.close()


async def test_a_sequence_whose_prefill_could_never_fit_is_refused_naming_it(tiny_repo):
    service = await start_service(tiny_repo / "tinylm", budget_bytes=64 * MiB, prefill_memory_mb=-1)
    try:
        service._capacity_at_load = 0
        budget = service.runtime.budget
        budget.fixed_bytes = budget.resident + service.prefill_scratch // 2
        from edge_batcher.errors import DoesNotFit

        with pytest.raises(DoesNotFit, match="prefill run's own .* MiB measured at load"):
            await service.generate(PROMPTS[0], {"max_new_tokens": 4, **NO_STOP})
    finally:
        await service.close()


async def test_a_set_prefill_memory_is_reserved_as_set_and_not_measured(tiny_repo, caplog):
    caplog.set_level(logging.INFO, logger="edge_batcher.rag.prefill_memory")
    service = await start_service(tiny_repo / "tinylm", prefill_memory_mb=5)
    try:
        assert service.prefill_scratch == 5 * MiB == service._loop.prefill_scratch
        assert "a prefill run of" not in caplog.text
        assert service._loop.run_bytes(1, 200) - service._loop.run_bytes(1, 0) == 5 * MiB
    finally:
        await service.close()


async def test_a_negative_prefill_memory_other_than_minus_one_is_refused(tiny_repo):
    from edge_batcher.errors import ConfigError

    with pytest.raises(ConfigError, match=r"prefill_memory_mb: expected -1 \(measured at load\) or MiB >= 0"):
        await start_service(tiny_repo / "tinylm", prefill_memory_mb=-2)


async def test_a_context_longer_than_the_model_s_positions_fails_the_load_saying_how_to_skip(tiny_repo):
    """tinylm has 1024 positions: a prompt of 2048 fails its run, now at load rather than when a
    long prompt first comes."""
    from edge_batcher.config import DaemonConfig, MemorySettings
    from edge_batcher.errors import EngineError
    from edge_batcher.rag.generate import GenerationService
    from edge_batcher.runtime import Runtime

    config = load_model_config(tiny_repo / "tinylm")
    config.generator = {**config.generator, "max_context": 2048}
    service = GenerationService(config, Runtime(DaemonConfig(memory=MemorySettings(probe="fixed", budget_mb=256))))
    with pytest.raises(EngineError, match=r"prefilling a prompt of up to max_context 2048 .*prefill_memory_mb = N"):
        await service.start()
    assert service.decoder.engine.session is None  # the session is not kept


@pytest.mark.parametrize("probe", ["cuda", "jetson"])
def test_a_decoder_on_a_gpu_reserves_no_prefill_memory_unless_memory_is_unified(probe, tiny_repo, monkeypatch):
    """On a discrete GPU the runs' intermediates stay in the device's arena, which the load's
    measurement counts: nothing per run. On a Jetson the host's peak is the device's memory too.
    (No GPU here: the decoder runs on the CPU, reported as on the device.)"""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from edge_batcher.rag import generate

    service = generate.GenerationService.__new__(generate.GenerationService)
    service.name, service.decoder = "tinylm", _decoder(tiny_repo)
    service.settings = generate.GeneratorSettings(max_context=1024)
    service.runtime = SimpleNamespace(budget=SimpleNamespace(probe=SimpleNamespace(name=probe),
                                                             reservation=lambda nbytes: nullcontext()))
    monkeypatch.setattr(generate, "runs_on_device", lambda engine: True)
    try:
        scratch = service._measure_prefill(1 << 40)
        assert (scratch == 0) if probe == "cuda" else (scratch >= 1 * MiB)
    finally:
        service.decoder.close()


async def test_the_measuring_prompt_s_caches_are_reserved_while_it_runs(tiny_repo, monkeypatch):
    """A reload measures beside models that serve: the memory the measuring prompt's caches and
    logits take is reserved in the budget meanwhile, and given back after."""
    from edge_batcher.config import DaemonConfig, MemorySettings
    from edge_batcher.rag import prefill_memory
    from edge_batcher.rag.generate import GenerationService
    from edge_batcher.runtime import Runtime

    runtime = Runtime(DaemonConfig(memory=MemorySettings(probe="fixed", budget_mb=256)))
    reserved = []
    measure = prefill_memory.measure_prefill

    def measuring(decoder, tokens, context, settle=None):
        reserved.append((runtime.budget.reserved, prefill_memory.measuring_bytes(decoder, tokens, context)))
        return measure(decoder, tokens, context, settle)

    monkeypatch.setattr(prefill_memory, "measure_prefill", measuring)
    service = GenerationService(load_model_config(tiny_repo / "tinylm"), runtime)
    await service.start()
    try:
        [(held, caches)] = reserved
        # Optimum's layout: the prompt's cache and the run's new one, 1024 tokens x 512 bytes each
        assert held == caches >= 2 * 1024 * 512
        assert runtime.budget.reserved == 0
    finally:
        await service.close()
