"""Hybrid ranking: the passage cosine, the best sentence's cosine and BM25 fused into one score.

Four signals rank the passages for a question: **dense** (cosine of the question to the whole
passage), **sentence** (cosine to the passage's best sentence: a passage that answers in one
sentence among four others is not diluted by them), **heading** (cosine to the passage's own
heading alone, "Correcting imbalance": it tells a passage on what a fault looks like from the
one on how to fix it, which share most words) and **lexical** (BM25, exact terms). They
have nothing in common in scale (cosines in [-1, 1], BM25 unbounded), so each is first brought
to [0, 1] over the passages of this question (min-max: the best passage 1, the worst 0) and the
results are added with their weights (CombSUM, Fox & Shaw 1994; a convex combination of
normalised scores, which Bruch et al. 2023 found more accurate than rank fusion). BM25's weight
depends on the question: it is scaled by ``coverage ** coverage_exponent``, coverage being the
idf-weighted share of the question's terms that occur in the passages at all (lexical.py), so
a question in the manual's words keeps the keyword signal and one in the technician's own words
is ranked mostly by meaning (docs/rag.md, "Retrieval quality"). A signal with no spread (a
question sharing no word with any passage) adds nothing.

The older reciprocal rank fusion stays available (`method = "rrf"`): each signal adds
``weight / (rrf_k + rank)``, ranks counted from 1, a passage sharing no term with the question
getting no lexical share. [rag] retrieval = "dense" uses the two cosine signals alone,
"lexical" BM25 alone. The first passage's lead over the second (index.py, lead()) is reported with
it; below `ambiguous_margin` it is marked ambiguous, the answer possibly from the wrong one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MODES = ("hybrid", "dense", "lexical")
METHODS = ("minmax", "rrf")


@dataclass(frozen=True)
class Fusion:
    mode: str = "hybrid"
    dense_weight: float = 1.0
    lexical_weight: float = 1.0
    rrf_k: float = 60.0  # method "rrf" only
    method: str = "minmax"
    sentence_weight: float = 1.0  # 0: the passage cosine alone is the dense signal
    coverage_exponent: float = 0.0  # lexical weight x coverage ** this; 0: a fixed weight
    ambiguous_margin: float = 0.1  # a first passage leading the second by less is marked ambiguous
    heading_weight: float = 0.0  # weight of the cosine to the passage's own heading alone; 0: not used


# The shipped defaults ([rag] retrieval settings): equal weights, BM25's scaled by the square root
# of the question's coverage, and the heading's cosine at a quarter weight; chosen on the seen
# question sets, cross-validated between them (docs/rag.md, "Retrieval quality").
DEFAULT_FUSION = Fusion(coverage_exponent=0.5, heading_weight=0.25)
# The default before issue 29 (equal fixed weights), kept for the comparison in tools/eval_retrieval.py.
EQUAL_WEIGHTS = Fusion()
# The default between the two rounds of issue 29 (BM25 weighted by coverage, no heading signal).
COVERAGE_ONLY = Fusion(coverage_exponent=0.5)


def ranks(scores: np.ndarray) -> np.ndarray:
    """1-based rank of every entry, best (highest) first; ties keep index order."""
    order = np.argsort(-scores, kind="stable")
    out = np.empty(len(scores), dtype=np.float64)
    out[order] = np.arange(1, len(scores) + 1)
    return out


def minmax(scores: np.ndarray) -> np.ndarray:
    """Scores mapped to [0, 1] over the passages (all 0 when they do not differ)."""
    scores = scores.astype(np.float64)
    if not len(scores):
        return scores
    low, high = float(scores.min()), float(scores.max())
    if high - low <= 1e-12:
        return np.zeros_like(scores)
    return (scores - low) / (high - low)


def fused_scores(dense: np.ndarray, lexical: np.ndarray, fusion: Fusion,
                 sentence: np.ndarray | None = None, coverage: float = 1.0,
                 heading: np.ndarray | None = None) -> np.ndarray:
    """The score each passage is ranked by under `fusion` (higher is better). `sentence` is each
    passage's best sentence cosine, None when the index has no sentence vectors; `coverage` is
    the share of the question's terms the passages know (Bm25.coverage); `heading` the cosine to
    each passage's own heading, None when the index has no heading vectors."""
    if fusion.mode == "lexical":
        # Passages with no shared term fall back to their dense order, behind every lexical match.
        return np.where(lexical > 0, lexical + 2.0, dense.astype(np.float64))
    signals: list[tuple[np.ndarray, float, np.ndarray | None]] = [(dense, fusion.dense_weight, None)]
    if sentence is not None and fusion.sentence_weight > 0:
        signals.append((sentence, fusion.sentence_weight, None))
    if heading is not None and fusion.heading_weight > 0:
        signals.append((heading, fusion.heading_weight, None))
    lexical_weight = fusion.lexical_weight * coverage ** fusion.coverage_exponent
    if fusion.mode == "hybrid" and lexical_weight > 0:
        signals.append((lexical, lexical_weight, lexical > 0))
    if fusion.mode == "dense" and len(signals) == 1:
        return dense.astype(np.float64)
    out = np.zeros(len(dense), dtype=np.float64)
    for scores, weight, matched in signals:
        if fusion.method == "rrf":
            share = weight / (fusion.rrf_k + ranks(scores))
            out += share if matched is None else np.where(matched, share, 0.0)
        else:
            out += weight * minmax(scores)
    return out
