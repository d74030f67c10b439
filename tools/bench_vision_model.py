#!/usr/bin/env python3
"""The vision demo model's own time per frame at batch 1, 2, 4 and 8: one onnxruntime session as
model.toml configures it (CPU execution provider, one intra-op thread), the sizes interleaved
round by round so that a noisy neighbour slows all of them alike, medians printed. No daemon,
no transport: what the engine costs, the floor under any request for a frame.
``python tools/bench_vision_model.py [--model engines/vision/model.onnx] [--rounds 30]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SIZES = (1, 2, 4, 8)


def measure(model: Path, rounds: int, sizes: tuple[int, ...] = SIZES) -> dict[int, list[float]]:
    """Seconds per run of each batch size, ``rounds`` runs each after one warm-up run."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {n: {"frames": rng.integers(0, 256, (n, 480, 640, 3), dtype=np.uint8)} for n in sizes}
    for n in sizes:
        sess.run(None, feeds[n])
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            t0 = time.perf_counter()
            sess.run(None, feeds[n])
            times[n].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "engines" / "vision" / "model.onnx")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)
    if not args.model.is_file():
        print(f"{args.model} not found: build it with python tools/build_demo_models.py", file=sys.stderr)
        return 2
    times = measure(args.model, args.rounds)
    print(f"{'batch':>5} {'median ms/run':>14} {'median ms/frame':>16} {'p90 ms/frame':>13}")
    for n, ts in times.items():
        per_frame = sorted(t / n * 1e3 for t in ts)
        p90 = per_frame[int(0.9 * (len(per_frame) - 1))]
        print(f"{n:>5} {statistics.median(ts) * 1e3:>14.2f} {statistics.median(per_frame):>16.2f} {p90:>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
