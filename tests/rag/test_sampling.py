"""Choosing the next token (rag/sampling.py): pure, no model."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from edge_batcher.rag.sampling import SamplingParams, choose


@pytest.mark.parametrize("temperature", [1e-310, 1e-300, 1e-30])
@pytest.mark.parametrize("top_k", [0, 5])
def test_a_tiny_temperature_chooses_the_largest_logit_without_warnings(temperature, top_k):
    """Dividing the logits themselves by 1e-310 overflowed to +-inf, their difference was NaN and
    the token drawn was token 0 (or any other) instead of the most likely."""
    logits = np.random.default_rng(0).normal(size=512).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drawn = {choose(logits, SamplingParams(8, temperature, top_k, 0.9), np.random.default_rng(seed))
                 for seed in range(5)}
    assert drawn == {int(np.argmax(logits))}


def test_draws_follow_the_softmax_at_the_temperature():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
    temperature = 0.7
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    rng = np.random.default_rng(1)
    params = SamplingParams(8, temperature)
    counts = np.bincount([choose(logits, params, rng) for _ in range(20_000)], minlength=len(logits))
    np.testing.assert_allclose(counts / counts.sum(), p, atol=0.015)
    # top-k keeps the k most likely, renormalised
    params = SamplingParams(8, temperature, top_k=2)
    counts = np.bincount([choose(logits, params, rng) for _ in range(10_000)], minlength=len(logits))
    assert counts[2:].sum() == 0
    assert counts[0] / counts[:2].sum() == pytest.approx(p[0] / p[:2].sum(), abs=0.02)
