#!/usr/bin/env python3
"""What a busy Python thread does to an engine thread: ONNX Runtime runs of one batch, timed
alone, beside a pure-Python thread on another core, and beside it on the same core.

This is the measurement behind `[server] loop_cpu` (docs/benchmarks.md): the event loop is
such a Python thread, and the engine worker needs the GIL back after every run.

Usage: python tools/bench_gil.py [--model engines/vibration/model.onnx] [--batch 8] [--seconds 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import threading
import time

import numpy as np
import onnxruntime as ort


def runs(session, feed, seconds: float) -> tuple[float, float]:
    """(wall us per run, CPU us per run of this thread) over `seconds`."""
    r0, t0, n = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        session.run(None, feed)
        n += 1
    r1, wall = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter() - t0
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return wall / n * 1e6, cpu / n * 1e6


def beside_busy_python(session, feed, seconds: float, cpus: set[int] | None) -> tuple[float, float]:
    stop = False

    def busy() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        x = 0
        while not stop:
            x += 1  # pure Python: holds the GIL except when the interpreter hands it over

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        return runs(session, feed, seconds)
    finally:
        stop = True
        thread.join()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="engines/vibration/model.onnx")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(args.model, options, providers=["CPUExecutionProvider"])
    spec = session.get_inputs()[0]
    shape = [args.batch] + [d if isinstance(d, int) and d > 0 else 1 for d in spec.shape[1:]]
    feed = {spec.name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    session.run(None, feed)
    cpus = sorted(os.sched_getaffinity(0))
    print(f"{args.model}, batch {args.batch}, {args.seconds} s per case, CPUs {cpus}")
    wall, cpu = runs(session, feed, args.seconds)
    print(f"alone:                                  {wall:8.0f} us wall, {cpu:6.0f} us CPU per run")
    if len(cpus) < 2:
        print("one CPU only: the other cases need two")
        return 0
    os.sched_setaffinity(0, {cpus[0]})
    wall, cpu = beside_busy_python(session, feed, args.seconds, {cpus[1]})
    print(f"beside a busy Python thread, other core: {wall:8.0f} us wall, {cpu:6.0f} us CPU per run")
    wall, cpu = beside_busy_python(session, feed, args.seconds, {cpus[0]})
    print(f"beside a busy Python thread, same core:  {wall:8.0f} us wall, {cpu:6.0f} us CPU per run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
