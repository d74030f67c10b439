#!/usr/bin/env python3
"""Generation speed of the daemon's generator (GenerationService: continuous batching over the
ONNX model built by tools/build_smollm2.py) against llama.cpp (llama-cpp-python) on the same
GGUF, same threads, in one run: for 1, 4 and 8 concurrent sequences (prompt 256 tokens, 64 new,
greedy, stop tokens ignored), the wall time, aggregate tokens/s and the median time to first
token. llama-cpp-python's Llama runs one sequence at a time, so its c sequences run one after
another (what a single Llama object serves); its server's parallel slots are not measured here.

Usage::

    python tools/bench_llm.py [--model engines/smollm2 [engines/smollm2-q4]] [--threads 2] [--concurrency 1 4 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def prompt_texts(tokenizer, count: int, length: int) -> list[str]:
    """`count` different texts of exactly `length` tokens, cut from the shipped corpus."""
    words = (ROOT / "docs" / "corpus" / "vibration-sensor-manual.md").read_text().split()
    texts = []
    for i in range(count):
        ids = tokenizer.encode(" ".join(words[i * 37:]), special=False)[:length]
        texts.append(tokenizer.decode(ids))
    return texts


async def ours(model: Path, threads: int, counts: list[int], prompt_len: int, new: int) -> list[dict]:
    from edge_batcher.config import DaemonConfig, MemorySettings, load_model_config
    from edge_batcher.rag.generate import GenerationService
    from edge_batcher.runtime import Runtime

    config = load_model_config(model)
    config.onnxruntime.intra_op_threads = threads
    runtime = Runtime(DaemonConfig(memory=MemorySettings(probe="fixed", budget_mb=4096)))
    service = GenerationService(config, runtime)
    await service.start()
    rows = []
    try:
        params = {"max_new_tokens": new, "ignore_stop": True}
        await service.generate("warm up", {"max_new_tokens": 4, "ignore_stop": True}, apply_template=False)
        for c in counts:
            texts = prompt_texts(service.tokenizer, c, prompt_len)
            start = time.perf_counter()
            results = await asyncio.gather(*(service.generate(t, params, apply_template=False) for t in texts))
            wall = time.perf_counter() - start
            assert all(len(r.token_ids) == new for r in results)
            rows.append({"engine": f"edge-batcher ({model.name})", "concurrent": c, "wall_s": round(wall, 2),
                         "tokens_per_s": round(c * new / wall, 1),
                         "ttft_median_s": round(statistics.median(r.first_token_s for r in results), 2),
                         "prompt_tokens": results[0].prompt_tokens})
    finally:
        await service.close()
    return rows


def llama_cpp(gguf: Path, tokenizer, threads: int, counts: list[int], prompt_len: int, new: int) -> list[dict]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=prompt_len + new + 8, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    rows = []
    for c in counts:
        texts = prompt_texts(tokenizer, c, prompt_len)
        prompts = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts]
        firsts = []
        start = time.perf_counter()
        for ids in prompts:  # one Llama object: one sequence at a time
            t0 = time.perf_counter()
            llm.reset()
            for n, _ in enumerate(llm.generate(ids, top_k=1, temp=0.0, reset=True)):
                if n == 0:
                    firsts.append(time.perf_counter() - t0)
                if n + 1 == new:
                    break
        wall = time.perf_counter() - start
        rows.append({"engine": "llama.cpp (Q4_1, one sequence at a time)", "concurrent": c, "wall_s": round(wall, 2),
                     "tokens_per_s": round(c * new / wall, 1), "ttft_median_s": round(statistics.median(firsts), 2),
                     "prompt_tokens": len(prompts[0])})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, nargs="+", default=[ROOT / "engines" / "smollm2"],
                        help="one or more built models (e.g. engines/smollm2 engines/smollm2-q4), measured in turn")
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tools"))
    from build_smollm2 import default_gguf

    from edge_batcher.config import load_model_config
    from edge_batcher.rag.tokenize import TextTokenizer

    tokenizer = TextTokenizer.from_model(load_model_config(args.model[0]))
    rows = []
    for model in args.model:
        rows += asyncio.run(ours(model, args.threads, args.concurrency, args.prompt_tokens, args.new_tokens))
    try:
        rows += llama_cpp(args.gguf or default_gguf(), tokenizer, args.threads, args.concurrency,
                          args.prompt_tokens, args.new_tokens)
    except ImportError:
        print("llama-cpp-python is not installed: only edge-batcher measured", file=sys.stderr)
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
