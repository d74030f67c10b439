"""Padding of the embedding model's batches, measured on the 90 questions of the retrieval
evaluation through the real runtime and the real MiniLM ONNX Runtime session: padded to the
bucket (the engine's `accepts_any_length` forced off, as TensorRT engines are) against padded
to each batch's longest member (scheduler/batch.py), same embeddings either way."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.rag.conftest import _tool


@pytest.fixture(scope="module")
def bench():
    return _tool("bench_embedding_padding")


def test_onnx_runtime_with_a_dynamic_sequence_dimension_accepts_any_length(minilm_dir):
    from edge_batcher.config import load_model_config
    from edge_batcher.rag.embed import TextEmbeddingEngine

    engine = TextEmbeddingEngine(load_model_config(minilm_dir))
    engine.load()
    assert engine.accepts_any_length is True


def test_padding_to_the_longest_member_wastes_at_most_a_fifth_and_changes_no_embedding(minilm_dir, bench):
    texts = bench.question_set()
    assert len(texts) == 90
    repo, model = minilm_dir.parent, minilm_dir.name

    async def measure(any_length: bool, **load) -> dict:
        return await bench.measure(repo, model, texts, any_length=any_length, **load)

    async def both():
        served = {"concurrency": 16, "duration": 1.5}  # 16 clients asking one question at a time
        burst = {"concurrency": len(texts), "duration": None}  # all 90 at once, each embedded once
        return ([await measure(False, **served), await measure(True, **served)],
                [await measure(False, **burst), await measure(True, **burst)])

    (served_buckets, served_longest), (burst_buckets, burst_longest) = asyncio.run(both())
    print(f"padded/real tokens, 16 clients: buckets {served_buckets['padded_per_real']:.3f}, longest member "
          f"{served_longest['padded_per_real']:.3f}; all at once: buckets {burst_buckets['padded_per_real']:.3f}, "
          f"longest member {burst_longest['padded_per_real']:.3f}")
    assert served_longest["padded_per_real"] <= 1.2
    assert served_buckets["padded_per_real"] - served_longest["padded_per_real"] > 0.1
    # All 90 at once fills every batch to 8 in file order: the longest of 8 sets the width.
    assert burst_longest["padded_per_real"] <= 1.25
    assert burst_buckets["padded_per_real"] - burst_longest["padded_per_real"] > 0.1
    np.testing.assert_allclose(burst_longest["embeddings"], burst_buckets["embeddings"], atol=1e-5)
