"""The shared KV layout (kv_slots.SlotCache): the tiny decoder built twice from the same seed,
once with Optimum's signature and once with GroupQueryAttention writing its cache in place,
must compute the same logits and generate the same tokens, through joins, departures and the
buffers growing and shrinking."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_batcher.config import load_model_config
from edge_batcher.rag.decoder import Decoder, in_place_refused, join, keep
from edge_batcher.rag.kv_slots import COLUMN_STEP, SlotCache
from tests.rag.conftest import _require, _tool
from tests.rag.test_rag_generation import NO_STOP, PROMPTS, start_service


@pytest.fixture(scope="module")
def shared_repo(tmp_path_factory):
    import onnxruntime

    _require("tokenizers")
    if in_place_refused(onnxruntime.__version__):
        pytest.skip(in_place_refused(onnxruntime.__version__))
    out = tmp_path_factory.mktemp("tiny_shared")
    _tool("build_tiny_decoder").build(out, "tinylm", quiet=True, kv_layout="shared")
    return out


def _decoder(model_dir) -> Decoder:
    d = Decoder(load_model_config(model_dir))
    d.load()
    return d


@pytest.fixture(scope="module")
def decoders(tiny_repo, shared_repo):
    optimum, shared = _decoder(tiny_repo / "tinylm"), _decoder(shared_repo / "tinylm")
    assert shared.shared_kv and not optimum.shared_kv
    yield optimum, shared
    optimum.close()
    shared.close()


def _with_prefill_chunk(repo, tmp_path, tokens: int):
    """A copy of the in-place tinylm whose model.toml sets [generator] prefill_chunk_tokens."""
    import shutil

    model = tmp_path / "tinylm"
    shutil.copytree(repo / "tinylm", model)
    toml = (model / "model.toml").read_text()
    (model / "model.toml").write_text(toml.replace("[generator]\n", f"[generator]\nprefill_chunk_tokens = {tokens}\n"))
    return model


def _alone(decoder: Decoder, prompt: list[int], steps: list[int]) -> np.ndarray:
    """The logits of the prompt's last token and of each step, the sequence alone."""
    logits, cache = decoder.prefill(prompt)
    out = [logits[-1]]
    for token in steps:
        step, cache = decoder.step(cache, np.array([token]))
        out.append(step[0])
    return np.array(out)


def test_the_cache_in_place_computes_what_optimum_s_layout_computes(decoders):
    optimum, shared = decoders
    rng = np.random.default_rng(0)
    prompt, steps = list(rng.integers(0, shared.vocab, 7)), list(rng.integers(0, shared.vocab, 150))
    np.testing.assert_allclose(_alone(shared, prompt, steps), _alone(optimum, prompt, steps), atol=1e-4)


def test_a_step_writes_into_the_same_buffers(decoders):
    _, shared = decoders
    _, cache = shared.prefill([5, 9, 13])
    before = [b.copy() for b in cache.buffers]
    buffers = list(cache.buffers)
    _, after = shared.step(cache, np.array([11]))
    assert after is cache and all(a is b for a, b in zip(after.buffers, buffers))  # nothing reallocated
    assert cache.lengths.tolist() == [4]
    for old, new in zip(before, cache.buffers):
        np.testing.assert_array_equal(new[:, :, :3], old[:, :, :3])  # the prompt's keys and values stay
        assert np.abs(new[:, :, 3]).sum() > 0  # the new token's were written at column 3


def test_rows_join_leave_and_still_compute_what_they_compute_alone(decoders):
    optimum, shared = decoders
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, shared.vocab, n)) for n in (9, 3, 70, 5)]
    tokens = rng.integers(0, shared.vocab, (4, 12))

    batch = None
    for p in prompts[:3]:
        batch = join(batch, shared.prefill(p)[1])
    assert batch.rows == 3 and batch.row_capacity == 4 and batch.lengths.tolist() == [9, 3, 70]
    got = {r: [] for r in range(4)}
    for t in range(4):
        step, batch = shared.step(batch, tokens[:3, t])
        for r in range(3):
            got[r].append(step[r])
    batch = keep(batch, [0, 2])  # the short middle row leaves: the long one moves into its slot
    assert batch.rows == 2 and batch.row_capacity == 2 and batch.lengths.tolist() == [13, 74]
    batch = join(batch, shared.prefill(prompts[3])[1])  # and another joins mid-generation
    for t in range(4, 12):
        step, batch = shared.step(batch, np.array([tokens[0, t], tokens[2, t], tokens[3, t - 4]]))
        for row, r in enumerate((0, 2, 3)):
            got[r].append(step[row])

    for r, count in ((0, 12), (1, 4), (2, 12), (3, 8)):
        want = _alone(optimum, prompts[r], list(tokens[r, :count]))[1:]  # after each token fed
        np.testing.assert_allclose(np.array(got[r]), want, atol=1e-4, err_msg=f"row {r}")


def test_the_buffers_grow_and_shrink_with_the_batch():
    cache = SlotCache(layers=1, kv_heads=2, head_dim=4, dtype=np.float32, rows=1, columns=COLUMN_STEP,
                      max_columns=1024)
    cache.lengths = np.array([COLUMN_STEP])
    cache.buffers[0][0, :, :COLUMN_STEP] = 1.0
    cache.fit(3, COLUMN_STEP + 1)  # rows to a power of two, columns by half again in steps
    assert (cache.row_capacity, cache.width) == (4, 2 * COLUMN_STEP)
    assert cache.buffers[0][0, :, :COLUMN_STEP].min() == 1.0  # what the row held came along
    cache.fit(3, 400)
    assert cache.width == 448  # 400 rounded up to a multiple of 64
    cache.fit(1, 100)  # less than half used in both directions: memory goes back
    assert (cache.row_capacity, cache.width) == (1, 128)
    assert cache.nbytes == 2 * 1 * 2 * 128 * 4 * 4
    cache.fit(1, 2000)
    assert cache.width == 2000  # past max_columns only as far as asked


_GIVES_BACK = """
import numpy as np
from edge_batcher.rag.kv_slots import SlotCache

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20

freed = np.ones(8 << 20, np.uint8)  # freeing it raises glibc's mmap threshold to 8 MiB
del freed
start = rss_mib()
cache = SlotCache(layers=30, kv_heads=3, head_dim=64, dtype=np.float32, rows=4, columns=1024, max_columns=1024)
cache.lengths = np.array([100, 1000, 1000, 1000])
for b in cache.buffers:
    b[:] = 1.0  # 3 MiB each, 180 MiB in all, every page written
later = [np.ones(64) for _ in range(1000)]  # small objects allocated after the buffers
held = rss_mib() - start
cache.keep([0])  # one short row left: the buffers shrink to 1 x 128
print(held, rss_mib() - start)
"""


def test_a_shrinking_cache_gives_its_memory_back_to_the_system():
    """The buffers a shrink (or a finished batch) frees leave the process at once: from numpy's
    allocator, glibc kept them in its heap under the objects allocated after them. A fresh
    process, so that the heap is as a daemon's is after its first large free."""
    if not Path("/proc/self/statm").exists():
        pytest.skip("reads the resident size from Linux's /proc")
    out = subprocess.run([sys.executable, "-c", _GIVES_BACK], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    held, after = (int(x) for x in out.stdout.split())
    assert held >= 170, out.stdout  # 60 buffers of 4 x 3 x 1024 x 64 float32
    assert after <= 20, f"{after} MiB still resident of the {held} MiB the cache held"


async def test_generation_in_place_gives_optimum_s_tokens_joins_included(tiny_repo, shared_repo):
    """Through the decode loop (continuous batching): sequences arriving mid-generation get the
    tokens the Optimum-layout model gives them, and the memory comes back."""
    results = {}
    for layout, repo in (("optimum", tiny_repo), ("shared", shared_repo)):
        service = await start_service(repo / "tinylm")
        try:
            first = await service.submit(PROMPTS[0], {"max_new_tokens": 200, **NO_STOP})
            events = service.events(first)
            assert (await events.__anext__())[0] == "token"

            async def rest(events=events):
                async for kind, payload in events:
                    if kind == "done":
                        return payload

            together = await asyncio.gather(rest(), *(service.generate(p, {"max_new_tokens": 40, **NO_STOP})
                                                      for p in PROMPTS[1:]))
            stats = service.statistics()
            assert stats["joined_mid_generation"] >= 1 and stats["max_running_seen"] >= 2, stats
            assert stats["running"] == 0 and stats["kv"]["reserved_bytes"] == 0
            for _ in range(1000):  # the worker publishes the cache's size after its last step
                if service.statistics()["kv"]["cache_bytes"] == 0:
                    break
                await asyncio.sleep(0.001)
            assert service.statistics()["kv"]["cache_bytes"] == 0  # the buffers went with the last sequence
            results[layout] = [r.token_ids for r in together]
        finally:
            await service.close()
    assert results["shared"] == results["optimum"]


def test_the_in_place_layout_is_refused_off_the_cpu_with_a_clear_line(shared_repo, monkeypatch):
    """The buffers are bound in host memory: a session that placed the model on another provider
    (here the real session, reporting the CUDA provider first) is refused at load."""
    from edge_batcher.engines.onnxruntime import OnnxRuntimeEngine
    from edge_batcher.errors import ConfigError

    real_load = OnnxRuntimeEngine.load

    def load_on_cuda(self):
        real_load(self)
        self.providers = ["CUDAExecutionProvider", *self.providers]

    monkeypatch.setattr(OnnxRuntimeEngine, "load", load_on_cuda)
    decoder = Decoder(load_model_config(shared_repo / "tinylm"))
    with pytest.raises(ConfigError, match="CPUExecutionProvider .* --kv-layout optimum"):
        decoder.load()
    assert decoder.engine.session is None  # closed, not kept


@pytest.mark.parametrize("layout", ["optimum", "shared"])
def test_a_prompt_fed_in_chunks_computes_what_it_computes_whole(decoders, layout):
    decoder = dict(zip(("optimum", "shared"), decoders))[layout]
    prompt = list(np.random.default_rng(2).integers(0, decoder.vocab, 150))
    whole, _ = decoder.prefill(prompt, all_logits=True)
    cache, parts = None, []
    for start in range(0, 150, 64):
        logits, cache = decoder.extend(cache, prompt[start:start + 64], room=150, all_logits=True)
        parts.append(logits)
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-4)
    last, _ = decoder.prefill(prompt)  # what the decode loop asks for: the LM head for the last position only
    assert last.shape == (1, decoder.vocab)
    np.testing.assert_allclose(last[0], whole[-1], atol=1e-4)
    step_whole = decoder.step(decoder.prefill(prompt)[1], np.array([3]))[0]
    np.testing.assert_allclose(decoder.step(cache, np.array([3]))[0], step_whole, atol=1e-4)


def test_the_in_place_layout_is_refused_where_onnxruntime_computes_it_wrong():
    """1.18 and 1.19 (the package allows 1.18) give wrong logits for a prompt's later chunks and
    in the builder's check; 1.20.1, 1.22.0 and 1.32.0 pass this file."""
    assert "1.20 or newer" in in_place_refused("1.19.2") and in_place_refused("1.18.0")
    assert in_place_refused("1.20.1") is None and in_place_refused("1.32.0") is None


async def test_a_long_prompt_is_prefilled_between_the_running_sequences_steps(shared_repo, tmp_path):
    """With prefill_chunk_tokens the newcomer's prompt goes in chunk by chunk, a decode step of
    the running sequence after each: the stream already running is not held up by the whole
    prefill. The calls to the real decoder are recorded to show the order."""
    model = _with_prefill_chunk(shared_repo, tmp_path, 8)
    service = await start_service(model)
    try:
        calls: list[tuple[str, int]] = []
        decoder = service.decoder
        extend, step = decoder.extend, decoder.step

        def recorded_extend(cache, tokens, room=0):
            calls.append(("extend", len(tokens)))
            return extend(cache, tokens, room)

        def recorded_step(cache, tokens):
            calls.append(("step", len(tokens)))
            return step(cache, tokens)

        decoder.extend, decoder.step = recorded_extend, recorded_step
        long_prompt = " ".join(["bearing temperature and vibration trend"] * 8)
        tokens = service.count_tokens(long_prompt)
        assert tokens > 40
        first = await service.submit(PROMPTS[1], {"max_new_tokens": 200, **NO_STOP})
        events = service.events(first)
        assert (await events.__anext__())[0] == "token"
        newcomer = await service.generate(long_prompt, {"max_new_tokens": 5, **NO_STOP})
        async for _ in events:
            pass
        chunks = [i for i, (kind, _) in enumerate(calls) if kind == "extend"][1:]  # the newcomer's
        assert len(chunks) == -(-tokens // 8) and all(calls[i][1] <= 8 for i in chunks)
        for i in chunks[:-1]:
            assert calls[i + 1] == ("step", 1), calls[i - 2:i + 3]  # the running sequence got its token
        alone = await service.generate(long_prompt, {"max_new_tokens": 5, **NO_STOP})
        assert newcomer.token_ids == alone.token_ids
        assert service.statistics()["prefills"] >= 3
    finally:
        await service.close()


def test_a_negative_prefill_chunk_is_refused_with_its_key(shared_repo, tmp_path):
    from edge_batcher.config import DaemonConfig
    from edge_batcher.errors import ConfigError
    from edge_batcher.rag.generate import GenerationService
    from edge_batcher.runtime import Runtime

    model = _with_prefill_chunk(shared_repo, tmp_path, -1)
    with pytest.raises(ConfigError, match=r"\[generator\] prefill_chunk_tokens: expected 0 .* got -1"):
        GenerationService(load_model_config(model), Runtime(DaemonConfig()))


async def test_whole_prompt_prefill_is_served_with_a_warning_naming_its_memory(shared_repo, tmp_path, caplog):
    """prefill_chunk_tokens = 0 is allowed, but a whole prompt's activations are in no memory
    plan (0.8-1.2 GB measured for a 700-token SmolLM2 prompt): the load says so."""
    import logging

    from tests.rag.test_rag_generation import start_service

    with caplog.at_level(logging.WARNING, logger="edge_batcher.rag.generate"):
        service = await start_service(_with_prefill_chunk(shared_repo, tmp_path, 0))
    try:
        assert any("prefill_chunk_tokens = 0" in r.getMessage() and "no memory plan" in r.getMessage()
                   for r in caplog.records), caplog.text
        result = await service.generate("Bearing faults ring", {"max_new_tokens": 4, "ignore_stop": True})
        assert len(result.token_ids) == 4
    finally:
        await service.close()


async def test_a_sequence_cancelled_while_its_prompt_is_prefilled_frees_everything(shared_repo, tmp_path):
    model = _with_prefill_chunk(shared_repo, tmp_path, 1)
    service = await start_service(model)
    try:
        prompt = " ".join(["bearing temperature and vibration trend"] * 110)
        assert 800 < service.count_tokens(prompt) < 1000  # hundreds of one-token chunks: ~0.3 s of prefill
        seq = await service.submit(prompt, {"max_new_tokens": 8, **NO_STOP})
        while service.statistics()["kv"]["reserved_bytes"] == 0:  # admitted: its prefill has begun
            await asyncio.sleep(0.001)
        service.cancel(seq)
        for _ in range(5000):
            stats = service.statistics()
            if stats["cancelled"] == 1 and stats["kv"]["cache_bytes"] == 0:
                break
            await asyncio.sleep(0.001)
        assert stats["cancelled"] == 1 and stats["running"] == 0 and stats["prefills"] == 0, stats
        assert stats["kv"]["reserved_bytes"] == 0 and stats["kv"]["cache_bytes"] == 0, stats
        assert service.runtime.budget.reserved == 0
        after = await service.generate(PROMPTS[0], {"max_new_tokens": 4, **NO_STOP})  # still serving
        assert len(after.token_ids) == 4
    finally:
        await service.close()


def test_a_cache_that_cannot_grow_says_out_of_memory_and_stays_usable():
    from edge_batcher.errors import OutOfMemory

    cache = SlotCache(layers=2, kv_heads=2, head_dim=4, dtype=np.float32, rows=2, columns=COLUMN_STEP,
                      max_columns=1024)
    cache.lengths = np.array([10, 20])
    cache.buffers[1][1, :, :20] = 7.0
    with pytest.raises(OutOfMemory, match="could not grow to 2 rows"):
        cache.fit(2, 1 << 50)  # more than any machine has
    assert (cache.row_capacity, cache.width) == (2, COLUMN_STEP)
    assert cache.buffers[1][1, :, :20].min() == 7.0  # what the rows held is still there
    cache.fit(2, COLUMN_STEP + 1)  # and it grows when the memory is there
    assert cache.width == 2 * COLUMN_STEP and cache.buffers[1][1, :, :20].min() == 7.0


def test_the_decoder_refuses_an_in_place_model_on_an_onnxruntime_that_computes_it_wrong(shared_repo, monkeypatch):
    import onnxruntime

    from edge_batcher.errors import ConfigError

    monkeypatch.setattr(onnxruntime, "__version__", "1.19.2")
    decoder = Decoder(load_model_config(shared_repo / "tinylm"))
    with pytest.raises(ConfigError, match="onnxruntime 1.19.2 computes it wrong .* --kv-layout optimum"):
        decoder.load()
    assert decoder.engine.session is None
