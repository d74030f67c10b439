"""Padding of the embedding model, before and after, side by side in one run.

Loads the minilm model through the full runtime (queue, bucket scheduling, worker thread) twice
per repeat: once padded to the length buckets (the engine's `accepts_any_length` hook forced
False, what every batch got before) and once as the engine declares (ONNX Runtime with a dynamic
sequence dimension: each batch padded to its longest member, scheduler/batch.py). Closed-loop
callers each send one question at a time, cycling through the question set; it reports the
median embeddings/s and the padded/real token ratio (all token slots of the batches run / the
slots holding text) of each way, and their ratio.

    .venv/bin/python tools/bench_embedding_padding.py --models engines --duration 5 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # edge_batcher from a checkout, installed or not

from edge_batcher.metrics import Metrics  # noqa: E402
from edge_batcher.runtime import discover_models, load_runner  # noqa: E402
from edge_batcher.types import InferRequest  # noqa: E402

CORPUS = ROOT / "docs" / "corpus"


def question_set() -> list[str]:
    """The 90 questions of tools/eval_retrieval.py: the shipped ten and the 80 technician ones."""
    questions = []
    for name in ("questions.json", "questions-technician.json"):
        questions += [q["question"] for q in json.loads((CORPUS / name).read_text())["questions"]]
    return questions


async def measure(repo: Path, model: str, texts: list[str], *, any_length: bool, concurrency: int,
                  duration: float | None) -> dict:
    """Embed `texts` through the runtime: closed-loop callers for `duration` seconds, or each
    text once (all submitted at once, in order) when duration is None. Returns embeddings/s,
    the padded/real token ratio and, for one pass, the embeddings in text order."""
    (mc,) = discover_models(repo, [model])
    loop = asyncio.get_running_loop()
    runner = await loop.run_in_executor(None, load_runner, mc, Metrics(), True)
    for engine in runner.engines:
        engine.accepts_any_length = engine.accepts_any_length and any_length
    # Warm-up batches are all padding and not counted; start the counters at zero anyway.
    for engine in runner.engines:
        engine.real_tokens = engine.padded_tokens = 0
    await runner.start()

    def request(text: str) -> InferRequest:
        return InferRequest(model, {"text": np.array([text.encode()], dtype=object)})

    embeddings = None
    t0 = loop.time()
    if duration is None:
        results = await asyncio.gather(*(runner.infer(request(t)) for t in texts))
        done = len(texts)
        embeddings = np.concatenate([r.outputs["embedding"] for r in results])
    else:
        stop_at = t0 + duration
        counts = [0] * concurrency

        async def caller(k: int) -> None:
            i = k
            while loop.time() < stop_at:
                await runner.infer(request(texts[i % len(texts)]))
                counts[k] += 1
                i += concurrency

        await asyncio.gather(*(caller(k) for k in range(concurrency)))
        done = sum(counts)
    wall = loop.time() - t0
    real = sum(e.real_tokens for e in runner.engines)
    padded = sum(e.padded_tokens for e in runner.engines)
    await runner.close()
    return {"embeddings_per_s": done / wall, "padded_per_real": padded / real if real else 0.0,
            "embeddings": embeddings}


async def compare(repo: Path, model: str, concurrency: int, duration: float, repeat: int) -> dict:
    texts = question_set()
    runs: dict[str, list[dict]] = {"buckets": [], "any_length": []}
    for _ in range(repeat):  # alternating, so drift of the machine hits both alike
        for label, results in runs.items():
            results.append(await measure(repo, model, texts, any_length=label == "any_length",
                                         concurrency=concurrency, duration=duration))
    out = {label: {"embeddings_per_s": statistics.median(r["embeddings_per_s"] for r in rs),
                   "padded_per_real": statistics.median(r["padded_per_real"] for r in rs)}
           for label, rs in runs.items()}
    out["speedup"] = out["any_length"]["embeddings_per_s"] / out["buckets"]["embeddings_per_s"]
    out.update(questions=len(texts), concurrency=concurrency, duration_s=duration, repeat=repeat)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=str(ROOT / "engines"), help="model repository (default ./engines)")
    p.add_argument("--model", default="minilm")
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop callers (default 16)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per run (default 5)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each way, medians reported (default 3)")
    args = p.parse_args(argv)
    r = asyncio.run(compare(Path(args.models).resolve(), args.model, args.concurrency, args.duration, args.repeat))
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
