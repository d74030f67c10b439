#!/usr/bin/env python3
"""How close the runtime gets to the raw engine ceiling as the engine's own cost grows.

`edge-batcher bench` reports throughput / raw ceiling for one model. That ratio depends on
how much work the engine does per row against the runtime's fixed Python cost per request
(docs/benchmarks.md): this tool measures it along a range of engine costs, with the same
bench, in one run.

The models: power spectra of N-sample windows (N = 256 ... 4096), built here with
onnx.helper as a DFT through constant cos/sin matrices (dense MatMuls, the way the demo
model's feature extractor computes its spectrum), so the engine's cost grows with N (the
matrices hold 2 x N x (N/2 + 1) weights). Each is checked against numpy.fft.rfft before it
is measured. Outputs: `power` FP32 [N/2 + 1] = |rfft(window)|^2 / N and `peak_bin` INT64.

For each model it runs `edge-batcher bench --json` (a fresh process, same phases, medians of
--repeat runs) and prints one line per model plus, with --json, every figure.

Usage: python tools/bench_engine_cost.py [--sizes 256,1024,2048,4096] [--duration 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

OPSET = 17
IR_VERSION = 8

MODEL_TOML = """\
# Built by tools/bench_engine_cost.py: power spectrum of a {n}-sample window (DFT as MatMul).
backend = "onnxruntime"
model_file = "model.onnx"
instances = 1
description = "power spectrum of a {n}-sample window, for measuring the runtime against engine cost"

[onnxruntime]
execution_providers = ["CPUExecutionProvider"]
intra_op_threads = 1

[batching]
preferred_batch_sizes = [2, 4, 8]
max_queue_delay_ms = 2.0
default_timeout_ms = 5000
queue_capacity = 1024
"""


def spectrum_model(n: int):
    """ONNX model: window FP32 [batch, n] -> power FP32 [batch, n/2+1], peak_bin INT64 [batch]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    bins = n // 2 + 1
    angle = 2 * np.pi * np.outer(np.arange(n), np.arange(bins)) / n
    initializers = [
        numpy_helper.from_array(np.cos(angle).astype(np.float32), "dft_cos"),
        numpy_helper.from_array((-np.sin(angle)).astype(np.float32), "dft_sin"),
        numpy_helper.from_array(np.array(1.0 / n, dtype=np.float32), "inv_n"),
    ]
    node = helper.make_node
    nodes = [
        node("MatMul", ["window", "dft_cos"], ["re"]),
        node("MatMul", ["window", "dft_sin"], ["im"]),
        node("Mul", ["re", "re"], ["re2"]),
        node("Mul", ["im", "im"], ["im2"]),
        node("Add", ["re2", "im2"], ["energy"]),
        node("Mul", ["energy", "inv_n"], ["power"]),
        node("ArgMax", ["power"], ["peak_bin"], axis=1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, f"spectrum_{n}",
        inputs=[helper.make_tensor_value_info("window", TensorProto.FLOAT, ["batch", n])],
        outputs=[helper.make_tensor_value_info("power", TensorProto.FLOAT, ["batch", bins]),
                 helper.make_tensor_value_info("peak_bin", TensorProto.INT64, ["batch"])],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="edge-batcher/tools/bench_engine_cost.py")
    onnx.checker.check_model(model)
    return model


def check_against_numpy(path: Path, n: int) -> float:
    """Largest error of the model's power spectrum against numpy's, relative to the peak."""
    import onnxruntime as ort

    x = np.random.default_rng(n).standard_normal((8, n)).astype(np.float32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    power, peak = session.run(["power", "peak_bin"], {"window": x})
    want = np.abs(np.fft.rfft(x.astype(np.float64), axis=1)) ** 2 / n
    error = float(np.max(np.abs(power - want)) / np.max(want))
    if error > 1e-3 or not np.array_equal(peak, want.argmax(axis=1)):
        raise SystemExit(f"spectrum-{n}: the model disagrees with numpy.fft.rfft (relative error {error:.2e})")
    return error


def build(repo: Path, n: int) -> str:
    import onnx

    name = f"spectrum-{n}"
    directory = repo / name
    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(spectrum_model(n), str(directory / "model.onnx"))
    (directory / "model.toml").write_text(MODEL_TOML.format(n=n))
    check_against_numpy(directory / "model.onnx", n)
    return name


def bench(repo: Path, name: str, args) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "edge_batcher.cli", "bench", "--models", str(repo), "--model", name,
         "--duration", str(args.duration), "--repeat", str(args.repeat), "--json"],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"bench of {name} failed:\n{proc.stderr}")
    return json.loads(proc.stdout)


def summary(n: int, r: dict) -> dict:
    largest = r["preferred_batch_sizes"][-1]
    closed = r["in_process_closed"]
    any_cpu = r.get("in_process_closed_any_cpu")
    return {
        "window": n,
        "weights_mb": 2 * n * (n // 2 + 1) * 4 / 1e6,
        "engine_us_per_row": 1e6 / r["raw_ceiling_rps"],
        "engine_us_per_batch": 1e6 * largest / r["raw_ceiling_rps"],
        "raw_ceiling_rps": r["raw_ceiling_rps"],
        "in_process_rps": closed["throughput_rps"],
        "ratio_to_ceiling": r["ratio_to_ceiling"],
        "ratio_any_cpu": any_cpu["throughput_rps"] / r["raw_ceiling_rps"] if any_cpu else None,
        "minimal_batcher_ratio": r["minimal_batcher_rps"] / r["raw_ceiling_rps"],
        "overhead_us_per_request": closed["overhead_us_per_request"],
        "speedup_over_no_batching": r["speedup_over_no_batching"],
    }


def format_line(s: dict) -> str:
    any_cpu = f"{s['ratio_any_cpu']:.2f}" if s["ratio_any_cpu"] is not None else "  - "
    return (f"{s['window']:>6} {s['weights_mb']:>7.1f} {s['engine_us_per_row']:>9.1f} {s['raw_ceiling_rps']:>9.0f} "
            f"{s['in_process_rps']:>9.0f} {s['ratio_to_ceiling']:>6.2f} {any_cpu:>6} "
            f"{s['minimal_batcher_ratio']:>8.2f} "
            f"{s['overhead_us_per_request']:>9.1f} {s['speedup_over_no_batching']:>8.2f}x")


HEADER = (f"{'window':>6} {'MB':>7} {'us/row':>9} {'ceiling':>9} {'runtime':>9} {'ratio':>6} {'anyCPU':>6} "
          f"{'minimal':>8} {'overhead':>9} {'batching':>9}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256,1024,2048,4096", help="window lengths N (default 256,1024,2048,4096)")
    p.add_argument("--duration", type=float, default=2.0, help="seconds per bench phase (default 2)")
    p.add_argument("--repeat", type=int, default=3, help="runs per phase, medians reported (default 3)")
    p.add_argument("--json", action="store_true", help="print every figure as JSON")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="edge-batcher-engine-cost-") as tmp:
        repo = Path(tmp)
        if not args.json:
            print("in-process closed loop, 64 callers, preferred sizes [2, 4, 8]; us/row = raw engine time per row at "
                  "size 8; ratio = runtime / raw ceiling (anyCPU: loop_cpu = \"off\"); minimal = the minimal asyncio "
                  "batcher's ratio; overhead = us/request outside the engine; batching = speedup over no batching")
            print(HEADER)
        for n in sizes:
            s = summary(n, bench(repo, build(repo, n), args))
            rows.append(s)
            if not args.json:
                print(format_line(s), flush=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
