#!/usr/bin/env python3
"""Retrieval quality of the RAG index on the question sets in docs/corpus: top-1 and top-3 for
dense, lexical and hybrid ranking (docs/rag.md, "Retrieval quality").

    .venv/bin/python tools/eval_retrieval.py                  # the table, with [rag] settings of engines/rag
    .venv/bin/python tools/eval_retrieval.py --tune           # grid over fusion weights, on the dev split only
    .venv/bin/python tools/eval_retrieval.py --misses         # also list the questions ranked wrong
    .venv/bin/python tools/eval_retrieval.py --holdout        # add the held-out set (questions-holdout.json)

The corpus is split and embedded here exactly as `edge-batcher index add` does, with the minilm
model of --model-repo (default ./engines; built by `make models`). Each question file holds
{"questions": [{"question", "passage", "split"?}]}; "split" is "dev" (used for tuning) or
"test" (never used for tuning); the shipped ten have none and count as dev. The held-out set
(questions-holdout.json) is read only with --holdout: it was written before the retrieval of
issue 21 was changed and is evaluated once, after the settings were fixed, never while choosing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_batcher.config import load_model_config  # noqa: E402
from edge_batcher.rag.embed import TextEmbeddingEngine  # noqa: E402
from edge_batcher.rag.fusion import Fusion  # noqa: E402
from edge_batcher.rag.index import Index, embed_passages  # noqa: E402
from edge_batcher.rag.passages import split_file  # noqa: E402

CORPUS = ROOT / "docs" / "corpus"
QUESTION_FILES = ("questions.json", "questions-technician.json")
HOLDOUT_FILE = "questions-holdout.json"


def load_questions(corpus: Path = CORPUS, files=QUESTION_FILES) -> list[dict]:
    out = []
    for name in files:
        for q in json.loads((corpus / name).read_text(encoding="utf-8"))["questions"]:
            out.append({"split": "dev", **q, "file": name})
    return out


def build_index(embedder: TextEmbeddingEngine, corpus: Path = CORPUS) -> Index:
    """The corpus as `edge-batcher index add` builds it: passages, their vectors and their sentences'."""
    passages = [p for path in sorted(corpus.glob("*.md")) for p in split_file(path)]
    vectors, sentences = embed_passages(passages, embedder.embed)
    return Index(passages, vectors, {}, sentences=sentences)


def evaluate(index: Index, vectors, questions: list[dict], fusion: Fusion) -> dict:
    """top-1 / top-3 hit rates of `questions` (their embeddings in `vectors`) under `fusion`."""
    hits = index.search_fused(vectors, [q["question"] for q in questions], 3, fusion)
    top1 = top3 = 0
    misses = []
    for q, row in zip(questions, hits):
        ids = [h.passage.id for h in row]
        top1 += ids[0] == q["passage"]
        top3 += q["passage"] in ids
        if ids[0] != q["passage"]:
            misses.append({"question": q["question"], "expected": q["passage"], "got": ids})
    n = len(questions)
    return {"n": n, "top1": top1, "top3": top3, "top1_rate": top1 / n if n else 0.0,
            "top3_rate": top3 / n if n else 0.0, "misses": misses}


def tune(index: Index, vectors, questions: list[dict]) -> list[tuple[float, float, Fusion]]:
    """Every weighting of a small grid (min-max fusion) with its (top-1, top-3) on `questions`,
    best first: how sensitive the result is to the weights (the shipped ones are all 1, untuned)."""
    results = []
    for sentence_weight, lexical_weight in itertools.product((0.0, 0.5, 1.0, 2.0), (0.0, 0.5, 1.0, 1.5, 2.0)):
        fusion = Fusion("hybrid", 1.0, lexical_weight, 60.0, "minmax", sentence_weight)
        r = evaluate(index, vectors, questions, fusion)
        results.append((r["top1_rate"], r["top3_rate"], fusion))
    return sorted(results, key=lambda t: (-t[0], -t[1]))


def rankings(configured: Fusion) -> dict[str, Fusion]:
    """The rankings compared in docs/rag.md, by name."""
    return {"dense (passage cosine)": Fusion("dense", sentence_weight=0.0),
            "dense + best sentence": Fusion("dense", configured.dense_weight, 0.0, 60.0, "minmax",
                                            configured.sentence_weight or 1.0),
            "lexical (BM25)": Fusion("lexical"),
            "hybrid RRF, passage cosine (before)": Fusion("hybrid", 1.0, 0.5, 5.0, "rrf", 0.0),
            "hybrid (configured)": configured}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repo", type=Path, default=ROOT / "engines")
    parser.add_argument("--tune", action="store_true", help="grid over lexical weight and rrf_k on the dev split")
    parser.add_argument("--misses", action="store_true")
    parser.add_argument("--holdout", action="store_true", help=f"also evaluate {HOLDOUT_FILE} (once, at the end)")
    args = parser.parse_args(argv)
    from edge_batcher.rag.settings import fusion_from, rag_settings

    embedder = TextEmbeddingEngine(load_model_config(args.model_repo / "minilm"))
    embedder.load()
    index = build_index(embedder)
    questions = load_questions(files=QUESTION_FILES + ((HOLDOUT_FILE,) if args.holdout else ()))
    vectors = embedder.embed([q["question"] for q in questions])
    configured = fusion_from(rag_settings(load_model_config(args.model_repo / "rag")))
    if args.tune:
        dev = [i for i, q in enumerate(questions) if q["split"] == "dev"]
        for top1, top3, f in tune(index, vectors[dev], [questions[i] for i in dev]):
            print(f"dev top-1 {top1:.3f} top-3 {top3:.3f}  sentence_weight={f.sentence_weight} "
                  f"lexical_weight={f.lexical_weight}")
        return 0
    subsets = {"shipped ten": lambda q: q["file"] == "questions.json",
               "technician dev": lambda q: q["file"] != "questions.json" and q["split"] == "dev",
               "technician test": lambda q: q["file"] == "questions-technician.json" and q["split"] == "test",
               "dev + test": lambda q: q["file"] in QUESTION_FILES}
    if args.holdout:
        subsets["held out"] = lambda q: q["file"] == HOLDOUT_FILE
        subsets["all"] = lambda q: True
    print(f"hybrid = {configured}")
    print("| ranking | " + " | ".join(f"{name} (n)" for name in subsets) + " |")
    for mode, fusion in rankings(configured).items():
        cells = []
        for name, keep in subsets.items():
            idx = [i for i, q in enumerate(questions) if keep(q)]
            r = evaluate(index, vectors[idx], [questions[i] for i in idx], fusion)
            cells.append(f"{r['top1']}/{r['n']} ({r['top1_rate']:.0%}), top-3 {r['top3']}/{r['n']}")
            if args.misses and name == "dev + test":
                for m in r["misses"]:
                    print(f"  {mode} miss: {m['question']!r} -> {m['got']} (expected {m['expected']})")
        print(f"| {mode} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
