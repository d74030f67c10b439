"""`edge-batcher estimate`: what each batch of each model needs, next to the device's budget.

For every ONNX Runtime model of the repository, every preferred batch size and every sequence
bucket (or none), the table shows the estimator's figures (edge_batcher.memory.estimator):
weights, peak activations (tensor liveness), KV cache and their total, the budget the daemon
would plan with right now (the [memory] probe, reserve_fraction, headroom_mb, budget_mb; see
runtime.build_budget) and whether the batch fits: ``total <= available``. Nothing is loaded
here, so "total" counts the model's weights; the running daemon counts loaded weights as
resident and compares only activations + KV with what is left.

``--measure`` also runs every (model, size, bucket) for real and shows the measured activation
peak and the estimator's error, ``(estimated - measured) / measured``, and the error left after
calibrating at the model's smallest preferred size (see :func:`calibrate`).

Measuring an activation peak (measure_activation_peak)
-------------------------------------------------------
What is measured is *physical* memory: the rise of the process's resident set (RSS) while ONNX
Runtime runs one batch, on the CPU execution provider, in a fresh Python subprocess per
(model, size, bucket) so that no allocator state of one measurement leaks into the next. In the
child, in this order:

1. the session is created with the model's settings (intra/inter-op threads, graph
   optimisation level), ``enable_cpu_mem_arena = False`` and ``enable_mem_pattern = False``,
   and the child is pinned to one CPU;
2. one warm-up run at the very size being measured. It pays what only the first run of a
   process pays: kernel code pages faulted in from libonnxruntime (about 0.7 MiB, dozens to
   hundreds of times the vibration demo's activations), lazily built kernel state, first touch
   of thread stacks. Without the arena and the memory pattern, ONNX Runtime keeps none of the run's
   buffers afterwards: the measured run allocates every one of them again (checked with an
   LD_PRELOAD allocation counter: the same 21 allocations, the same bytes, on both runs of the
   encoder);
3. fresh inputs are allocated, ``gc.collect()`` and glibc's ``malloc_trim(0)`` hand freed heap
   pages back to the kernel (so the run cannot hide allocations in pages that are resident
   already), and the RSS high-water mark is reset by writing ``5`` to /proc/self/clear_refs
   (Linux >= 4.0; without the reset the mark would still hold the session-creation peak);
4. one run; ``run_peak = VmHWM - VmRSS`` (before the run) from /proc/self/status.

The child's environment sets ``MALLOC_MMAP_THRESHOLD_=65536``: every buffer of 64 KiB or more
is then its own mmap, returned to the kernel the moment ONNX Runtime frees it, so RSS follows
the buffers one to one. Without it glibc's dynamic threshold serves buffers from the heap after
the first large free, and the high-water mark includes heap fragmentation: 20.0-22.0 MiB for a
one-layer variant of the demo encoder at batch 8 x 128 whose allocations peak at 15.0 MiB
(counted with an LD_PRELOAD allocation hook), 15.0 MiB with the fixed threshold.

Why the arena and the memory pattern are off: with the BFC arena on, memory the arena grew to
stays resident after a run and its growth is rounded to extension chunks; with the memory
pattern on, later runs of a shape allocate one block laid out from the first run. Either way
the RSS rise of a run is then a property of the allocator's history rather than of the batch.
The daemon's sessions run with both on (ONNX Runtime's defaults), which costs a little more:
``arena=True`` measures that instead (ORT defaults, first run of a fresh process, no warm-up,
so it includes the one-time costs of step 2); tools/bench_estimator.py --arena shows both.

The measured activation peak is ``input_bytes + run_peak``. The batch's input arrays are
allocated before the measured run (they belong to the caller, and ONNX Runtime reads them in
place), so the RSS rise does not contain them; the estimator counts them as live activations
for the whole run because the batcher holds them, so their exact size (numpy ``nbytes``) is
added back to compare like with like. Outputs are allocated by the run and are in run_peak.

Resolution: the kernel keeps RSS counters batched per CPU (percpu counters, Linux >= 6.2) or per
thread (64 page faults, older kernels such as L4T's 5.15) and reads them approximately, and a
few small allocations can land on heap pages that are resident already; runs repeated on the
encoder scatter by 0.1-0.25 MiB. ``RESOLUTION_BYTES`` (256 KiB) is reported with every
measurement: peaks of a few MiB are good to a few percent, peaks below ~1 MiB cannot be
checked this way (the vibration demo's 3-25 KiB are far below it).

Other ways considered. The ORT profiler (``enable_profiling``) records per-node output sizes,
not what is live. ``session.collect_node_memory_stats_to_file`` (recent ORT builds) reports the
bytes each node newly allocated, rounded to 256 bytes and cumulative over the run, so it bounds
the peak from above (it equals it for the encoder, where ONNX Runtime holds every planned buffer
to the end of the run, and is 2-3x it for the vibration model). The arena's MaxInUse statistic
would be exact but ORT's Python API does not expose it.

Calibration
-----------
ONNX Runtime's allocation planner hands a dead tensor's buffer only to a later tensor of the
same shape and element type, and frees a buffer only when the last tensor placed in it dies. On
a layered model that is near the end of the run, so its peak is the sum of a handful of
per-shape buffer pools (21 buffers for the demo encoder, with 1, 2 or 4 layers alike), which is
more than the ideal liveness peak: about 1.75x on the demo encoder at length 128. On other
graphs in-place reuse (Relu writing into its input) makes it less than liveness: the factor
belongs to the model. :func:`calibrate` measures one size, sets the estimator's factor
(measured / estimated; the default one, or with ``for_length`` that sequence length's own) and
returns a :class:`Calibration`; it leaves the estimator alone when the measurement is too small
to trust (below ``MIN_CALIBRATION_BYTES``) or the factor is implausible (outside
``CALIBRATION_BOUNDS``). The factor depends on the sequence length (the s^2 attention buffers
against the s FFN buffers), so the daemon calibrates each bucket (runtime._calibrate).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import DaemonConfig, ModelConfig, load_config, load_model_config
from ..errors import ConfigError, EdgeBatcherError

KiB = 1 << 10
MiB = 1 << 20

# glibc: allocations of at least this many bytes get their own mmap in the measuring child.
MMAP_THRESHOLD_BYTES = 64 * KiB
# How far a measured run peak can be off (see "Resolution" in the module docstring).
RESOLUTION_BYTES = 256 * KiB
# calibrate() only trusts measurements whose run peak is at least this large (~25% noise).
MIN_CALIBRATION_BYTES = 4 * RESOLUTION_BYTES
# ... and only factors in this range; anything else means the measurement or the model is off.
CALIBRATION_BOUNDS = (0.25, 8.0)
DEFAULT_TIMEOUT_S = 300.0

_OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
               "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}  # fmt: skip


# ------------------------------------------------------------------------------- measurement


@dataclass(frozen=True)
class ActivationMeasurement:
    """One measured activation peak (the median of ``samples`` when repeated).

    activation_peak = input_bytes + run_peak: the estimator's definition of activations.
    run_peak is the RSS rise during the measured run; resolution says how far off it can be.
    """

    batch: int
    seq_len: int | None
    activation_peak: int
    run_peak: int
    input_bytes: int
    output_bytes: int
    resolution: int
    arena: bool
    mem_pattern: bool
    warmup: bool
    providers: tuple[str, ...]
    samples: tuple[int, ...] = ()  # run_peak of every repetition

    @property
    def method(self) -> str:
        return (
            f"RSS high-water rise of one run, fresh subprocess, CPU EP, "
            f"arena={'on' if self.arena else 'off'}, mem_pattern={'on' if self.mem_pattern else 'off'}, "
            f"{'warm-up run first' if self.warmup else 'first run'}, "
            f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD_BYTES}; + input bytes"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "batch": self.batch, "seq_len": self.seq_len, "activation_peak": self.activation_peak,
            "run_peak": self.run_peak, "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes, "resolution": self.resolution,
            "arena": self.arena, "mem_pattern": self.mem_pattern, "warmup": self.warmup,
            "providers": list(self.providers), "samples": list(self.samples), "method": self.method,
        }


def measure_activation_peak(
    model: ModelConfig | str | os.PathLike[str],
    batch: int,
    seq_len: int | None = None,
    *,
    repeat: int = 1,
    arena: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    python: str | None = None,
) -> ActivationMeasurement:
    """Measure the activation peak of one batch of an ONNX Runtime model (CPU EP).

    model: a ModelConfig, or the model's directory (with model.toml). Runs ``repeat`` fresh
    subprocesses (see the module docstring for the method) and returns the median. seq_len is
    required when the model has a [sequence] section. arena=True measures with ONNX Runtime's
    defaults (arena and memory pattern on, first run of the process) instead.

    Blocking, a second or more per repetition; the child loads its own copy of the weights.
    Raises EdgeBatcherError when the child fails (the message carries its stderr).
    """
    mc = model if isinstance(model, ModelConfig) else load_model_config(Path(model))
    _check_count("batch", batch)
    _check_count("repeat", repeat)
    if mc.sequence is not None and seq_len is None:
        raise ValueError(f"model {mc.name!r} has a [sequence] section: give seq_len")
    if seq_len is not None:
        _check_count("seq_len", seq_len)
    settings = mc.onnxruntime
    spec = {
        "model_path": str(mc.model_path),
        "batch": batch,
        "seq_len": seq_len,
        "sequence_inputs": list(mc.sequence.inputs) if mc.sequence else [],
        "sequence_axis": mc.sequence.axis if mc.sequence else None,
        "overrides": {o.name: list(o.shape) for o in mc.inputs if o.shape},
        "intra_op_threads": settings.intra_op_threads,
        "inter_op_threads": settings.inter_op_threads,
        "optimization": _OPT_LEVELS[settings.graph_optimization_level],
        "arena": arena,
        "mem_pattern": arena,
        "warmup": not arena,
    }
    results = [_run_child(spec, mc.name, timeout_s, python) for _ in range(repeat)]
    results.sort(key=lambda r: r["run_peak"])
    median = results[(len(results) - 1) // 2]
    return ActivationMeasurement(
        batch=batch,
        seq_len=seq_len,
        activation_peak=median["input_bytes"] + median["run_peak"],
        run_peak=median["run_peak"],
        input_bytes=median["input_bytes"],
        output_bytes=median["output_bytes"],
        resolution=RESOLUTION_BYTES,
        arena=arena,
        mem_pattern=arena,
        warmup=not arena,
        providers=tuple(median["providers"]),
        samples=tuple(r["run_peak"] for r in results),
    )


def _run_child(spec: dict, name: str, timeout_s: float, python: str | None) -> dict:
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD_BYTES)
    root = str(Path(__file__).resolve().parents[2])  # so the child imports this very package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [python or sys.executable, "-m", "edge_batcher.memory.report", "--measure-child", json.dumps(spec)]
    where = f"model {name!r} at batch {spec['batch']}" + (
        f" x {spec['seq_len']}" if spec["seq_len"] is not None else ""
    )
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise EdgeBatcherError(f"measuring {where}: no result after {timeout_s:.0f} s") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise EdgeBatcherError(f"measuring {where} failed (exit {proc.returncode}): {tail}")
    return json.loads(lines[-1])


# The part below runs in the measuring child: numpy and onnxruntime only, no daemon imports.

_ORT_NUMPY = {
    "tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
    "tensor(int8)": "int8", "tensor(int16)": "int16", "tensor(int32)": "int32",
    "tensor(int64)": "int64", "tensor(uint8)": "uint8", "tensor(uint16)": "uint16",
    "tensor(uint32)": "uint32", "tensor(uint64)": "uint64", "tensor(bool)": "bool",
}  # fmt: skip


def _input_shapes(inputs: list, spec: dict) -> dict[str, tuple[str, list[int]]]:
    """Concrete (numpy dtype, shape) of every session input: dim 0 is the batch, the sequence
    axis of the [sequence] inputs is seq_len, a symbolic dim shared with one of those takes
    its value, model.toml's [[inputs]] shapes fix the rest."""
    symbols: dict[str, int] = {}
    plan: dict[str, list] = {}
    for i in inputs:
        if i.type not in _ORT_NUMPY:
            raise ValueError(f"input {i.name!r} has type {i.type}, which cannot be synthesised")
        dims = list(i.shape)
        if not dims:
            raise ValueError(f"input {i.name!r} is a scalar; batched models need a batch dimension")
        wanted = {0: spec["batch"]}
        if i.name in spec["sequence_inputs"] and spec["seq_len"] is not None:
            wanted[spec["sequence_axis"] % len(dims)] = spec["seq_len"]
        for axis, value in wanted.items():
            d = dims[axis]
            if isinstance(d, int) and d >= 0 and d != value:
                raise ValueError(f"input {i.name!r}: dimension {axis} is fixed at {d}, cannot be {value}")
            if isinstance(d, str):
                symbols.setdefault(d, value)
            dims[axis] = value
        plan[i.name] = dims
    out: dict[str, tuple[str, list[int]]] = {}
    for i in inputs:
        dims = plan[i.name]
        override = spec["overrides"].get(i.name, [])
        for axis, d in enumerate(dims):
            if isinstance(d, int) and d >= 0:
                continue
            if isinstance(d, str) and d in symbols:
                dims[axis] = symbols[d]
            elif axis < len(override) and override[axis] >= 0:
                dims[axis] = override[axis]
            else:
                raise ValueError(
                    f"input {i.name!r}: no size for dynamic dimension {axis} ({d!r}); fix it with "
                    "[[inputs]] shape in model.toml or list the input in [sequence] inputs"
                )
        out[i.name] = (_ORT_NUMPY[i.type], [int(d) for d in dims])
    return out


def _read_status(fh) -> dict[str, int]:
    fh.seek(0)
    values: dict[str, int] = {}
    for line in fh.read().decode().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values


def _child_measure(spec: dict) -> dict:
    import ctypes
    import gc

    import numpy as np
    import onnxruntime as ort

    if hasattr(os, "sched_setaffinity"):
        # One CPU: the kernel's batched RSS counters then have one CPU's batch to be off by.
        try:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        except OSError:
            pass
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc; musl has none
    except (AttributeError, OSError):
        trim = None

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = spec["intra_op_threads"]
    opts.inter_op_num_threads = spec["inter_op_threads"]
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, spec["optimization"])
    opts.enable_cpu_mem_arena = spec["arena"]
    opts.enable_mem_pattern = spec["mem_pattern"]
    opts.log_severity_level = 3
    session = ort.InferenceSession(spec["model_path"], opts, providers=["CPUExecutionProvider"])
    shapes = _input_shapes(session.get_inputs(), spec)
    rng = np.random.default_rng(0)

    def make_inputs() -> dict:
        feeds = {}
        for name, (dtype, shape) in shapes.items():
            if dtype.startswith("float"):
                feeds[name] = rng.standard_normal(shape).astype(dtype)
            else:  # ids, masks, flags: 1 is a valid value for all of them
                feeds[name] = np.ones(shape, dtype=dtype)
        return feeds

    if spec["warmup"]:
        session.run(None, make_inputs())
    feeds = make_inputs()
    input_bytes = sum(int(a.nbytes) for a in feeds.values())
    status = open("/proc/self/status", "rb", buffering=0)
    gc.collect()
    if trim is not None:
        trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset the RSS high-water mark to the current RSS
    except OSError as e:
        raise RuntimeError(f"cannot reset the RSS high-water mark (/proc/self/clear_refs): {e}") from e
    before = _read_status(status)["VmRSS"]
    outputs = session.run(None, feeds)
    after = _read_status(status)
    status.close()
    return {
        "run_peak": max(0, after["VmHWM"] - before),
        "input_bytes": input_bytes,
        "output_bytes": sum(int(getattr(o, "nbytes", 0)) for o in outputs),
        "providers": session.get_providers(),
    }


def _child_main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--measure-child":
        print("usage: python -m edge_batcher.memory.report --measure-child SPEC_JSON", file=sys.stderr)
        return 2
    try:
        result = _child_measure(json.loads(argv[1]))
    except Exception as e:  # reported to the parent through stderr and the exit status
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------- calibration


@dataclass(frozen=True)
class Calibration:
    """The outcome of calibrate(): the factor now on the estimator and where it came from."""

    factor: float
    applied: bool
    reason: str
    batch: int
    seq_len: int | None
    raw_estimate: int
    measurement: ActivationMeasurement | None

    def to_json(self) -> dict[str, Any]:
        return {
            "factor": self.factor, "applied": self.applied, "reason": self.reason,
            "batch": self.batch, "seq_len": self.seq_len, "raw_estimate": self.raw_estimate,
            "measurement": self.measurement.to_json() if self.measurement else None,
        }


def calibration_factor(raw_estimate: int, measurement: ActivationMeasurement) -> tuple[float | None, str]:
    """(measured / estimated, why) when the measurement can be trusted, else (None, why not)."""
    return _factor(raw_estimate, measurement.activation_peak, measurement.run_peak)


def _factor(raw_estimate: int, activation_peak: int, run_peak: int) -> tuple[float | None, str]:
    if run_peak < MIN_CALIBRATION_BYTES:
        return None, (
            f"measured run peak {run_peak / MiB:.2f} MiB is below {MIN_CALIBRATION_BYTES / MiB:.0f} MiB, "
            f"too close to the {RESOLUTION_BYTES // KiB} KiB resolution to calibrate with"
        )
    if raw_estimate <= 0:
        return None, "the raw estimate is 0"
    factor = activation_peak / raw_estimate
    low, high = CALIBRATION_BOUNDS
    if not low <= factor <= high:
        return None, f"factor {factor:.2f} is outside {low}-{high}; check the model and the measurement"
    return factor, f"measured {activation_peak / MiB:.2f} MiB / estimated {raw_estimate / MiB:.2f} MiB"


def calibrate(
    estimator,
    model: ModelConfig | str | os.PathLike[str],
    batch: int,
    seq_len: int | None = None,
    *,
    repeat: int = 1,
    measure: Callable[..., ActivationMeasurement] = measure_activation_peak,
    for_length: bool = False,
) -> Calibration:
    """Measure one batch (measure_activation_peak) and set the estimator's calibration to
    measured / raw liveness estimate, for a model's warm-up: the default factor, or with
    ``for_length`` the factor of this seq_len only (a length bucket).

    Use a size whose activations are a few MiB at least (the largest preferred size of the
    largest bucket is safest), and calibrate once per bucket if the buckets differ much (the
    factor depends on the sequence length). When the measurement is too small or the factor
    implausible the estimator keeps its calibration and applied is False.
    """
    target = seq_len if for_length else None
    raw = estimator.activation_peak(batch, seq_len)
    measurement = measure(model, batch, seq_len, repeat=repeat)
    factor, reason = calibration_factor(raw, measurement)
    if factor is None:
        return Calibration(estimator.calibration_for(target), False, reason, batch, seq_len, raw, measurement)
    estimator.set_calibration(factor, target)
    return Calibration(factor, True, reason, batch, seq_len, raw, measurement)


# ------------------------------------------------------------------------------- the report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="daemon config (default: built-in defaults)")
    p.add_argument("--models", help="model repository (default: the config's)")
    p.add_argument("--model", action="append", metavar="NAME",
                   help="only this model (repeat for several; default: the config's [models] load, else all)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--measure", action="store_true",
                   help="also run every batch for real and show the measured activation peak and the error")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="with --measure: measure N times, report the median (default 1)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"with --measure: seconds one measurement may take (default {DEFAULT_TIMEOUT_S:.0f})")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.models:
        config.models.repository = str(Path(args.models).resolve())
    if args.repeat < 1:
        raise ConfigError(f"--repeat must be >= 1, got {args.repeat}")
    progress = None
    if args.measure and not args.json and sys.stderr.isatty():
        def progress(text: str) -> None:
            print(f"\r\033[K{text}", end="", file=sys.stderr, flush=True)

    report = build_report(
        config, only=args.model, measure=args.measure, repeat=args.repeat,
        timeout_s=args.timeout, progress=progress,
    )
    if progress is not None:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if any(r.get("measure_error") for m in report["models"] for r in m["rows"]) else 0


def budget_json(config: DaemonConfig) -> dict[str, Any]:
    """The daemon's budget right now (runtime.build_budget, so the same as `serve` would use)."""
    from ..runtime import build_budget

    budget = build_budget(config.memory)
    snapshot = budget.refresh()
    return {
        "probe": config.memory.probe,
        "source": snapshot.source,
        "free_bytes": snapshot.free_bytes,
        "total_bytes": snapshot.total_bytes,
        "reserve_fraction": budget.reserve_fraction,
        "headroom_bytes": budget.headroom_bytes,
        "fixed_bytes": budget.fixed_bytes,
        "available_bytes": budget.available(),
        "details": dict(snapshot.details),
    }


def build_report(
    config: DaemonConfig,
    *,
    only: list[str] | None = None,
    measure: bool = False,
    repeat: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The report as a JSON-able dict: budget, models (with rows), skipped models."""
    from ..runtime import discover_models
    from .estimator import OnnxFootprintEstimator

    budget = budget_json(config)
    available = budget["available_bytes"]
    configs = discover_models(Path(config.models.repository), only or config.models.load)
    report: dict[str, Any] = {"budget": budget, "models": [], "skipped": []}
    if measure:
        report["measurement"] = {
            "method": "RSS high-water rise of one run in a fresh subprocess (CPU EP, arena and "
                      "memory pattern off, after a warm-up run at the same size) + input bytes",
            "resolution_bytes": RESOLUTION_BYTES,
            "repeat": repeat,
            "calibration": "factor measured/estimated at the smallest preferred size of each bucket",
        }
    for mc in configs:
        if not runs_onnx_graph(mc.backend):
            report["skipped"].append({"name": mc.name, "reason": f"backend {mc.backend!r}: only models that run "
                                      "an ONNX graph in ONNX Runtime are estimated"})
            continue
        if mc.model_path.suffix != ".onnx":
            report["skipped"].append({"name": mc.name, "reason": f"{mc.model_file} is not an .onnx file"})
            continue
        seq = mc.sequence
        estimator = OnnxFootprintEstimator(
            mc.model_path, sequence_axes={name: seq.axis for name in seq.inputs} if seq else None
        )
        buckets: list[int | None] = list(seq.buckets) if seq else [None]
        rows: list[dict[str, Any]] = []
        for bucket in buckets:
            for size in mc.batching.preferred_batch_sizes:
                f = estimator.estimate(size, bucket)
                row: dict[str, Any] = {
                    "batch": size, "seq_len": bucket, "weights": f.weights,
                    "activations": f.activations, "kv_cache": f.kv_cache, "total": f.total,
                    "fits": f.total <= available, "unknown_shapes": f.unknown_shapes,
                }
                if f.unknown_shapes:
                    row["unknown_tensors"] = list(estimator.unknown_tensors)
                if measure:
                    if progress is not None:
                        progress(f"measuring {mc.name} batch {size}" + (f" x {bucket}" if bucket else "") + " ...")
                    try:
                        m = measure_activation_peak(mc, size, bucket, repeat=repeat, timeout_s=timeout_s)
                    except EdgeBatcherError as e:
                        row["measure_error"] = str(e)
                    else:
                        row["measured"] = m.to_json()
                        row["error"] = (f.activations - m.activation_peak) / m.activation_peak
                rows.append(row)
        if measure:
            _add_calibrated_errors(rows, buckets)
        report["models"].append({
            "name": mc.name, "backend": mc.backend, "model_path": str(mc.model_path),
            "weights_bytes": estimator.weights_bytes(), "calibration": estimator.calibration,
            "rows": rows,
        })
    return report


def runs_onnx_graph(backend: str) -> bool:
    """onnxruntime itself, or an engine built on it (the text-embedding model: tokenizer in
    front, the same ONNX graph behind, so the graph's footprint is the model's)."""
    if backend == "onnxruntime":
        return True
    if ":" not in backend:
        return False  # tensorrt, remote, services (rag, generator)
    from ..engines.onnxruntime import OnnxRuntimeEngine
    from ..engines.registry import engine_class

    try:
        cls = engine_class(backend)
    except ConfigError:
        return False
    return isinstance(cls, type) and issubclass(cls, OnnxRuntimeEngine)


def _add_calibrated_errors(rows: list[dict[str, Any]], buckets: list[int | None]) -> None:
    """Per bucket: the factor from the smallest size, applied to the others (never to itself)."""
    for bucket in buckets:
        in_bucket = [r for r in rows if r["seq_len"] == bucket]
        point = in_bucket[0]
        if "measured" not in point:
            continue
        m = point["measured"]
        factor, reason = _factor(point["activations"], m["activation_peak"], m["run_peak"])
        point["calibration"] = {"point": True, "factor": factor, "reason": reason}
        for r in in_bucket[1:]:
            if factor is None or "measured" not in r:
                continue
            calibrated = math.ceil(r["activations"] * factor)
            measured = r["measured"]["activation_peak"]
            r["calibration"] = {"point": False, "factor": factor, "from_batch": point["batch"]}
            r["calibrated_activations"] = calibrated
            r["calibrated_error"] = (calibrated - measured) / measured


def _mib(n: int | float) -> str:
    return f"{n / MiB:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def format_report(report: dict[str, Any]) -> str:
    """The human table: MiB with one decimal."""
    b = report["budget"]
    lines = [
        f"Memory budget: {_mib(b['available_bytes'])} MiB available for batches",
        f"  probe {b['probe']} ({b['source']}): {_mib(b['free_bytes'])} MiB free of {_mib(b['total_bytes'])} MiB; "
        f"reserve {b['reserve_fraction'] * 100:.0f}% ({_mib(b['reserve_fraction'] * b['total_bytes'])} MiB), "
        f"headroom {_mib(b['headroom_bytes'])} MiB"
        + (f", capped at budget_mb = {_mib(b['fixed_bytes'])} MiB" if b["fixed_bytes"] else ""),
        "  fits: weights + activations + KV <= available (the running daemon counts loaded weights as resident)",
        "",
    ]
    measured = "measurement" in report
    header = ["model", "batch", "seq", "weights", "activ.", "KV", "total", "fits"]
    if measured:
        header += ["measured", "error", "calibrated"]
    table: list[list[str]] = [header, ["", "", "", "MiB", "MiB", "MiB", "MiB", ""] + (["MiB", "", "error"] if measured else [])]
    notes: list[str] = []
    for model in report["models"]:
        for r in model["rows"]:
            activ = _mib(r["activations"]) + ("*" if r["unknown_shapes"] else "")
            cells = [
                model["name"], str(r["batch"]), "-" if r["seq_len"] is None else str(r["seq_len"]),
                _mib(r["weights"]), activ, _mib(r["kv_cache"]), _mib(r["total"]),
                "yes" if r["fits"] else "NO",
            ]
            if measured:
                if "measured" in r:
                    m = r["measured"]
                    small = m["run_peak"] < 4 * m["resolution"]
                    cal = r.get("calibration", {})
                    cal_text = (
                        "(cal. point)" if cal.get("point") and cal.get("factor")
                        else _pct(r.get("calibrated_error")) if "calibrated_error" in r else "-"
                    )
                    cells += [_mib(m["activation_peak"]), _pct(r["error"]) + ("~" if small else ""), cal_text]
                else:
                    cells += ["failed", "-", "-"]
                    notes.append(f"{model['name']} batch {r['batch']}: {r.get('measure_error')}")
            table.append(cells)
            if r["unknown_shapes"]:
                note = (f"* {model['name']}: {r['unknown_shapes']} tensor shape(s) guessed "
                        f"({', '.join(r.get('unknown_tensors', [])[:5])})")
                if note not in notes:  # the same tensors at every size: say it once
                    notes.append(note)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    if measured:
        lines += [
            "",
            "measured: RSS high-water rise of one run in a fresh process (CPU EP, arena and memory pattern off,",
            f"  after a warm-up run) + input bytes; resolution about {RESOLUTION_BYTES // KiB} KiB "
            "(~: the run peak is within 4x of it, the error is mostly noise).",
            "error = (estimated - measured) / measured; calibrated: estimate x the factor measured at the",
            "  smallest size of the same bucket (cal. point).",
        ]
        factors = []
        for model in report["models"]:
            for r in model["rows"]:
                cal = r.get("calibration", {})
                where = f"{model['name']} seq {r['seq_len'] or '-'}"
                if cal.get("point") and cal.get("factor"):
                    factors.append(f"{where}: {cal['factor']:.2f}")
                elif cal.get("point"):
                    notes.append(f"{where}: not calibrated: {cal['reason']}")
        if factors:
            lines.append("calibration factors (measured / estimated at the cal. point): " + ", ".join(factors))
    for s in report["skipped"]:
        notes.append(f"skipped {s['name']}: {s['reason']}")
    if notes:
        lines += [""] + notes
    return "\n".join(lines)


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
