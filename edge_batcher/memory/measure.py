"""Measuring one batch's activation peak for real: the harness behind `edge-batcher estimate
--measure` and calibration at load.

`measure_activation_peak` runs one batch of an ONNX Runtime model (CPU execution provider) in a
fresh Python subprocess per measurement and reports the rise of the process's resident set
during the run, plus the input bytes. Blocking (a second or more per run): call it off the
event loop. The method, its resolution and the alternatives considered are in
docs/memory-measurement.md. The child half (below `_child_main`) imports numpy and
onnxruntime only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..config import ModelConfig, load_model_config
from ..errors import EdgeBatcherError

KiB = 1 << 10
MiB = 1 << 20

# glibc: allocations of at least this many bytes get their own mmap in the measuring child.
MMAP_THRESHOLD_BYTES = 64 * KiB
# How far a measured run peak can be off (docs/memory-measurement.md, "Resolution").
RESOLUTION_BYTES = 256 * KiB
DEFAULT_TIMEOUT_S = 300.0

_OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
               "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}  # fmt: skip


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
    subprocesses (docs/memory-measurement.md explains the method) and returns the median. seq_len is
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


def _run_child(spec: dict[str, Any], name: str, timeout_s: float, python: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD_BYTES)
    root = str(Path(__file__).resolve().parents[2])  # so the child imports this very package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [python or sys.executable, "-m", "edge_batcher.memory.measure", "--measure-child", json.dumps(spec)]
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
    result: dict[str, Any] = json.loads(lines[-1])  # the child's one JSON object
    return result


# The part below runs in the measuring child: numpy and onnxruntime only, no daemon imports.

_ORT_NUMPY = {
    "tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
    "tensor(int8)": "int8", "tensor(int16)": "int16", "tensor(int32)": "int32",
    "tensor(int64)": "int64", "tensor(uint8)": "uint8", "tensor(uint16)": "uint16",
    "tensor(uint32)": "uint32", "tensor(uint64)": "uint64", "tensor(bool)": "bool",
}  # fmt: skip


def _input_shapes(inputs: list[Any], spec: dict[str, Any]) -> dict[str, tuple[str, list[int]]]:
    """Concrete (numpy dtype, shape) of every session input: dim 0 is the batch, the sequence
    axis of the [sequence] inputs is seq_len, a symbolic dim shared with one of those takes
    its value, model.toml's [[inputs]] shapes fix the rest."""
    symbols: dict[str, int] = {}
    plan: dict[str, list[Any]] = {}  # dims: ints, or the model's symbolic names
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


def _read_status(fh: BinaryIO) -> dict[str, int]:
    fh.seek(0)
    values: dict[str, int] = {}
    for line in fh.read().decode().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values


def _child_measure(spec: dict[str, Any]) -> dict[str, Any]:
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

    def make_inputs() -> dict[str, Any]:
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
        print("usage: python -m edge_batcher.memory.measure --measure-child SPEC_JSON", file=sys.stderr)
        return 2
    try:
        result = _child_measure(json.loads(argv[1]))
    except Exception as e:  # reported to the parent through stderr and the exit status
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")




if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
