#!/usr/bin/env python3
"""What a generator's KV cache holds when sequences of different lengths share a batch, against
what admission reserves (kv.CacheFootprint) and against the per-sequence sum (prompt +
max_new_tokens of each, the rule admission followed before). One long sequence streams; after
its first token `--short` short ones arrive. The model's statistics are read every 2 ms: the
largest `kv.cache_bytes` (the cache's buffers) and `kv.reserved_bytes` seen, and the process's
peak RSS above its level before the run (VmHWM, Linux). The generator runs in process
(GenerationService), the model as built (tools/build_smollm2.py; docs/rag.md "Continuous
batching and KV admission").

Usage::

    python tools/measure_kv_footprint.py --model engines/smollm2 [--long 700 200] [--short 7 40 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # edge_batcher from a checkout, installed or not
sys.path.insert(0, str(ROOT / "tools"))

from bench_llm import prompt_texts  # noqa: E402

from edge_batcher.memory import rss_peak  # noqa: E402

MiB = 1 << 20


async def run(model: Path, long: tuple[int, int], short: tuple[int, int, int], threads: int) -> dict:
    from edge_batcher.config import DaemonConfig, MemorySettings, load_model_config
    from edge_batcher.rag.generate import GenerationService
    from edge_batcher.runtime import Runtime

    config = load_model_config(model)
    config.onnxruntime.intra_op_threads = threads
    service = GenerationService(config, Runtime(DaemonConfig(memory=MemorySettings(probe="fixed", budget_mb=8192))))
    await service.start()
    try:
        count, short_prompt, short_new = short
        texts = prompt_texts(service.tokenizer, count + 1, max(long[0], short_prompt))
        long_text = service.tokenizer.decode(service.tokenizer.encode(texts[0], special=False)[:long[0]])
        short_texts = [service.tokenizer.decode(service.tokenizer.encode(t, special=False)[:short_prompt])
                       for t in texts[1:]]
        no_stop = {"ignore_stop": True}
        # one generation of the same shape first: the session's first runs allocate for good
        # (kernels' buffers, thread pools), which is not the cache
        await asyncio.gather(*(service.generate(t, {"max_new_tokens": 4, **no_stop}, apply_template=False)
                               for t in [long_text] + short_texts))
        with rss_peak.measure() as rss:
            peak = {"cache": 0, "reserved": 0}
            done = asyncio.Event()

            async def watch():
                while not done.is_set():
                    kv = service.statistics()["kv"]
                    peak["cache"] = max(peak["cache"], kv["cache_bytes"])
                    peak["reserved"] = max(peak["reserved"], kv["reserved_bytes"])
                    await asyncio.sleep(0.002)

            watcher = asyncio.ensure_future(watch())
            first = await service.submit(long_text, {"max_new_tokens": long[1], **no_stop}, apply_template=False)
            events = service.events(first)
            await events.__anext__()

            async def rest():
                async for kind, payload in events:
                    if kind == "done":
                        return payload

            results = await asyncio.gather(rest(), *(service.generate(t, {"max_new_tokens": short_new, **no_stop},
                                                                      apply_template=False) for t in short_texts))
            done.set()
            await watcher
        per_token = service.decoder.kv.bytes_per_token
        per_sequence = sum(r.prompt_tokens + len(r.token_ids) for r in results) * per_token
        stats = service.statistics()
        return {
            "layout": "in place" if service.decoder.shared_kv else "optimum",
            "sequences": len(results), "max_running_seen": stats["max_running_seen"],
            "per_sequence_sum_mib": round(per_sequence / MiB, 1),
            "cache_peak_mib": round(peak["cache"] / MiB, 1),
            "reserved_peak_mib": round(peak["reserved"] / MiB, 1),
            "rss_peak_above_start_mib": round((rss.peak - rss.before) / MiB, 1),
            "cache_over_per_sequence_sum": round(peak["cache"] / per_sequence, 2),
        }
    finally:
        await service.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "engines" / "smollm2")
    parser.add_argument("--long", type=int, nargs=2, default=[700, 200], metavar=("PROMPT", "NEW"))
    parser.add_argument("--short", type=int, nargs=3, default=[7, 40, 40], metavar=("COUNT", "PROMPT", "NEW"))
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.model, tuple(args.long), tuple(args.short), args.threads)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
