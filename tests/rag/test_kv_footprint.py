"""What a batch's KV cache holds against what admission reserved for it (kv.CacheFootprint):
the arithmetic, the in-place cache kept within it, and the real tiny decoder in both layouts
through a mix of one long and several short sequences, where the per-sequence sum that
admission used before falls far below what the contiguous cache holds."""

from __future__ import annotations

import asyncio
import re
import weakref

import numpy as np
import pytest

from edge_batcher.rag.decode_loop import DecodeLoop
from edge_batcher.rag.kv import COLUMN_STEP, CacheFootprint, KvShape
from edge_batcher.rag.kv_slots import SlotCache
from tests.rag.test_kv_in_place import shared_repo  # noqa: F401  (the in-place tinylm, built once)
from tests.rag.test_rag_generation import NO_STOP, PROMPTS, start_service

MiB = 1 << 20
KV = KvShape(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)  # tinylm's: 512 bytes per token


def test_the_footprint_is_rows_times_the_longest_row_by_layout():
    in_place = CacheFootprint(KV, in_place=True, max_context=1024)
    optimum = CacheFootprint(KV, in_place=False, max_context=1024)
    per_token = KV.bytes_per_token
    # one row of 900 tokens and seven of 40: in place, 8 rows of 960 columns (whole steps of 64),
    # plus one of the 4 buffers while the cache is copied
    cache = 8 * 960 * per_token
    assert in_place.batch_bytes([900] + [40] * 7) == cache + cache // 4
    # Optimum's layout holds rows x the longest row, twice while a step runs
    assert optimum.batch_bytes([900] + [40] * 7) == 2 * 8 * 900 * per_token
    # against the per-sequence sum admission reserved before: 4.7x and 8.4x more
    assert in_place.batch_bytes([900] + [40] * 7) > 4.7 * (900 + 7 * 40) * per_token
    # a prompt prefilled beside the batch holds a one-row cache of its own
    assert in_place.batch_bytes([100], prompt_beside=70) == in_place.batch_bytes([100]) + 128 * per_token
    assert optimum.batch_bytes([100], prompt_beside=70) == optimum.batch_bytes([100]) + 2 * 70 * per_token
    # columns never past the context, nor below what a row holds
    assert in_place.columns(1000) == 1024 and in_place.columns(1024) == 1024
    assert CacheFootprint(KV, True, 1000).columns(1000) == 1000
    assert in_place.sequence_bytes(100, 28) == in_place.batch_bytes([128])
    assert in_place.batch_bytes([]) == 0 and optimum.batch_bytes([]) == 0


def test_the_in_place_cache_grows_only_as_far_as_admission_reserved():
    cache = SlotCache(layers=1, kv_heads=2, head_dim=4, dtype=np.float32, rows=1, columns=COLUMN_STEP,
                      max_columns=4096)
    cache.lengths = np.array([COLUMN_STEP])
    cache.limit(3, 130)
    cache.fit(3, COLUMN_STEP + 1)  # a power of two would be 4 rows; 3 were admitted
    assert cache.row_capacity == 3 and cache.width == 2 * COLUMN_STEP
    cache.fit(3, 129)  # by half again would be 192 columns; 130 rounds up to 192 as well
    assert cache.width == 192
    cache.limit(3, 200)
    cache.fit(3, 193)  # 288 by half again, held to 256 (200 in whole steps)
    assert cache.width == 256
    cache.lengths = np.array([193, 1, 1])
    cache.keep([0, 1])
    cache.limit(2, 300)
    cache.fit(2, 257)  # growing: the third row, no longer admitted, is not copied on
    assert (cache.row_capacity, cache.width) == (2, 320)


class _Rounds:
    """Every round of the decode loop: (what the cache holds, what is reserved, the per-sequence
    sum of the admitted) after the loop settled its reservation."""

    def __init__(self, monkeypatch):
        self.rounds: list[tuple[int, int, int]] = []
        settle = DecodeLoop._settle

        def recording(loop, cache, running, filling):
            held = (cache.nbytes if cache is not None else 0) + sum(
                f.cache.nbytes for f in filling if f.cache is not None)
            per_sequence = sum(s.tokens_bound for s in running + [f.seq for f in filling])
            settle(loop, cache, running, filling)
            self.rounds.append((held, loop._held, per_sequence * loop.footprint.kv.bytes_per_token))

        monkeypatch.setattr(DecodeLoop, "_settle", recording)


@pytest.mark.parametrize("layout", ["optimum", "in_place"])
@pytest.mark.parametrize("seed", [1, 2])
async def test_random_arrivals_lengths_and_cancels_under_a_tight_budget(layout, seed, tiny_repo, shared_repo,  # noqa: F811
                                                                        monkeypatch):
    """Sequences of random prompt and answer lengths arrive at random moments, some are
    cancelled, and the budget fits only a few at a time: every round's cache within the
    reservation, everyone answered, the budget whole again at the end."""
    rng = np.random.default_rng(seed)
    repo = tiny_repo if layout == "optimum" else shared_repo
    model = repo / "tinylm"
    weights = (model / "model.onnx").stat().st_size
    record = _Rounds(monkeypatch)
    probe = await start_service(model)
    footprint = probe.decoder.footprint()
    await probe.close()
    service = await start_service(model, budget_bytes=weights + footprint.batch_bytes([360] * 2))
    try:
        async def one(i: int):
            await asyncio.sleep(float(rng.uniform(0, 0.3)))
            prompt = " ".join(PROMPTS[j % 4] for j in range(int(rng.integers(1, 16))))
            params = {"max_new_tokens": int(rng.integers(2, 250)), **NO_STOP}
            seq = await service.submit(prompt, params)
            stop_after = int(rng.integers(1, 6)) if i % 5 == 4 else None
            async for kind, payload in service.events(seq):
                if kind == "token" and stop_after is not None and len(seq.generated) >= stop_after:
                    return "cancelled"
                if kind == "done":
                    assert len(payload.token_ids) == params["max_new_tokens"]
                    return "done"

        outcomes = await asyncio.gather(*(one(i) for i in range(16)))
        assert outcomes.count("done") == 13
        for _ in range(1000):
            if service.statistics()["running"] == 0:
                break
            await asyncio.sleep(0.001)
        stats = service.statistics()
        assert stats["held_back_for_memory"] >= 1, stats  # the budget was tight
        assert service._loop.over_reservation == 0
        assert all(held <= reserved for held, reserved, _ in record.rounds)
        assert service.runtime.budget.reserved == 0 and stats["kv"]["cache_bytes"] == 0
    finally:
        await service.close()


def test_optimum_s_layout_runs_without_the_cpu_arena_the_in_place_one_with_it(tiny_repo, shared_repo):  # noqa: F811
    from edge_batcher.config import load_model_config
    from edge_batcher.rag.decoder import Decoder

    for repo, arena in ((tiny_repo, False), (shared_repo, True)):
        decoder = Decoder(load_model_config(repo / "tinylm"))
        decoder.load()
        try:
            assert decoder.engine.session.get_session_options().enable_cpu_mem_arena is arena
            assert [s.name for s in decoder.engine.inputs][0] == "input_ids"
        finally:
            decoder.close()


class _LiveCache:
    """Every KV array of Optimum's layout alive at once (a step's outputs, a join's and a cut's
    copies, tracked until freed), checked against the loop's reservation after each allocation:
    a transient the end-of-round check cannot see."""

    def __init__(self, monkeypatch):
        from edge_batcher.rag import decoder as decoder_module

        self.live = 0
        self.peak_over = 0  # the most the live arrays were ever above the reservation
        self.loop: DecodeLoop | None = None
        run, join, keep = decoder_module.Decoder._run, decoder_module.BatchCache.join, decoder_module.BatchCache.keep

        def running(decoder, *args, **kwargs):
            logits, present = run(decoder, *args, **kwargs)
            self._track(present)
            return logits, present

        def joining(cache, new):
            joined = join(cache, new)
            self._track(joined.past)
            return joined

        def keeping(cache, rows):
            kept = keep(cache, rows)
            self._track(kept.past if kept is not None else [])
            return kept

        monkeypatch.setattr(decoder_module.Decoder, "_run", running)
        monkeypatch.setattr(decoder_module.BatchCache, "join", joining)
        monkeypatch.setattr(decoder_module.BatchCache, "keep", keeping)

    def _track(self, arrays) -> None:
        for array in arrays:
            self.live += array.nbytes
            weakref.finalize(array, self._freed, array.nbytes)
        if self.loop is not None:
            self.peak_over = max(self.peak_over, self.live - self.loop._held)

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes


async def test_finished_rows_are_cut_from_the_new_cache_after_the_old_one_is_freed(tiny_repo, monkeypatch):
    """Optimum's layout: a step's new cache is written beside the old one (two caches: the
    footprint), and when sequences finish the rest are copied out of the new one. That copy came
    while the loop still held the old cache, three caches at once: SmolLM2 with 8 sequences
    peaked 773 MiB above its start against 644 reserved (tools/measure_kv_footprint.py;
    531-575 MiB since)."""
    live = _LiveCache(monkeypatch)
    service = await start_service(tiny_repo / "tinylm")
    live.loop = service._loop
    try:
        prompt = PROMPTS[0] * 12
        # equal prompts, different lengths: rows leave one by one while the cache is near its bound
        results = await asyncio.gather(*(service.generate(prompt, {"max_new_tokens": 200 + 10 * i, **NO_STOP})
                                         for i in range(4)))
        assert [len(r.token_ids) for r in results] == [200, 210, 220, 230]
        assert live.peak_over <= 0, f"KV arrays {live.peak_over} bytes above the reservation at once"
    finally:
        await service.close()


async def _mixed_run(model_dir, budget_bytes: int = 256 * MiB):
    """One long sequence and six short ones arriving while it runs, two of them cancelled."""
    service = await start_service(model_dir, budget_bytes)
    try:
        long = await service.submit(PROMPTS[0] * 12, {"max_new_tokens": 250, **NO_STOP})
        events = service.events(long)
        assert (await events.__anext__())[0] == "token"

        async def rest():
            async for kind, payload in events:
                if kind == "done":
                    return payload

        async def cancelled_early(prompt):
            seq = await service.submit(prompt, {"max_new_tokens": 60, **NO_STOP})
            async for kind, _ in service.events(seq):
                if kind == "token" and len(seq.generated) >= 3:
                    break

        shorts = [service.generate(p, {"max_new_tokens": 8 + 6 * i, **NO_STOP}) for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(rest(), *shorts, cancelled_early(PROMPTS[1]), cancelled_early(PROMPTS[2]))
        stats = service.statistics()
        return results, stats, service._loop.over_reservation, service.runtime.budget.reserved
    finally:
        await service.close()


@pytest.mark.parametrize("layout", ["optimum", "in_place"])
async def test_the_cache_never_holds_more_than_admission_reserved(layout, tiny_repo, shared_repo,  # noqa: F811
                                                                   monkeypatch):
    repo = tiny_repo if layout == "optimum" else shared_repo
    record = _Rounds(monkeypatch)
    results, stats, over, left = await _mixed_run(repo / "tinylm")
    rounds = record.rounds
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 250
    assert stats["max_running_seen"] >= 4, stats
    assert over == 0 and all(held <= reserved for held, reserved, _ in rounds)
    # the reservation is the footprint, not the per-sequence sum the cache outgrew before
    assert max(held - per_sequence for held, _, per_sequence in rounds) > 0
    assert left == 0 and stats["kv"]["reserved_bytes"] == 0 and stats["kv"]["cache_bytes"] == 0
    assert stats["kv"]["layout"] == layout


async def test_a_short_sequence_waits_while_the_batch_with_it_would_not_fit(shared_repo):  # noqa: F811
    """In place: a long sequence runs; a short one whose own tokens would fit, but whose row
    at the long one's width would not, is held back until the long one finishes."""
    model = shared_repo / "tinylm"
    probe = await start_service(model)
    footprint = probe.decoder.footprint()
    long_tokens = probe.count_tokens(PROMPTS[0] * 12) + 250
    short_tokens = probe.count_tokens(PROMPTS[3]) + 20
    await probe.close()
    weights = (model / "model.onnx").stat().st_size
    alone, together = footprint.batch_bytes([long_tokens]), footprint.batch_bytes([long_tokens, short_tokens])
    per_sequence = (long_tokens + short_tokens) * footprint.kv.bytes_per_token
    room = (alone + together) // 2
    assert per_sequence < alone < room < together  # the old rule would have admitted both
    service = await start_service(model, budget_bytes=weights + room)
    try:
        long = asyncio.ensure_future(service.generate(PROMPTS[0] * 12, {"max_new_tokens": 250, **NO_STOP}))
        while service.statistics()["running"] == 0:
            await asyncio.sleep(0.001)
        assert not service.fits_now(short_tokens - 20, 20)  # the rag service would send it to a peer
        short = asyncio.ensure_future(service.generate(PROMPTS[3], {"max_new_tokens": 20, **NO_STOP}))
        while service.statistics()["held_back_for_memory"] == 0 and not long.done():
            await asyncio.sleep(0.001)
        assert service.statistics()["held_back_for_memory"] == 1
        a, b = await asyncio.gather(long, short)
        stats = service.statistics()
        assert stats["max_running_seen"] == 1 and stats["admitted"] == 2
        assert b.queue_s > 0 and len(a.token_ids) == 250 and len(b.token_ids) == 20
        assert service.runtime.budget.reserved == 0
        assert service.fits_now(short_tokens - 20, 20)
    finally:
        await service.close()


async def test_a_generator_does_not_say_it_fits_while_an_engine_model_waits_in_line(tiny_repo):
    """The rag service asks `fits_now` before it chooses between the generator and a peer: with
    another model waiting for memory longer, admission would hold the sequence back, so the
    answer is no (the peer, if any, serves it) though the memory is free."""
    service = await start_service(tiny_repo / "tinylm")
    try:
        budget = service.runtime.budget
        assert service.fits_now(8, 8)
        budget.wait_in_line("vibration")
        assert not service.fits_now(8, 8)
        budget.leave_line("vibration")
        assert service.fits_now(8, 8)
    finally:
        await service.close()

@pytest.mark.parametrize("seed", [0, 1])
async def test_many_clients_with_long_prompts_in_chunks_stay_within_the_reservation(seed, shared_repo):  # noqa: F811
    """Twelve clients, each sending its next prompt (up to ~600 tokens, prefilled in chunks of
    128 beside the batch) when the last is answered, on the in-place layout: rows leave and join
    while the buffers keep their capacity, and prompts' own caches fill chunk by chunk. No round
    may find the cache able to hold more than was reserved (memory_soak.py found rounds that did:
    a prompt's cache shrank at its second chunk and grew past its prompt; buffers kept the rows
    and columns of sequences that had left while the reservation followed those still there)."""
    rng = np.random.default_rng(seed)
    service = await start_service(shared_repo / "tinylm", budget_bytes=1 << 30)
    words = " ".join(PROMPTS).split()
    try:
        async def client() -> None:
            for _ in range(3):
                prompt = " ".join(words[int(i)] for i in rng.integers(0, len(words), int(rng.integers(10, 240))))
                await service.generate(prompt, {"max_new_tokens": int(rng.integers(8, 64)), **NO_STOP})

        await asyncio.gather(*(client() for _ in range(12)))
        stats = service.statistics()
        assert stats["max_running_seen"] >= 4 and stats["prefill_tokens"] > 128 * stats["prefills"] / 2, stats
        assert service._loop.over_reservation == 0
    finally:
        await service.close()


async def watched_tinylm(tiny_repo, probe: str):
    """The tiny decoder started under a 1 GiB budget read by `probe`, and a memory watch over it."""
    from edge_batcher.config import DaemonConfig, MemorySettings, load_model_config
    from edge_batcher.memory_watch import MemoryWatch
    from edge_batcher.rag.generate import GenerationService
    from edge_batcher.runtime import Runtime

    runtime = Runtime(DaemonConfig(memory=MemorySettings(probe=probe, budget_mb=1024, headroom_mb=8)))
    service = GenerationService(load_model_config(tiny_repo / "tinylm"), runtime)
    watch = MemoryWatch(runtime.budget, lambda: [service])
    watch.start()
    await service.start()
    return runtime, service, watch


async def test_the_memory_watch_names_a_generator_that_ran_and_gives_back_growth_that_went(tiny_repo, caplog):
    """Growth the plan did not have while a generator ran is logged with the generator's name (it
    is no engine runner), and once the process's memory falls back it leaves the budget again."""
    import logging
    import mmap

    runtime, service, watch = await watched_tinylm(tiny_repo, "fixed")
    try:
        watch.settle()
        resident_at_ready = runtime.budget.resident
        await service.generate(PROMPTS[0], {"max_new_tokens": 4, **NO_STOP})
        grown = mmap.mmap(-1, 96 << 20)
        grown.write(b"\1" * (96 << 20))  # what no plan saw, held while the watch looks
        with caplog.at_level(logging.INFO, logger="edge_batcher.memory_watch"):
            watch.check()
            warning = next(r for r in caplog.records if "above the plan" in r.getMessage())
            assert warning.levelno == logging.WARNING
            assert warning.getMessage().endswith("models that ran since the last check: tinylm")
            counted = runtime.budget.resident - resident_at_ready
            assert counted >= 80 << 20
            watch.check()  # nothing ran, nothing new: no second warning, nothing given back
            assert sum("above the plan" in r.getMessage() for r in caplog.records) == 1
            assert runtime.budget.resident - resident_at_ready == counted
            runtime.budget.reserve(256 << 20)  # promised, not allocated: the growth is still held
            watch.check()
            runtime.budget.release(256 << 20)
            assert not any("given back" in r.getMessage() for r in caplog.records)
            assert runtime.budget.resident - resident_at_ready == counted
            grown.close()
            watch.check()
            back = next(r for r in caplog.records if "given back to the budget" in r.getMessage())
            assert back.levelno == logging.INFO
        assert runtime.budget.resident - resident_at_ready <= 8 << 20
        assert watch.unplanned == runtime.budget.resident - resident_at_ready
    finally:
        await service.close()


def tinylm_reserving_no_prefill_memory(tiny_repo, where):
    """The tiny decoder with `prefill_memory_mb = 0`: its reservation is the KV cache and logits
    alone, which the tests' budgets are calculated from (a measured prefill run's 6-12 MiB
    would dwarf tinylm's KV cache, half a MiB at its whole context)."""
    where.mkdir()
    for name in ("model.onnx", "tokenizer.json"):
        (where / name).symlink_to(tiny_repo / "tinylm" / name)
    toml = (tiny_repo / "tinylm" / "model.toml").read_text()
    (where / "model.toml").write_text(toml.replace("[generator]\n", "[generator]\nprefill_memory_mb = 0\n"))


async def vibration_beside_tinylm(tiny_repo, tmp_path):
    """A started Runtime serving the demo vibration model and the tiny decoder (reserving no
    prefill memory) under one fixed 1 GiB budget (no headroom)."""
    from edge_batcher.config import DaemonConfig, MemorySettings, ModelsSettings
    from edge_batcher.runtime import Runtime
    from tests.support.models import build_demo

    repo = tmp_path / "engines"
    build_demo(repo)
    tinylm_reserving_no_prefill_memory(tiny_repo, repo / "tinylm")
    runtime = Runtime(DaemonConfig(
        models=ModelsSettings(repository=str(repo), warmup=False, load=["vibration", "tinylm"]),
        memory=MemorySettings(probe="fixed", budget_mb=1024, headroom_mb=0)))
    await runtime.start()
    return runtime


@pytest.mark.parametrize("announced_only", [False, True])
async def test_an_engine_model_waiting_for_memory_is_served_before_the_generator_admits_more(
        announced_only, tiny_repo, tmp_path, monkeypatch):
    """A generator that always has sequences waiting admits one whenever one leaves: an engine
    model whose batch needs more than the generator leaves free waited for the memory until its
    requests expired (5 of 5 answered 504 after 3 s in a scratch run of this scenario). Now the
    engine model stands in the budget's line, the generator admits nothing new meanwhile, and
    what its running sequences free reaches the engine model. `announced_only`: the runner's own
    look-again comes too late to matter, so only the budget's announcement of a release can
    wake it (the requests expired with it before: their deadline is 3 s)."""
    from edge_batcher.scheduler import policy
    from edge_batcher.types import InferRequest

    if announced_only:
        monkeypatch.setattr(policy, "MEMORY_RECHECK_S", 60.0)

    runtime = await vibration_beside_tinylm(tiny_repo, tmp_path)
    budget, vibration, generator = runtime.budget, runtime.runner("vibration"), runtime.runner("tinylm")
    stop = asyncio.Event()

    async def keep_generating() -> None:
        while not stop.is_set():
            await generator.generate("word " * 100, {"max_new_tokens": 40, **NO_STOP})

    clients = [asyncio.create_task(keep_generating()) for _ in range(12)]
    try:
        seen = []
        for _ in range(50):
            await asyncio.sleep(0.01)
            seen.append(budget.reserved)
        most = max(seen)
        assert most > 0  # the generator holds a cache
        # The engine model's batch needs 1.5x what the generator holds at most (its estimate
        # raised, as after out-of-memory errors); the budget fits the generator's most and half
        # that batch: the batch fits only once the generator holds under a quarter of its most.
        admission = vibration.admission
        admission.estimator.scale_calibration(1.5 * most / admission.batch_bytes(2, 0))
        need = admission.batch_bytes(2, 0)
        budget.fixed_bytes = budget.resident + most + need // 2
        await asyncio.sleep(0.2)
        assert not admission.fits(2, 0) or budget.reserved < most // 4
        held_back_before = generator.statistics()["held_back_for_memory"]
        signal = np.zeros((1, 256), np.float32)
        for _ in range(5):
            out = await runtime.infer(InferRequest(model="vibration", inputs={"signal": signal}, timeout_s=3.0))
            assert out.outputs["class_probs"].shape == (1, 4)
        assert generator.statistics()["held_back_for_memory"] > held_back_before  # it gave way
        assert budget.first_in_line(generator._loop.line_key)  # served, the engine model left the line
        text = runtime.metrics.render()  # what an operator sees of it
        assert 'edge_batcher_memory_waiting{model="vibration"} 0' in text
        waits = re.search(r'edge_batcher_memory_waits_total\{model="vibration"\} (\S+)', text)
        waited = re.search(r'edge_batcher_memory_wait_seconds_total\{model="vibration"\} (\S+)', text)
        assert waits and float(waits.group(1)) >= 1 and waited and float(waited.group(1)) > 0, text
    finally:
        stop.set()
        await asyncio.gather(*clients, return_exceptions=True)
        await runtime.close()


async def test_a_generator_s_measured_weights_count_in_the_plan_as_a_model_s(tiny_repo, caplog):
    """Under the cpu probe the decoder's load is measured as the process's growth: the plan
    counts it under the models (unloading takes it out), not in the daemon's own memory at
    ready, where it stayed after an unload and hid as much growth from the watch."""
    import logging

    from edge_batcher.memory_watch import MemoryWatch

    runtime, service, watch = await watched_tinylm(tiny_repo, "cpu")
    try:
        assert service.resident_meter == "process"
        assert watch.residents() == {"process": service.resident_bytes}
        assert service.statistics()["memory"]["measured_by"] == "process"
        with caplog.at_level(logging.INFO, logger="edge_batcher.memory.plan"):
            watch.settle()
        ready = next(r.getMessage() for r in caplog.records if "memory plan at ready" in r.getMessage())
        assert f"+ {service.resident_bytes / MiB:.0f} models +" in ready
        planned = watch.planned()["process"]
        unloaded = MemoryWatch(runtime.budget, lambda: [])
        unloaded.plan = watch.plan  # the same plan once the generator is gone
        assert unloaded.planned()["process"] == planned - service.resident_bytes
    finally:
        await service.close()


async def test_a_generator_is_not_starved_by_an_engine_model_s_batches_back_to_back(tiny_repo, tmp_path):
    """The other way round: an engine model flooded with requests keeps a batch in flight at all
    times, and the memory a sequence needs is free only between two of them, for microseconds;
    the generator looked every 20 ms and never saw it (a scratch run: a sequence waited its whole
    30 s deadline). Once it has waited in the budget's line for PRIORITY_AFTER_S, the engine
    model's next batch waits for it instead."""
    from edge_batcher.memory.budget import PRIORITY_AFTER_S
    from edge_batcher.types import InferRequest

    runtime = await vibration_beside_tinylm(tiny_repo, tmp_path)
    budget, vibration, generator = runtime.budget, runtime.runner("vibration"), runtime.runner("tinylm")
    prompt, options = "word " * 100, {"max_new_tokens": 200, **NO_STOP}
    alone = asyncio.create_task(generator.generate(prompt, options))
    sequence_bytes = 0
    while not alone.done():  # what one such sequence reserves, alone
        sequence_bytes = max(sequence_bytes, generator.statistics()["kv"]["reserved_bytes"])
        await asyncio.sleep(0.001)
    assert sequence_bytes > 0
    # Batches of 2/4/8 need half, once and twice the sequence: with a batch of 8 in flight no
    # other batch fits and neither does the sequence; with none, everything does.
    admission = vibration.admission
    admission.estimator.scale_calibration(sequence_bytes / 2 / admission.batch_bytes(2, 0))
    largest = admission.batch_bytes(8, 0)
    budget.fixed_bytes = budget.resident + largest + sequence_bytes - 1
    stop = asyncio.Event()
    answered = 0

    async def flood() -> None:
        nonlocal answered
        while not stop.is_set():
            await runtime.infer(InferRequest(model="vibration", inputs={"signal": np.zeros((1, 256), np.float32)}))
            answered += 1

    clients = [asyncio.create_task(flood()) for _ in range(24)]
    try:
        await asyncio.sleep(0.3)
        before = answered
        # answered, where it waited for its deadline (30 s) before: a second or so in the line
        await asyncio.wait_for(generator.generate(prompt, options), timeout=10 + PRIORITY_AFTER_S)
        await asyncio.sleep(0.2)
        assert answered > before  # the engine model served on
    finally:
        stop.set()
        await asyncio.gather(*clients, return_exceptions=True)
        await runtime.close()


@pytest.mark.parametrize("layout", ["in_place", "optimum"])
async def test_a_served_generator_s_cache_is_counted_once_under_a_host_probe(layout, shared_repo, tiny_repo):  # noqa: F811
    """The cache's arrays, allocated in mappings of their own, are in the cpu probe's free figure
    and in the reservation: the budget is told they are visible (counted once) while sequences
    run, and nothing is left marked when they are done. Until 2026-11-29 the served generator
    never did it (its decode loop read the layout before the decoder loaded: only loops built by
    hand after a load did), and Optimum's layout not at all."""
    from edge_batcher.config import DaemonConfig, MemorySettings, load_model_config
    from edge_batcher.rag.generate import GenerationService
    from edge_batcher.runtime import Runtime

    model = (shared_repo if layout == "in_place" else tiny_repo) / "tinylm"
    runtime = Runtime(DaemonConfig(memory=MemorySettings(probe="cpu", budget_mb=4096, headroom_mb=8)))
    service = GenerationService(load_model_config(model), runtime)
    await service.start()
    try:
        assert service.statistics()["kv"]["layout"] == layout
        seen = 0
        tasks = [asyncio.create_task(service.generate(p * 20, {"max_new_tokens": 120, **NO_STOP})) for p in PROMPTS]
        while not all(t.done() for t in tasks):
            seen = max(seen, runtime.budget.visible)
            assert runtime.budget.visible <= runtime.budget.reserved
            await asyncio.sleep(0.001)
        await asyncio.gather(*tasks)
        assert seen > 0
        assert runtime.budget.visible == 0 and runtime.budget.reserved == 0
    finally:
        await service.close()


async def test_a_held_back_generator_admits_when_the_memory_others_held_comes_back(tiny_repo, monkeypatch):
    """A sequence held back while other models' batches hold the memory is admitted when the
    budget announces their release, not at the loop's next look (made later than the test here)."""
    from edge_batcher.rag import decode_loop

    monkeypatch.setattr(decode_loop, "HELD_BACK_RECHECK_S", 60.0)
    service = await start_service(tiny_repo / "tinylm")
    budget = service.runtime.budget
    try:
        others = budget.available() - 1024  # another model's batch in flight: no room for a cache
        budget.reserve(others)
        answer = asyncio.ensure_future(service.generate(PROMPTS[0], {"max_new_tokens": 8, **NO_STOP}))
        while service.statistics()["held_back_for_memory"] == 0:
            await asyncio.sleep(0.001)
        assert budget.first_in_line(service._loop.line_key)  # it stands in the line for the memory,
        assert not budget.first_in_line("vibration")  # ahead of anyone who comes now
        budget.release(others)  # the batch finished
        result = await asyncio.wait_for(answer, timeout=10)
        assert len(result.token_ids) == 8
    finally:
        await service.close()


async def test_two_generators_taking_turns_in_the_line_never_stall(tiny_repo, tmp_path):
    """Two generators under one budget that holds three sequences of either: each stands in the
    line for what the other holds, and wakes the other when it leaves the line, maybe while it
    holds its own loop's lock (why a decode loop's waker never blocks on its lock: a timing this
    test does not force). Everyone is answered; nothing hangs."""
    from edge_batcher.config import DaemonConfig, MemorySettings, ModelsSettings
    from edge_batcher.runtime import Runtime

    repo = tmp_path / "engines"
    repo.mkdir()
    for name in ("gen_a", "gen_b"):
        tinylm_reserving_no_prefill_memory(tiny_repo, repo / name)
    runtime = Runtime(DaemonConfig(
        models=ModelsSettings(repository=str(repo), warmup=False, load=["gen_a", "gen_b"]),
        memory=MemorySettings(probe="fixed", budget_mb=1024, headroom_mb=0)))
    await runtime.start()
    budget = runtime.budget
    a, b = runtime.runner("gen_a"), runtime.runner("gen_b")
    options = {"max_new_tokens": 30, **NO_STOP}
    try:
        one = a._loop.extra_bytes(a.count_tokens("word " * 100), 30)
        budget.fixed_bytes = budget.resident + 3 * one  # three sequences at most, of either
        results = await asyncio.wait_for(asyncio.gather(*(
            (a if i % 2 else b).generate("word " * 100, options) for i in range(24))), timeout=120)
        assert all(len(r.token_ids) == 30 for r in results)
        held_back = a.statistics()["held_back_for_memory"] + b.statistics()["held_back_for_memory"]
        assert held_back > 0  # they did wait for each other
        assert budget.reserved == 0
    finally:
        await runtime.close()
