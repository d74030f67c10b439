#!/usr/bin/env python3
"""One engine's time per batch by where the batch lives and how batch sizes follow each other.

ONNX Runtime's CUDA `Conv` keeps its plan for the last input shape only, so outside a CUDA graph a
change of batch size plans every convolution again (docs/benchmarks.md, "CUDA shared memory
through perf_analyzer"). This loads one model of a repository (its model.toml, put on the CUDA
EP first) with `cuda_graphs` "auto", "off" (cuDNN's heuristic search, the daemon's default
without graphs) and "off" with ONNX Runtime's exhaustive search, and times `engine.infer` at
sizes 2, 4 and 8, each size repeated and the sizes alternating (8, 2, 4, 8, ...), with the batch
on the host and, with a CUDA binding and device, in device memory: in a buffer of its own
(copied into the graph's input, or bound with IOBinding without graphs) and in place in the
graph's input buffer, as the executor assembles batches from CUDA shared memory; and as the
executor assembles 1-row requests on the host: stacked into a new array, or with graphs and a
CUDA binding into the shape's page-locked staging (Engine.host_batch_buffers). Medians per
batch; without a GPU it times the host rows on the CPU provider and says why the device rows
are missing.

Usage: python tools/bench_device_batches.py [--models engines] [--model vision] [--runs 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_batcher.engines.base import DeviceArray  # noqa: E402
from edge_batcher.engines.onnxruntime import OnnxRuntimeEngine  # noqa: E402
from edge_batcher.errors import InvalidInput  # noqa: E402
from edge_batcher.model_config import ExecutionProvider, load_model_config  # noqa: E402
from edge_batcher.scheduler.batch import stack, stack_shape  # noqa: E402
from edge_batcher.shared_memory.cuda_regions import CudaDevices  # noqa: E402
from edge_batcher.types import DATATYPE_TO_NUMPY  # noqa: E402

SIZES = (2, 4, 8)
# cuda_graphs, and CUDA EP options over the daemon's defaults
CONFIGURATIONS = [("auto", {}), ("off", {}), ("off", {"cudnn_conv_algo_search": "EXHAUSTIVE"})]


def engine_for(model_dir: Path, graphs: str, cuda_options: dict[str, str]) -> OnnxRuntimeEngine:
    config = load_model_config(model_dir)
    providers = [ExecutionProvider("CUDAExecutionProvider", cuda_options),
                 *(ep for ep in config.onnxruntime.execution_providers if ep.name != "CUDAExecutionProvider")]
    onnxruntime = dataclasses.replace(config.onnxruntime, execution_providers=providers, cuda_graphs=graphs)
    engine = OnnxRuntimeEngine(dataclasses.replace(config, onnxruntime=onnxruntime))
    engine.load()
    return engine


def batches(engine: OnnxRuntimeEngine, seed: int = 0) -> dict[int, dict[str, np.ndarray]]:
    """A random batch per size in the model's input types (its fixed dimensions from the model file)."""
    rng = np.random.default_rng(seed)
    out = {}
    for size in SIZES:
        out[size] = {}
        for spec in engine.inputs:
            shape = (size, *(d if d > 0 else 1 for d in spec.shape[1:]))
            dtype = np.dtype(DATATYPE_TO_NUMPY[spec.datatype])
            values = rng.integers(0, 255, shape) if dtype.kind in "iu" else rng.standard_normal(shape)
            out[size][spec.name] = np.ascontiguousarray(values.astype(dtype))
    return out


def medians_ms(run: Callable[[int], object], order: list[int]) -> dict[int, float]:
    """Median ms per batch size over `order` (every shape warmed, graphs captured, first)."""
    for size in SIZES:
        run(size)
        run(size)
    times: dict[int, list[float]] = {size: [] for size in SIZES}
    for size in order:
        start = time.perf_counter()
        run(size)
        times[size].append(time.perf_counter() - start)
    return {size: statistics.median(t) * 1e3 for size, t in times.items()}


def ways_to_run(engine: OnnxRuntimeEngine, host: dict[int, dict[str, np.ndarray]], devices: CudaDevices | None,
                buffers: list) -> dict[str, Callable[[int], object]]:
    """The rows for one engine: its batches on the host and, with a device, in device memory."""
    ways: dict[str, Callable[[int], object]] = {"on the host": lambda size: engine.infer(host[size])}
    # as the executor assembles a host batch: one row per request, stacked into a new array or,
    # with page-locked staging (Engine.host_batch_buffers), into the shape's staging
    rows = {size: {name: [array[i:i + 1].copy() for i in range(size)] for name, array in inputs.items()}
            for size, inputs in host.items()}

    def stacked(size: int, staged: bool) -> object:
        shapes = {name: stack_shape(parts, size, None, 0) for name, parts in rows[size].items()}
        staging = (engine.host_batch_buffers(shapes) if staged and engine.host_batch_buffers else None) or {}
        return engine.infer({name: stack(parts, size, None, 0, 0.0, out=staging.get(name))
                             for name, parts in rows[size].items()})

    for size in SIZES:
        engine.infer(host[size])  # binds the shape (and its staging)
    ways["1-row requests stacked, new array"] = lambda size: stacked(size, staged=False)
    if engine.host_batch_buffers is not None:
        ways["1-row requests stacked, in page-locked staging"] = lambda size: stacked(size, staged=True)
    if devices is None or engine.device_inputs is None:
        return ways
    own: dict[int, dict[str, DeviceArray]] = {}
    with devices.on(0) as api:
        for size, inputs in host.items():
            own[size] = {}
            for name, array in inputs.items():
                buffer = api.mem_alloc(array.nbytes)
                buffers.append(buffer)
                api.copy_htod(buffer.ptr, array)

                def copy_to(dst: int, src: int = buffer.ptr, nbytes: int = array.nbytes) -> None:
                    with devices.on(0) as cuda:
                        cuda.copy_dtod(dst, src, nbytes)
                        cuda.synchronize()

                own[size][name] = DeviceArray(buffer.ptr, 0, array.dtype, array.shape, copy_to)
        api.synchronize()
    ways["device, own buffer"] = lambda size: engine.infer(own[size])
    buffers_for = engine.device_batch_buffers
    if buffers_for is None:
        return ways

    def in_place(size: int) -> object:
        targets = buffers_for({name: (a.shape, a.dtype) for name, a in own[size].items()}) or {}
        placed = {}
        for name, array in own[size].items():
            array.copy_to(targets[name])  # what assembling from regions writes there
            placed[name] = dataclasses.replace(array, ptr=targets[name])
        return engine.infer(placed)

    ways["device, in the graph's buffer"] = in_place
    return ways


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, default=ROOT / "engines")
    ap.add_argument("--model", default="vision")
    ap.add_argument("--runs", type=int, default=40, help="timed batches per size and row")
    args = ap.parse_args()
    repeated = [size for size in SIZES for _ in range(args.runs)]
    alternating = [SIZES[(i * 2) % 3] for i in range(args.runs * 3)]  # 2, 8, 4, 2, 8, 4, ...
    devices: CudaDevices | None = CudaDevices()
    why_no_device = ""
    try:
        with devices.on(0):
            pass
    except InvalidInput as exc:
        devices, why_no_device = None, str(exc)
    print(f"{args.model}: median ms per batch, {args.runs} batches per size, each size repeated or the sizes "
          "alternating\n")
    header = " | ".join(f"size {size}, {how}" for size in SIZES for how in ("repeated", "alternating"))
    print(f"| cuda_graphs | first provider | batch | {header} |\n|---|---|---|" + "---|" * 2 * len(SIZES))
    buffers: list = []
    for graphs, cuda_options in CONFIGURATIONS:
        engine = engine_for(args.models / args.model, graphs, cuda_options)
        for way, run in ways_to_run(engine, batches(engine), devices, buffers).items():
            rep, alt = medians_ms(run, repeated), medians_ms(run, alternating)
            cells = " | ".join(f"{rep[size]:.3f} | {alt[size]:.3f}" for size in SIZES)
            used = "with graphs" if engine.cuda_graphs else "without"
            used += "".join(f", {value.lower()} search" for value in cuda_options.values())
            print(f"| {graphs} ({used}) | {engine.providers[0]} | {way} | {cells} |")
        engine.close()
    if devices is not None:
        with devices.on(0):
            for buffer in buffers:
                buffer.free()
        devices.close()
    else:
        print(f"\nno device rows: {why_no_device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
