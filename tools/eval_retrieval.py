#!/usr/bin/env python3
"""Retrieval quality of the RAG index on the question sets in docs/corpus: top-1 and top-3 of
every ranking on every set, side by side, and the search time per question (docs/rag.md,
"Retrieval quality"). The last two rows are answers, not rankings: the passage whose sentence
the extractive answer shows first, as the rag model's settings make it and quoting any of the
passages retrieved (docs/rag.md, "Extractive answers").

    .venv/bin/python tools/eval_retrieval.py            # dev splits only: what settings are chosen on
    .venv/bin/python tools/eval_retrieval.py --test     # add the test splits and the held-out set (once)
    .venv/bin/python tools/eval_retrieval.py --misses   # also list the questions the shipped default ranks wrong
    .venv/bin/python tools/eval_retrieval.py --tune     # grid over lexical weight and coverage exponent, dev only
    .venv/bin/python tools/eval_retrieval.py --tune-heading  # heading weight grid on every set, cross-validated
    .venv/bin/python tools/eval_retrieval.py --test --questions FILE.json  # plus a blind set, as its own column

The corpus is split and embedded here exactly as `edge-batcher index add` does, with the minilm
model of --model-repo (default ./engines; built by `make models`). Each question file holds
{"questions": [{"question", "passage", "split"?}]}; "split" is "dev" (may be used for choosing
settings), "test" or "holdout" (never used for choosing: evaluated with --test, once, after the
settings were fixed); the shipped ten have none and count as dev. A file given with --questions
(same format, "passage" naming a passage id of the corpus) counts as held out whatever its
splits say and is reported as a column of its own, named after the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_batcher.config import load_model_config  # noqa: E402
from edge_batcher.rag.embed import TextEmbeddingEngine  # noqa: E402
from edge_batcher.rag.extract import choose, quoted_sentences, stored_vectors  # noqa: E402
from edge_batcher.rag.fusion import COVERAGE_ONLY, EQUAL_WEIGHTS, Fusion, minmax  # noqa: E402
from edge_batcher.rag.index import Index, embed_passages, on_topic  # noqa: E402
from edge_batcher.rag.passages import split_file  # noqa: E402
from edge_batcher.rag.spelling import Speller, tokenizer_words  # noqa: E402

CORPUS = ROOT / "docs" / "corpus"
QUESTION_FILES = ("questions.json", "questions-technician.json", "questions-paraphrase.json",
                  "questions-holdout.json", "questions-paraphrase-holdout.json", "questions-paraphrase-blind.json",
                  "questions-paraphrase-blind2.json", "questions-paraphrase-blind3.json",
                  "questions-paraphrase-blind4.json", "questions-paraphrase-blind5.json")
# column name -> (file, split); None: the whole file
SETS = {"shipped ten": ("questions.json", None),
        "technician dev": ("questions-technician.json", "dev"),
        "paraphrase dev": ("questions-paraphrase.json", "dev"),
        "technician test": ("questions-technician.json", "test"),
        "paraphrase test": ("questions-paraphrase.json", "test"),
        "held out": ("questions-holdout.json", None),
        "paraphrase held out": ("questions-paraphrase-holdout.json", None),
        "paraphrase blind": ("questions-paraphrase-blind.json", None),
        "paraphrase blind 2": ("questions-paraphrase-blind2.json", None),
        "paraphrase blind 3": ("questions-paraphrase-blind3.json", None),
        "paraphrase blind 4": ("questions-paraphrase-blind4.json", None),
        "paraphrase blind 5": ("questions-paraphrase-blind5.json", None)}
DEV_SETS = ("shipped ten", "technician dev", "paraphrase dev")

# A ranking: (index, query vectors, question texts) -> ids of the top 3 for each question.
Ranking = Callable[[Index, np.ndarray, list[str]], list[list[str]]]


def load_questions(corpus: Path = CORPUS, files=QUESTION_FILES, extra: tuple[Path, ...] = ()) -> list[dict]:
    """The questions of `files` in `corpus`, then those of the `extra` files (split "holdout",
    file: the path as given)."""
    out = []
    for name in files:
        for q in json.loads((corpus / name).read_text(encoding="utf-8"))["questions"]:
            out.append({"split": "dev", **q, "file": name})
    for path in extra:
        for q in json.loads(Path(path).read_text(encoding="utf-8"))["questions"]:
            out.append({**q, "split": "holdout", "file": str(path)})
    return out


def in_set(question: dict, name: str, sets: dict | None = None) -> bool:
    file, split = (sets or SETS)[name]
    return question["file"] == file and (split is None or question["split"] == split)


def build_index(embedder: TextEmbeddingEngine, corpus: Path = CORPUS) -> Index:
    """The corpus as `edge-batcher index add` builds it: passages, their vectors, their sentences'
    and their headings'."""
    passages = [p for path in sorted(corpus.glob("*.md")) for p in split_file(path)]
    vectors, sentences, headings = embed_passages(passages, embedder.embed)
    return Index(passages, vectors, {}, sentences=sentences, headings=headings)


def fused(fusion: Fusion) -> Ranking:
    def rank(index: Index, vectors: np.ndarray, texts: list[str]) -> list[list[str]]:
        return [[h.passage.id for h in row] for row in index.search_fused(vectors, texts, 3, fusion)]
    return rank


def _signals(index: Index, vectors: np.ndarray, texts: list[str]):
    """Per question: min-max normalised passage cosine, best-sentence cosine and BM25."""
    vectors = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    dense = vectors @ index.embeddings.T
    sentence = index.best_sentence(dense, vectors)
    assert sentence is not None
    for n, text in enumerate(texts):
        yield n, minmax(dense[n]), minmax(sentence[n]), minmax(index.lexical.scores(text))


def reranked(k: int, lexical_weight: float = 1.0) -> Ranking:
    """Candidate: the equal-weight hybrid's top k, re-scored by passage + best-sentence cosine."""
    def rank(index: Index, vectors: np.ndarray, texts: list[str]) -> list[list[str]]:
        out = []
        for _, d, s, lex in _signals(index, vectors, texts):
            top = np.argsort(-(d + s + lexical_weight * lex), kind="stable")[:k]
            top = top[np.argsort(-(d[top] + s[top]), kind="stable")]
            out.append([index.passages[i].id for i in top[:3]])
        return out
    return rank


def feedback(beta: float, lexical_weight: float = 0.5, depth: int = 3) -> Ranking:
    """Candidate: pseudo-relevance feedback (Rocchio): the question vector moved towards the mean
    of the hybrid's first `depth` passages, then ranked again."""
    def rank(index: Index, vectors: np.ndarray, texts: list[str]) -> list[list[str]]:
        out = []
        unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        for n, d, s, lex in _signals(index, vectors, texts):
            first = np.argsort(-(d + s + lexical_weight * lex), kind="stable")[:depth]
            moved = unit[n] + beta * index.embeddings[first].mean(axis=0)
            d2 = minmax(index.embeddings @ (moved / np.linalg.norm(moved)))
            out.append([index.passages[i].id for i in np.argsort(-(d2 + s + lexical_weight * lex), kind="stable")[:3]])
        return out
    return rank


def answered(fusion: Fusion, settings) -> Ranking:
    """The extractive answer the daemon gives with `fusion` and the rag model's settings: the
    passage whose sentence the answer's text shows first, then the other passages retrieved (the
    same top-3 as the ranking; only the first place can differ)."""
    def rank(index: Index, vectors: np.ndarray, texts: list[str]) -> list[list[str]]:
        out = []
        for vector, row in zip(vectors, index.search_fused(vectors, texts, settings.top_k, fusion)):
            hits = on_topic(row, settings.min_score)
            ids = [h.passage.id for h in hits]
            quoted, candidates = quoted_sentences(hits, settings.answer_passages)
            if candidates:
                chosen = choose(vector, candidates, stored_vectors(quoted, candidates),
                                max_sentences=settings.answer_sentences, margin=settings.sentence_margin)
                first = quoted[chosen[0][0].hit].passage.id
                ids = [first] + [i for i in ids if i != first]
            out.append(ids[:3])
        return out
    return rank


def spelling_corrected(rank: Ranking, speller: Speller, embed) -> Ranking:
    """`rank` on the questions as the daemon ranks them: misspelt words corrected first
    (rag/spelling.py), the corrected questions embedded again by `embed`."""
    def ranked(index: Index, vectors: np.ndarray, texts: list[str]) -> list[list[str]]:
        corrected = [speller.correct(t) for t in texts]
        changed = [i for i, (a, b) in enumerate(zip(texts, corrected)) if a != b]
        if changed:
            vectors = vectors.copy()
            vectors[changed] = embed([corrected[i] for i in changed])
        return rank(index, vectors, corrected)
    return ranked


def speller_for(index: Index, embedder: TextEmbeddingEngine) -> Speller:
    """The daemon's speller for this index and embedding model (rag/pipeline.py builds the same)."""
    return Speller.for_index(tokenizer_words(embedder.tokenizer.vocabulary()), index.passages)


def rankings(configured: Fusion, speller: Speller | None = None, embed=None, settings=None) -> dict[str, Ranking]:
    """The rankings compared in docs/rag.md, by name: single methods first, then the hybrids;
    with a speller, the shipped default corrects the questions' spelling first, as the daemon
    does, and the row without it is shown too; with the rag model's settings, a last row for
    the passage its extractive answer quotes first."""
    extra = {}
    if settings is not None:
        for label, answer_settings in (
                ("extractive answer quoting any passage retrieved (before 2026-11-27): the one it quotes first",
                 dataclasses.replace(settings, answer_passages=settings.top_k)),
                ("extractive answer (as configured): the passage it quotes first", settings)):
            answer = answered(configured, answer_settings)
            extra[label] = spelling_corrected(answer, speller, embed) if speller is not None else answer
    return {"dense (passage cosine)": fused(Fusion("dense", sentence_weight=0.0)),
            "dense + best sentence": fused(Fusion("dense", 1.0, 0.0, 60.0, "minmax", 1.0)),
            "lexical (BM25)": fused(Fusion("lexical")),
            "hybrid RRF, passage cosine": fused(Fusion("hybrid", 1.0, 0.5, 5.0, "rrf", 0.0)),
            "hybrid, equal weights (old default)": fused(EQUAL_WEIGHTS),
            "hybrid, lexical weight 0.5": fused(Fusion(lexical_weight=0.5)),
            "hybrid top-3 re-scored by sentence": reranked(3),
            "hybrid + feedback (Rocchio 0.2)": feedback(0.2),
            "round 1 choice: 0.5 x coverage^0.5 (chosen on dev)": fused(Fusion(lexical_weight=0.5,
                                                                               coverage_exponent=0.5)),
            "round 2: 1 x coverage^0.5 (default before the heading)": fused(COVERAGE_ONLY),
            "round 2 + heading 1 (equal weight)": fused(Fusion(coverage_exponent=0.5, heading_weight=1.0)),
            "round 2 + heading 0.5": fused(Fusion(coverage_exponent=0.5, heading_weight=0.5)),
            "round 2 + heading 0.25": fused(Fusion(coverage_exponent=0.5, heading_weight=0.25)),
            **({"shipped default without spelling correction": fused(configured),
                "shipped default (as configured)": spelling_corrected(fused(configured), speller, embed)}
               if speller is not None else {"shipped default (as configured)": fused(configured)}),
            **extra}


SINGLE = ("dense (passage cosine)", "dense + best sentence", "lexical (BM25)")


def top_hits(ranked: list[list[str]], questions: list[dict]) -> tuple[int, int]:
    return (sum(ids[:1] == [q["passage"]] for ids, q in zip(ranked, questions)),  # none retrieved: a miss
            sum(q["passage"] in ids for ids, q in zip(ranked, questions)))


def search_time(index: Index, vectors: np.ndarray, texts: list[str], fusions: dict[str, Fusion],
                repeats: int = 5) -> dict[str, float]:
    """Median seconds of one question's search (BM25 + vectors + fusion; the question already
    embedded) under each fusion, interleaved so that every fusion sees the same machine load."""
    times: dict[str, list[float]] = {name: [] for name in fusions}
    for _ in range(repeats):
        for n in range(len(texts)):
            for name, fusion in fusions.items():
                t0 = time.perf_counter()
                index.search_fused(vectors[n:n + 1], texts[n:n + 1], 3, fusion)
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def embed_time(embedder: TextEmbeddingEngine, texts: list[str], repeats: int = 3) -> float:
    """Median seconds to embed one question (what every ranking pays first)."""
    times = []
    for _ in range(repeats):
        for text in texts:
            t0 = time.perf_counter()
            embedder.embed([text])
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repo", type=Path, default=ROOT / "engines")
    parser.add_argument("--test", action="store_true", help="add the test splits and held-out sets (once, at the end)")
    parser.add_argument("--tune", action="store_true", help="grid over lexical weight and coverage exponent, dev only")
    parser.add_argument("--tune-heading", action="store_true",
                        help="heading weight grid on every question file, cross-validated between the files")
    parser.add_argument("--misses", action="store_true")
    parser.add_argument("--questions", type=Path, action="append", default=[], metavar="FILE",
                        help="a further question file, evaluated as held out in a column of its own (repeatable)")
    args = parser.parse_args(argv)
    from edge_batcher.rag.settings import fusion_from, rag_settings

    embedder = TextEmbeddingEngine(load_model_config(args.model_repo / "minilm"))
    embedder.load()
    index = build_index(embedder)
    questions = load_questions(extra=tuple(args.questions))
    known = {p.id for p in index.passages}
    for q in questions:
        if q["passage"] not in known:
            parser.error(f"{q['file']}: {q['question']!r} names passage {q['passage']!r}, "
                         "which the corpus does not have")
    vectors = embedder.embed([q["question"] for q in questions])
    settings = rag_settings(load_model_config(args.model_repo / "rag"))
    configured = fusion_from(settings)
    speller = speller_for(index, embedder) if settings.correct_spelling else None
    sets = dict(SETS)
    for path in args.questions:
        sets[f"{path.stem} (given)"] = (str(path), None)
    columns = (list(SETS) if args.test else list(DEV_SETS)) + [name for name in sets if name not in SETS]
    members = {name: [i for i, q in enumerate(questions) if in_set(q, name, sets)] for name in columns}

    def score(rank: Ranking, name: str) -> tuple[int, int]:
        idx = members[name]
        return top_hits(rank(index, vectors[idx], [questions[i]["question"] for i in idx]), [questions[i] for i in idx])

    if args.tune:
        for lexical_weight, exponent in itertools.product((0.25, 0.35, 0.5, 0.75, 1.0), (0.0, 0.5, 1.0, 2.0)):
            fusion = Fusion(lexical_weight=lexical_weight, coverage_exponent=exponent)
            cells = [score(fused(fusion), name) for name in DEV_SETS]
            print(f"lexical_weight={lexical_weight} coverage_exponent={exponent}: " +
                  ", ".join(f"{n} {t1}/{len(members[n])} (top-3 {t3})" for n, (t1, t3) in zip(DEV_SETS, cells)) +
                  f"; dev top-1 {sum(t1 for t1, _ in cells)}")
        return 0
    if args.tune_heading:
        return tune_heading(index, vectors, questions)
    print(f"shipped default = {configured}")
    print("| ranking | " + " | ".join(f"{name} ({len(members[name])})" for name in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for label, rank in rankings(configured, speller, embedder.embed, settings).items():
        cells = []
        for name in columns:
            t1, t3 = score(rank, name)
            cells.append(f"{t1} ({t1 / len(members[name]):.0%}), top-3 {t3}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    if args.misses:
        for name in columns:
            idx = members[name]
            shipped = spelling_corrected(fused(configured), speller, embedder.embed) if speller else fused(configured)
            ranked = shipped(index, vectors[idx], [questions[i]["question"] for i in idx])
            for i, ids in zip(idx, ranked):
                if ids[0] != questions[i]["passage"]:
                    print(f"  {name} miss: {questions[i]['question']!r} -> {ids} (expected {questions[i]['passage']})")
    texts = [q["question"] for q in questions]
    medians = search_time(index, vectors, texts, {"old default": EQUAL_WEIGHTS, "before heading": COVERAGE_ONLY,
                                                  "configured": configured})
    embed = embed_time(embedder, texts[:40])
    old, before, new = medians["old default"], medians["before heading"], medians["configured"]
    print(f"\nper question, median over {len(texts)} questions x 5, side by side: search old default "
          f"{old * 1e3:.3f} ms, before the heading {before * 1e3:.3f} ms, configured {new * 1e3:.3f} ms (ratio to "
          f"before the heading {new / before:.2f}); embedding the question {embed * 1e3:.2f} ms; embed + search "
          f"{(embed + before) * 1e3:.2f} -> {(embed + new) * 1e3:.2f} ms ({(embed + new) / (embed + before):.3f}x)")
    return 0


HEADING_GRID = (0.0, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.75, 1.0)


def tune_heading(index: Index, vectors: np.ndarray, questions: list[dict]) -> int:
    """Top-1 per question file for each heading weight (on top of the coverage-weighted hybrid),
    and the weight each half of the files would choose, checked on the other half, both ways; then
    leaving out one file at a time. Every seen file takes part (issue 29's second round)."""
    files = list(QUESTION_FILES)
    texts = [q["question"] for q in questions]
    right: dict[float, np.ndarray] = {}
    for weight in HEADING_GRID:
        ranked = fused(Fusion(coverage_exponent=0.5, heading_weight=weight))(index, vectors, texts)
        right[weight] = np.array([ids[0] == q["passage"] for ids, q in zip(ranked, questions)])
    of = np.array([q["file"] for q in questions])
    for weight in HEADING_GRID:
        print(f"heading_weight={weight}: " + ", ".join(f"{f} {int(right[weight][of == f].sum())}/{int((of == f).sum())}"
                                                      for f in files) + f"; all {int(right[weight].sum())}")

    def choose(mask: np.ndarray) -> float:  # the best on `mask`, ties to the smaller weight
        return max(HEADING_GRID, key=lambda w: (int(right[w][mask].sum()), -w))

    first = np.isin(of, files[:3])
    for name, train in (("shipped ten + technician + paraphrase", first), ("the two held-out files", ~first)):
        weight = choose(train)
        print(f"chosen on {name}: {weight} ({int(right[weight][train].sum())} vs {int(right[0.0][train].sum())} "
              f"without); on the other files {int(right[weight][~train].sum())} vs {int(right[0.0][~train].sum())} "
              f"without, of {int((~train).sum())}")
    for f in files:
        weight = choose(of != f)
        print(f"leaving out {f}: chosen {weight}; on it {int(right[weight][of == f].sum())} vs "
              f"{int(right[0.0][of == f].sum())} without, of {int((of == f).sum())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
