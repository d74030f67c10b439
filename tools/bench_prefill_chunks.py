#!/usr/bin/env python3
"""How long a running stream stalls while newcomers' long prompts are prefilled, at several
`[generator] prefill_chunk_tokens` settings, in one run: one sequence streams (greedy, stop
tokens ignored); after its first tokens, `--newcomers` sequences with `--prompt-tokens` prompts
arrive together. Printed per setting: the running stream's largest gap between two tokens and
its median gap while the newcomers were being prefilled, the newcomers' median time to first
token, and the whole run's wall time. The generator runs in process (GenerationService), the
model as built (tools/build_smollm2.py; docs/rag.md "Chunked prefill").

Usage::

    python tools/bench_prefill_chunks.py --model engines/smollm2 [--chunks 0 256 128] [--prompt-tokens 768]
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
sys.path.insert(0, str(ROOT))  # edge_batcher from a checkout, installed or not
sys.path.insert(0, str(ROOT / "tools"))

from bench_llm import prompt_texts  # noqa: E402


async def one_setting(model: Path, chunk: int, threads: int, newcomers: int, prompt_tokens: int) -> dict:
    from edge_batcher.config import DaemonConfig, MemorySettings, load_model_config
    from edge_batcher.rag.generate import GenerationService
    from edge_batcher.runtime import Runtime

    config = load_model_config(model)
    config.onnxruntime.intra_op_threads = threads
    config.generator = {**config.generator, "prefill_chunk_tokens": chunk}
    service = GenerationService(config, Runtime(DaemonConfig(memory=MemorySettings(probe="fixed", budget_mb=4096))))
    await service.start()
    try:
        params = {"ignore_stop": True}
        await service.generate("warm up", {"max_new_tokens": 4, **params}, apply_template=False)
        texts = prompt_texts(service.tokenizer, newcomers, prompt_tokens)
        short = prompt_texts(service.tokenizer, 1, 64)[0]
        start = time.perf_counter()
        running = await service.submit(short, {"max_new_tokens": 400, **params}, apply_template=False)
        stamps: list[float] = []
        streaming_now = asyncio.Event()

        async def stream() -> None:
            async for kind, _ in service.events(running):
                if kind == "token":
                    stamps.append(time.perf_counter())
                    if len(stamps) == 20:
                        streaming_now.set()

        streaming = asyncio.ensure_future(stream())
        await streaming_now.wait()
        arrival = time.perf_counter()
        results = await asyncio.gather(*(service.generate(t, {"max_new_tokens": 16, **params}, apply_template=False)
                                         for t in texts))
        last_first_token = arrival + max(r.first_token_s for r in results)
        await streaming
        # the running stream's gaps that overlap the newcomers' prefills (arrival to the last first token)
        gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b > arrival and a < last_first_token]
        return {"prefill_chunk_tokens": chunk, "prompt_tokens": results[0].prompt_tokens, "newcomers": newcomers,
                "running_max_gap_ms": round(max(gaps) * 1e3, 1) if gaps else None,
                "running_median_gap_ms": round(statistics.median(gaps) * 1e3, 1) if gaps else None,
                "running_tokens_while_prefilling": len(gaps),
                "newcomer_ttft_median_s": round(statistics.median(r.first_token_s for r in results), 2),
                "wall_s": round(time.perf_counter() - start, 2)}
    finally:
        await service.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "engines" / "smollm2")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 128])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--newcomers", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=1, help="the settings in turn, this many times")
    args = parser.parse_args(argv)
    for _ in range(args.rounds):
        for chunk in args.chunks:
            row = asyncio.run(one_setting(args.model, chunk, args.threads, args.newcomers, args.prompt_tokens))
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
