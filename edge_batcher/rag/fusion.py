"""Hybrid ranking: the dense (cosine) and lexical (BM25) rankings fused by reciprocal rank fusion.

RRF (Cormack et al., 2009) needs no score calibration between the two retrievers, which have
nothing in common (cosine in [-1, 1], BM25 unbounded): each passage scores

    dense_weight / (rrf_k + dense_rank) + lexical_weight / (rrf_k + lexical_rank)

with ranks counted from 1. A passage sharing no term with the question has no lexical rank and
gets no lexical share. A small rrf_k lets the first places of either ranking dominate; the
usual 60 flattens them. [rag] retrieval = "dense" or "lexical" uses one ranking alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MODES = ("hybrid", "dense", "lexical")


@dataclass(frozen=True)
class Fusion:
    mode: str = "hybrid"
    dense_weight: float = 1.0
    lexical_weight: float = 1.0
    rrf_k: float = 60.0


# The shipped defaults ([rag] retrieval settings): chosen on the dev split of
# docs/corpus/questions-technician.json with tools/eval_retrieval.py --tune (docs/rag.md).
DEFAULT_FUSION = Fusion("hybrid", dense_weight=1.0, lexical_weight=0.5, rrf_k=5.0)


def ranks(scores: np.ndarray) -> np.ndarray:
    """1-based rank of every entry, best (highest) first; ties keep index order."""
    order = np.argsort(-scores, kind="stable")
    out = np.empty(len(scores), dtype=np.float64)
    out[order] = np.arange(1, len(scores) + 1)
    return out


def fused_scores(dense: np.ndarray, lexical: np.ndarray, fusion: Fusion) -> np.ndarray:
    """The score each passage is ranked by under `fusion` (higher is better)."""
    if fusion.mode == "dense":
        return dense.astype(np.float64)
    if fusion.mode == "lexical":
        # Passages with no shared term fall back to their dense order, behind every lexical match.
        return np.where(lexical > 0, lexical + 2.0, dense.astype(np.float64))
    out = fusion.dense_weight / (fusion.rrf_k + ranks(dense))
    matched = lexical > 0
    out[matched] += fusion.lexical_weight / (fusion.rrf_k + ranks(lexical)[matched])
    return out
