#!/usr/bin/env python3
"""Measure a generator's KV cache against the plan's estimate (rag/kv.py: bytes per token from
the model's own shape): for 1, 4 and 8 running sequences of 512 tokens, built as the decode loop
builds them (each prompt prefilled alone, joined to the batch, then one decode step for all),
the process RSS while the batch is held minus the RSS once it is dropped, and the peak RSS of
one decode step above the held state (in Optimum's layout its past and present caches both live
while ONNX Runtime runs; in the in-place layout the cache's buffers, whose columns are allocated
in steps of 64 tokens, are what it holds: ``cache_says_mib``). Linux only (/proc/self/status,
clear_refs). The tool runs itself with glibc's mmap threshold fixed at 64 KiB
(MALLOC_MMAP_THRESHOLD_): otherwise glibc raises it after the first large free and keeps later
caches in its heap, which RSS never gives back, so dropping a cache would show nothing.
``--arena`` keeps ONNX Runtime's CPU arena (the daemon's setting): the caches the session
returns then live in the arena, which never shrinks, and RSS shows its high-water mark instead
of the cache; by default the tool runs the session without it, to see the cache itself.

Usage::

    python tools/measure_kv_memory.py [--model engines/smollm2] [--tokens 512] [--sequences 1 4 8]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import numpy as np

from edge_batcher.memory import rss_peak

MiB = 1 << 20


def rss() -> int:
    gc.collect()
    return rss_peak.resident()


def measure(model: Path, tokens: int, counts: list[int], arena: bool = False) -> list[dict]:
    import onnxruntime as ort

    from edge_batcher.config import load_model_config
    from edge_batcher.rag.decoder import Decoder, join

    decoder = Decoder(load_model_config(model))
    decoder.load()
    if not arena:
        options = ort.SessionOptions()
        options.enable_cpu_mem_arena = False
        options.intra_op_num_threads = decoder.config.onnxruntime.intra_op_threads
        decoder.engine.session = ort.InferenceSession(str(decoder.config.model_path), options,
                                                      providers=["CPUExecutionProvider"])
    kv = decoder.kv
    assert kv is not None
    rng = np.random.default_rng(0)
    # Warm ONNX Runtime's arena at the largest batch first, so the figures below hold no
    # first-run growth of its activation memory.
    warm = None
    for _ in range(max(counts)):
        warm = join(warm, decoder.prefill(list(rng.integers(100, decoder.vocab, tokens - 1)))[1])
    assert warm is not None
    decoder.step(warm, np.zeros(warm.rows, dtype=np.int64))
    del warm
    rows = []
    for n in counts:
        before = rss()
        cache = None
        for _ in range(n):
            cache = join(cache, decoder.prefill(list(rng.integers(100, decoder.vocab, tokens - 1)))[1])
        assert cache is not None
        _, cache = decoder.step(cache, np.zeros(n, dtype=np.int64))  # now n x `tokens` tokens
        held, held_cache = rss(), cache.nbytes
        with rss_peak.measure() as step:
            _, stepped = decoder.step(cache, np.zeros(n, dtype=np.int64))
        peak = step.peak
        del stepped
        estimate = kv.bytes_per_token * tokens * n
        del cache
        after = rss()
        rows.append({"sequences": n, "tokens": tokens, "layout": "in place" if decoder.shared_kv else "optimum",
                     "estimate_mib": round(estimate / MiB, 1), "cache_says_mib": round(held_cache / MiB, 1),
                     "held_minus_dropped_mib": round((held - after) / MiB, 1),
                     "held_minus_before_mib": round((held - before) / MiB, 1),
                     "ratio": round((held - after) / estimate, 3),
                     "step_peak_above_held_mib": round((peak - held) / MiB, 1)})
    decoder.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("engines/smollm2"))
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--arena", action="store_true", help="keep ONNX Runtime's CPU arena (the daemon's setting)")
    args = parser.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    for row in measure(args.model, args.tokens, args.sequences, args.arena):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
