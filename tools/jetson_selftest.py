#!/usr/bin/env python3
"""On-device self-test of the TensorRT backend: run it on the Jetson, paste its report in an issue.

What it does, with the demo model (engines/vibration/model.onnx, from tools/build_demo_models.py):
  1. builds a TensorRT plan with one profile per batch size (1, 2, 4, 8 by default) via
     edge_batcher.engines.trt_build, in a scratch directory;
  2. loads it with the TensorRTEngine backend and measures the memory that took (NvMapMemUsed
     from /proc/meminfo on a Jetson, where cudaMemGetInfo is unreliable; cuMemGetInfo through
     cuda-python or pycuda elsewhere), next to the backend's own memory_footprint();
  3. runs every batch size through TensorRT and through ONNX Runtime on the CPU and compares
     the outputs (tolerances widen for FP16/INT8: see tolerance());
  4. times each size and prints a markdown report (versions, build, correctness, memory,
     throughput).

    python tools/jetson_selftest.py [--fp16] [--dla-core 0] [--sizes 1,2,4,8] [--out report.md]
                                    [--soak SECONDS [--models engines] [--soak-clients 32] [--soak-meter auto]]

With --soak it then soaks a real daemon on the model repository (`make run`'s by default:
every model, services included) with mixed traffic (tools/memory_soak.py): the Jetson's shared
memory after warm-up, the peak under load and the daemon's plan go into the report, and a peak
beyond the plan or an error answer fails it.

Works with TensorRT 10.x (JetPack 6 and 7) and 11.x (desktop GPUs; --fp16 there converts the model
to FP16 first, see edge_batcher/engines/trt_build.py), and with either CUDA binding. The report
names the Jetson module and JetPack (L4T 35/36/38/39), the TensorRT capabilities found and the
binding used. --dla-core on a module without DLA (Jetson Thor, Orin Nano) is refused up front.

Exit codes: 0 all outputs within tolerance; 1 a mismatch or a failure; 2 TensorRT or a CUDA
binding missing, no demo model, or DLA asked of a module without it. The pure parts (meminfo
parsing, tolerances, comparison, report formatting) are importable and unit-tested
(tests/trt/test_trt_selftest.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

DEFAULT_ONNX = ROOT / "engines" / "vibration" / "model.onnx"


# --------------------------------------------------------------------------- pure helpers


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as {key: bytes} ("kB" values converted; unit-less counts kept as they are)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts:
            continue
        try:
            number = int(parts[0])
        except ValueError:
            continue
        values[key.strip()] = number * 1024 if len(parts) > 1 and parts[1].lower() == "kb" else number
    return values


def nvmap_used(meminfo: dict[str, int]) -> int | None:
    """NvMapMemUsed: memory the Jetson's GPU driver holds (None off Jetson / old kernels)."""
    return meminfo.get("NvMapMemUsed")


def parse_l4t_release(text: str) -> str:
    """'# R36 (release), REVISION: 4.3, GCID: ...' -> 'L4T R36.4.3 (JetPack 6.1/6.2)'; '' if unknown."""
    from edge_batcher.memory.jetson import jetpack_for_l4t  # noqa: PLC0415
    from edge_batcher.memory.jetson import parse_l4t_release as parse

    release = parse(text)
    if release is None:
        return ""
    jetpack = jetpack_for_l4t(release[0], release[1])
    return f"L4T R{'.'.join(map(str, release))}" + (f" (JetPack {jetpack.jetpack})" if jetpack else "")


def tolerance(precision: str) -> tuple[float, float, float]:
    """(atol, rtol, allowed fraction of mismatching integer elements) for a plan precision.

    FP32 plans still differ from the CPU in summation order and fused kernels (TF32 is off
    unless asked for), so a small atol. FP16 keeps ~3 significant digits. INT8 depends on the
    calibration; the bound here only catches gross errors. Integer outputs (argmax-like class
    ids) may flip on near ties in reduced precision, so a small fraction may differ there.
    """
    return {"fp32": (1e-4, 1e-3, 0.0), "fp16": (2e-2, 2e-2, 0.02), "int8": (1e-1, 1e-1, 0.05)}[precision]


@dataclass
class Comparison:
    name: str
    max_abs: float
    max_rel: float
    mismatched: int
    total: int
    ok: bool
    note: str = ""


def compare_outputs(reference: dict[str, np.ndarray], got: dict[str, np.ndarray], precision: str) -> list[Comparison]:
    """Compare every reference output with TensorRT's (shape, then values within tolerance())."""
    atol, rtol, frac = tolerance(precision)
    results = []
    for name, ref in reference.items():
        if name not in got:
            results.append(Comparison(name, float("inf"), float("inf"), ref.size, ref.size, False, "missing"))
            continue
        out = got[name]
        if out.shape != ref.shape:
            results.append(Comparison(name, float("inf"), float("inf"), ref.size, ref.size, False,
                                      f"shape {out.shape} != {ref.shape}"))
            continue
        r64, o64 = ref.astype(np.float64), out.astype(np.float64)
        diff = np.abs(o64 - r64)
        max_abs = float(diff.max()) if diff.size else 0.0
        # Relative to |ref|, floored at atol so near-zero references do not read as 100% errors.
        max_rel = float((diff / np.maximum(np.abs(r64), max(atol, 1e-12))).max()) if diff.size else 0.0
        if ref.dtype.kind in "iub":
            mismatched = int(np.count_nonzero(out != ref))
            ok = mismatched <= frac * ref.size
            note = "integer output: exact match required" if frac == 0 else f"up to {frac:.0%} may differ"
        else:
            bad = diff > atol + rtol * np.abs(r64)
            mismatched = int(np.count_nonzero(bad | ~np.isfinite(o64)))
            ok = mismatched == 0
            note = f"atol {atol:g}, rtol {rtol:g}"
        results.append(Comparison(name, max_abs, max_rel, mismatched, int(ref.size), ok, note))
    return results


@dataclass
class SizeResult:
    size: int
    comparisons: list[Comparison]
    ms_per_batch: float
    ort_ms_per_batch: float

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons)

    @property
    def rows_per_s(self) -> float:
        return self.size / (self.ms_per_batch / 1e3) if self.ms_per_batch > 0 else 0.0


@dataclass
class Report:
    versions: dict[str, str]
    build: dict[str, Any]
    sizes: list[SizeResult] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    fake: bool = False
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.sizes) and all(s.ok for s in self.sizes)


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def format_report(report: Report) -> str:
    """The markdown report (self-contained: paste it into an issue)."""
    lines = ["## edge-batcher TensorRT self-test", ""]
    if report.fake:
        lines += ["> **FAKE TensorRT** (tests/fakes/fake_tensorrt.py): this run proves the plumbing only, "
                  "not TensorRT, a GPU or a Jetson.", ""]
    lines.append(f"**Result: {'PASS' if report.ok else 'FAIL'}**" + (f": {report.error}" if report.error else ""))
    lines += ["", "### Versions", "", "| component | version |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in report.versions.items()]
    if report.build:
        lines += ["", "### Build", "", "| | |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in report.build.items()]
    if report.sizes:
        lines += ["", "### Correctness (TensorRT vs ONNX Runtime CPU)", "",
                  "| batch | output | max abs diff | max rel diff | mismatched | tolerance | ok |",
                  "|---:|---|---:|---:|---:|---|:-:|"]
        for s in report.sizes:
            for c in s.comparisons:
                lines.append(f"| {s.size} | {c.name} | {c.max_abs:.3g} | {c.max_rel:.3g} | {c.mismatched}/{c.total} "
                             f"| {c.note} | {'yes' if c.ok else '**NO**'} |")
        lines += ["", "### Throughput", "",
                  "| batch | TensorRT ms/batch | rows/s | ONNX Runtime CPU ms/batch | speed-up |",
                  "|---:|---:|---:|---:|---:|"]
        for s in report.sizes:
            speedup = s.ort_ms_per_batch / s.ms_per_batch if s.ms_per_batch > 0 else 0.0
            lines.append(f"| {s.size} | {s.ms_per_batch:.3f} | {s.rows_per_s:.0f} | {s.ort_ms_per_batch:.3f} "
                         f"| {speedup:.1f}x |")
    if report.memory:
        m = report.memory
        lines += ["", "### Memory (one engine instance)", "", "| | bytes | |", "|---|---:|---|"]
        for key, label in (("estimate_total", "backend estimate (weights + reserved)"),
                           ("weights", "  weights"), ("reserved", "  activations + I/O buffers"),
                           ("measured", f"measured ({m.get('source', '?')})")):
            if key in m:
                lines.append(f"| {label} | {m[key] if m[key] is not None else 'n/a'} | {_mib(m[key])} |")
        if m.get("estimate_total") and m.get("measured"):
            lines.append(f"| measured / estimate | {m['measured'] / m['estimate_total']:.2f} | |")
        if m.get("note"):
            lines += ["", m["note"]]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- device parts


def read_versions(trt: Any, cuda: Any, root: Path = Path("/")) -> dict[str, str]:
    """Versions for the report; `cuda` is an edge_batcher.engines.cuda_api.CudaApi."""
    from edge_batcher.engines.tensorrt import tensorrt_capabilities  # noqa: PLC0415
    from edge_batcher.memory.jetson import read_jetson_info  # noqa: PLC0415

    versions = {"python": platform.python_version(), "machine": platform.machine()}
    jetson = read_jetson_info(root)
    versions["jetson"] = jetson.describe() if jetson else "not a Jetson (no /etc/nv_tegra_release)"
    versions["TensorRT"] = tensorrt_capabilities(trt).describe() + (
        " (FakeTensorRT)" if getattr(trt, "IS_FAKE", False) else "")
    versions["CUDA binding"] = cuda.name + (" (fake)" if getattr(getattr(cuda, "d", None), "IS_FAKE", False) else "")
    try:
        v = cuda.driver_version()
        versions["CUDA driver"] = f"{v // 1000}.{v % 1000 // 10}"
    except Exception:
        versions["CUDA driver"] = "?"
    try:
        major, minor = cuda.compute_capability(0)
        versions["GPU"] = f"{cuda.device_name(0)} (compute {major}.{minor})"
    except Exception:
        versions["GPU"] = "?"
    try:
        import onnxruntime  # noqa: PLC0415

        versions["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        versions["onnxruntime"] = "not installed"
    return versions


class MemoryMeter:
    """Device memory in use: NvMapMemUsed on a Jetson (unified memory: cudaMemGetInfo is not the
    GPU's share there), else total - free from cuMemGetInfo (`cuda`: a CudaApi)."""

    def __init__(self, cuda: Any, root: Path = Path("/")):
        self.cuda = cuda
        self.meminfo = root / "proc" / "meminfo"
        try:
            self.jetson = nvmap_used(parse_meminfo(self.meminfo.read_text())) is not None
        except OSError:
            self.jetson = False
        self.source = "NvMapMemUsed (/proc/meminfo)" if self.jetson else "cuMemGetInfo (total - free)"

    def used(self) -> int | None:
        if self.jetson:
            return nvmap_used(parse_meminfo(self.meminfo.read_text()))
        ctx = self.cuda.open_device(0)
        ctx.push()
        try:
            free, total = self.cuda.mem_get_info()
        finally:
            ctx.pop()
            ctx.release()
        return int(total - free)


def _time(fn, iterations: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - t0) / iterations * 1e3


def run_selftest(args: argparse.Namespace, trt: Any, cuda: Any, workdir: Path) -> Report:
    import onnxruntime as ort  # noqa: PLC0415

    from edge_batcher.config import load_model_config  # noqa: PLC0415
    from edge_batcher.engines import trt_build  # noqa: PLC0415
    from edge_batcher.engines.tensorrt import TensorRTEngine  # noqa: PLC0415
    from edge_batcher.types import DATATYPE_TO_NUMPY  # noqa: PLC0415

    cuda.init()
    report = Report(versions=read_versions(trt, cuda, args.root), build={}, fake=bool(getattr(trt, "IS_FAKE", False)))
    parser = trt_build.make_parser()
    build_argv = [str(args.onnx), "--repository", str(workdir), "--model", "selftest", "--sizes", args.sizes, "--force"]
    if args.fp16:
        build_argv.append("--fp16")
    if args.dla_core >= 0:
        build_argv += ["--dla-core", str(args.dla_core)]
    if args.workspace_mb:
        build_argv += ["--workspace-mb", str(args.workspace_mb)]
    request = trt_build.request_from_args(parser.parse_args(build_argv))
    result = trt_build.build_engine(request, trt, cuda, write=lambda line: print(line, file=sys.stderr))
    info = json.loads(result.info.read_text())
    report.build = {"precision": request.precision, "precision from": info.get("precision_from", "?"),
                    "profiles": len(request.profiles),
                    "sizes": args.sizes, "DLA core": args.dla_core if args.dla_core >= 0 else "none (GPU)",
                    "build time": f"{result.seconds:.1f} s", "plan size": _mib(result.plan_bytes)}

    meter = MemoryMeter(cuda, args.root)
    before = meter.used()
    config = load_model_config(request.model_dir)
    engine = TensorRTEngine(config, trt_module=trt, cuda_module=cuda)
    engine.load()
    try:
        after = meter.used()
        sizes = config.batching.preferred_batch_sizes
        fp = engine.memory_footprint(sizes[-1])
        report.memory = {
            "source": meter.source, "weights": fp["weights"], "reserved": fp["reserved"],
            "estimate_total": fp["weights"] + fp["reserved"],
            "measured": None if before is None or after is None else after - before,
            "note": "Measured includes what TensorRT and CUDA load once per process (kernels, cuBLAS/cuDNN "
                    "workspaces) on the first engine, so it exceeds the estimate most on a fresh process.",
        }
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        session = ort.InferenceSession(str(args.onnx), opts, providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        rng = np.random.default_rng(0)
        for size in sizes:
            feeds = {}
            for spec in engine.inputs:
                shape = [size, *spec.shape[1:]]
                dtype = DATATYPE_TO_NUMPY[spec.datatype]
                values = rng.normal(0.0, 1.0, size=shape) if dtype.kind == "f" else rng.integers(0, 2, size=shape)
                feeds[spec.name] = values.astype(dtype)
            ref = dict(zip(names, session.run(names, feeds)))
            got = engine.infer(feeds)
            ms = _time(lambda feeds=feeds: engine.infer(feeds), args.iterations)
            ort_ms = _time(lambda feeds=feeds: session.run(names, feeds), max(1, args.iterations // 5))
            report.sizes.append(SizeResult(size, compare_outputs(ref, got, request.precision), ms, ort_ms))
    finally:
        engine.close()
    return report


def main(argv: list[str] | None = None, trt_module: Any = None, cuda_module: Any = None) -> int:
    p = argparse.ArgumentParser(description="TensorRT backend self-test for a Jetson (prints a markdown report)")
    p.add_argument("--onnx", type=Path, default=DEFAULT_ONNX, help="ONNX model (default: the demo vibration model)")
    p.add_argument("--sizes", default="1,2,4,8", help="batch sizes (default 1,2,4,8)")
    p.add_argument("--fp16", action="store_true", help="build an FP16 plan")
    p.add_argument("--dla-core", type=int, default=-1, help="build for this DLA core (needs --fp16)")
    p.add_argument("--workspace-mb", type=int, default=0)
    p.add_argument("--iterations", type=int, default=50, help="timed batches per size")
    p.add_argument("--workdir", type=Path, help="keep the built plan here (default: a temporary directory)")
    p.add_argument("--out", type=Path, help="also write the report to this file")
    p.add_argument("--soak", type=float, metavar="SECONDS", help="then soak a real daemon with mixed traffic")
    p.add_argument("--models", type=Path, default=ROOT / "engines", help="the soak's model repository")
    p.add_argument("--soak-clients", type=int, default=32, help="the soak's concurrent connections (default 32)")
    p.add_argument("--soak-meter", choices=("auto", "device", "process"), default="auto",
                   help="the soak's meter (tools/memory_soak.py --meter; default auto: the Jetson's or GPU's)")
    p.add_argument("--root", type=Path, default=Path("/"), help=argparse.SUPPRESS)  # tests: a fake Jetson root
    args = p.parse_args(argv)

    from edge_batcher.engines.tensorrt import import_tensorrt  # noqa: PLC0415
    from edge_batcher.errors import ConfigError  # noqa: PLC0415
    from edge_batcher.memory.jetson import read_jetson_info  # noqa: PLC0415

    try:  # the backend's own check: TensorRT >= 10 and a CUDA binding present
        modules = import_tensorrt(trt_module, cuda_module)
    except ConfigError as exc:
        print(f"jetson_selftest: TensorRT and a CUDA binding (cuda-python or pycuda) are needed ({exc}). This test "
              "only means something on the device.", file=sys.stderr)
        return 2
    trt, cuda = modules.trt, modules.cuda
    print(f"jetson_selftest: {modules.describe()}", file=sys.stderr)
    if not args.onnx.is_file():
        print(f"jetson_selftest: {args.onnx} not found; build the demo model first: python tools/build_demo_models.py",
              file=sys.stderr)
        return 2
    if args.dla_core >= 0 and not args.fp16:
        print("jetson_selftest: --dla-core needs --fp16 (DLA has no FP32)", file=sys.stderr)
        return 2
    jetson = read_jetson_info(args.root)
    if args.dla_core >= 0 and jetson and jetson.module and jetson.module.dla_cores == 0:
        print(f"jetson_selftest: --dla-core {args.dla_core}: {jetson.module.name} has no DLA "
              "(run without --dla-core: the GPU serves the model)", file=sys.stderr)
        return 2

    def go(workdir: Path) -> Report:
        try:
            return run_selftest(args, trt, cuda, workdir)
        except Exception as exc:  # report whatever broke, with the versions, instead of a bare traceback
            import traceback  # noqa: PLC0415

            traceback.print_exc()
            try:
                cuda.init()
                versions = read_versions(trt, cuda, args.root)
            except Exception:
                versions = {"TensorRT": str(getattr(trt, "__version__", "?"))}
            return Report(versions=versions, build={}, fake=bool(getattr(trt, "IS_FAKE", False)),
                          error=f"{type(exc).__name__}: {exc}")

    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        report = go(args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="eb-selftest-") as tmp:
            report = go(Path(tmp))
    text = format_report(report)
    ok = report.ok
    if args.soak:
        soak_text, soak_ok = memory_soak_section(args)
        text += soak_text
        ok = ok and soak_ok
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if ok else 1


def memory_soak_section(args: argparse.Namespace) -> tuple[str, bool]:
    """The report's section for tools/memory_soak.py on args.models: (markdown, passed)."""
    sys.path.insert(1, str(ROOT / "tools"))
    import memory_soak  # noqa: PLC0415

    try:
        result = memory_soak.run_soak(models=str(args.models), seconds=args.soak, clients=args.soak_clients,
                                      meter=args.soak_meter)
    except RuntimeError as exc:
        return f"\n## Memory under traffic\n\n**FAIL**: {exc}\n", False
    return f"\n## Memory under traffic (tools/memory_soak.py)\n\n```\n{result.report()}\n```\n", not result.failures()


if __name__ == "__main__":
    sys.exit(main())
