"""Extractive answers: the one or two sentences of the retrieved passages that answer the question.

Without a generator, the answer is not the passages verbatim but their best sentences: every
sentence of the passage ranked first ([rag] answer_passages), embedded with its passage's heading
in front (so "It can slip" still knows it is about magnet mounts) by the same embedding model as
the question, is ranked by cosine to the question. The index holds those vectors (sentences.npz,
written by `index add`); only an index without them has the sentences embedded at question time,
through the core scheduler.
The best sentence is the answer; the runner-up joins it when it scores within `margin` of the
best (two halves of one answer, e.g. a limit and its exception). Chosen sentences are given in
document order, each followed by the number of its passage, and a last line names those
passages ([n] title (id)). When the first two passages ranked almost alike (the fusion's
close-call flag, `Hit.ambiguous`), a line before it says so and names both: the answer may come
from the wrong one. The full passages stay in the `sources` output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .index import Hit
from .sentences import embed_text, split_sentences


@dataclass
class Sentence:
    hit: int  # index into the hits (the passage's rank - 1)
    position: int  # order within the passage
    text: str

    def embed_text(self, hits: list[Hit]) -> str:
        return embed_text(hits[self.hit].passage.title, self.text)


def sentences(hits: list[Hit]) -> list[Sentence]:
    """The sentences of the passages (sentences.py: list items count; code blocks stay whole)."""
    return [Sentence(h, n, text) for h, hit in enumerate(hits)
            for n, text in enumerate(split_sentences(hit.passage.text))]


def quoted_sentences(hits: list[Hit], answer_passages: int) -> tuple[list[Hit], list[Sentence]]:
    """The passages an extractive answer may quote (the first `answer_passages`, [rag]) and their
    sentences, the candidates it chooses from."""
    quoted = hits[:answer_passages]
    return quoted, sentences(quoted)


def stored_vectors(hits: list[Hit], candidates: list[Sentence]) -> np.ndarray | None:
    """The index's vectors of the candidates, in their order, or None when a hit has none or not
    one per sentence (an index from another sentence split): then they are embedded instead."""
    counts = [0] * len(hits)
    for c in candidates:
        counts[c.hit] += 1
    parts = []
    for hit, count in zip(hits, counts):
        vectors = hit.sentence_vectors
        if vectors is None or len(vectors) != count:
            return None
        parts.append(vectors)
    return np.concatenate(parts) if parts else None


def choose(question: np.ndarray, candidates: list[Sentence], vectors: np.ndarray, *, max_sentences: int = 2,
           margin: float = 0.1) -> list[tuple[Sentence, float]]:
    """The best sentence, and up to max_sentences - 1 more scoring within `margin` of it;
    in document order (passage rank, then position)."""
    if not candidates:
        return []
    q: np.ndarray = np.asarray(question, dtype=np.float32).reshape(-1)  # annotated: numpy 2.2 types it 1-d
    q = q / max(float(np.linalg.norm(q)), 1e-12)
    v = np.asarray(vectors, dtype=np.float32)
    scores = (v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)) @ q
    order = np.argsort(-scores, kind="stable")
    best = float(scores[order[0]])
    chosen = [int(i) for i in order[:max_sentences] if scores[i] >= best - margin]
    chosen.sort(key=lambda i: (candidates[i].hit, candidates[i].position))
    return [(candidates[i], float(scores[i])) for i in chosen]


# The extractive answer to a question none of whose passages reaches [rag] min_score (or of an
# empty index): said, not left blank, for whoever reads the answer alone.
NO_PASSAGE = "No passage of the indexed documents is close enough to this question to answer it."


def answer_text(chosen: list[tuple[Sentence, float]], hits: list[Hit]) -> str:
    """'<sentence> [n] <sentence> [m]', a close-call line when the first two passages ranked
    almost alike, and a line naming the cited passages."""
    if not chosen:
        return ""
    body = " ".join(f"{s.text} [{s.hit + 1}]" for s, _ in chosen)
    cited = sorted({s.hit for s, _ in chosen})
    names = "; ".join(f"[{h + 1}] {_heading(hits[h])} ({hits[h].passage.id})" for h in cited)
    return f"{body}\n{close_call_line(hits)}Sources: {names}"


def close_call_line(hits: list[Hit]) -> str:
    """'Close call: ...' and a newline when the first passage leads the second by less than the
    fusion's ambiguous_margin, else ''. Both are named, cited or not: the reader should check the
    second, which is most often the right one when the first is wrong (docs/rag.md)."""
    first = hits[0] if hits else None
    if first is None or not first.ambiguous or len(hits) < 2:
        return ""
    lead = f" (lead {first.margin:.0%})" if first.margin is not None else ""
    return (f"Close call: [1] {_heading(first)} and [2] {_heading(hits[1])} ranked almost alike{lead}; "
            "the answer may be in either\n")


def _heading(hit: Hit) -> str:
    return hit.passage.title.rsplit(" > ", 1)[-1]
