#!/usr/bin/env python3
"""Retrieval quality of the RAG index on the question sets in docs/corpus: top-1 and top-3 for
dense, lexical and hybrid ranking (docs/rag.md, "Retrieval quality").

    .venv/bin/python tools/eval_retrieval.py                  # the table, with [rag] settings of engines/rag
    .venv/bin/python tools/eval_retrieval.py --tune           # grid over fusion settings, on the dev split only
    .venv/bin/python tools/eval_retrieval.py --misses         # also list the questions ranked wrong

The corpus is split and embedded here exactly as `edge-batcher index add` does, with the minilm
model of --model-repo (default ./engines; built by `make models`). Each question file holds
{"questions": [{"question", "passage", "split"?}]}; "split" is "dev" (used for tuning) or
"test" (never used for tuning); the shipped ten have none and count as dev.
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
from edge_batcher.rag.index import Index, split_file  # noqa: E402

CORPUS = ROOT / "docs" / "corpus"
QUESTION_FILES = ("questions.json", "questions-technician.json")


def load_questions(corpus: Path = CORPUS, files=QUESTION_FILES) -> list[dict]:
    out = []
    for name in files:
        for q in json.loads((corpus / name).read_text(encoding="utf-8"))["questions"]:
            out.append({"split": "dev", **q, "file": name})
    return out


def build_index(embedder: TextEmbeddingEngine, corpus: Path = CORPUS) -> Index:
    passages = [p for path in sorted(corpus.glob("*.md")) for p in split_file(path)]
    return Index(passages, embedder.embed([p.embed_text() for p in passages]), {})


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
    """Every fusion setting of a small grid with its (top-1, top-3) on `questions`, best first."""
    results = []
    for lexical_weight, rrf_k in itertools.product((0.25, 0.5, 0.75, 1.0, 1.5), (1, 5, 10, 20, 60)):
        fusion = Fusion("hybrid", 1.0, lexical_weight, rrf_k)
        r = evaluate(index, vectors, questions, fusion)
        results.append((r["top1_rate"], r["top3_rate"], fusion))
    return sorted(results, key=lambda t: (-t[0], -t[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repo", type=Path, default=ROOT / "engines")
    parser.add_argument("--tune", action="store_true", help="grid over lexical weight and rrf_k on the dev split")
    parser.add_argument("--misses", action="store_true")
    args = parser.parse_args(argv)
    from edge_batcher.rag.pipeline import fusion_from, rag_settings

    embedder = TextEmbeddingEngine(load_model_config(args.model_repo / "minilm"))
    embedder.load()
    index = build_index(embedder)
    questions = load_questions()
    vectors = embedder.embed([q["question"] for q in questions])
    configured = fusion_from(rag_settings(load_model_config(args.model_repo / "rag")))
    if args.tune:
        dev = [i for i, q in enumerate(questions) if q["split"] == "dev"]
        for top1, top3, f in tune(index, vectors[dev], [questions[i] for i in dev])[:10]:
            print(f"dev top-1 {top1:.3f} top-3 {top3:.3f}  lexical_weight={f.lexical_weight} rrf_k={f.rrf_k}")
        return 0
    subsets = {"shipped ten": lambda q: q["file"] == "questions.json",
               "technician dev": lambda q: q["file"] != "questions.json" and q["split"] == "dev",
               "technician test": lambda q: q["file"] != "questions.json" and q["split"] == "test",
               "all": lambda q: True}
    print(f"hybrid = {configured}")
    print("| ranking | " + " | ".join(f"{name} (n)" for name in subsets) + " |")
    for mode in ("dense", "lexical", "hybrid"):
        fusion = Fusion(mode, configured.dense_weight, configured.lexical_weight, configured.rrf_k)
        cells = []
        for name, keep in subsets.items():
            idx = [i for i, q in enumerate(questions) if keep(q)]
            r = evaluate(index, vectors[idx], [questions[i] for i in idx], fusion)
            cells.append(f"{r['top1']}/{r['n']} ({r['top1_rate']:.0%}), top-3 {r['top3']}/{r['n']}")
            if args.misses and name == "all":
                for m in r["misses"]:
                    print(f"  {mode} miss: {m['question']!r} -> {m['got']} (expected {m['expected']})")
        print(f"| {mode} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
