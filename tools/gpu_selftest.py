#!/usr/bin/env python3
"""The first thing to run on a GPU machine or a Jetson: does edge-batcher see the device right?

One run prints its checks and exits non-zero when one fails:

  1. probes: every memory probe that applies here (cuda, nvml; jetson on a Jetson) next to
     `nvidia-smi` (discrete GPU) or `tegrastats` (Jetson); a free figure more than
     PROBE_TOLERANCE_MIB off fails;
  2. parity: every ONNX model of the repository run on the CUDA EP and on the CPU EP with the
     same random inputs; outputs further apart than rtol/atol 1e-3 fail;
  3. device memory: each model loaded the way the daemon loads it (runtime.load_runner, CUDA EP,
     the daemon's budget, warm-up), what admission counts as resident next to what the device
     lost (the probe before and after), and per size the liveness estimate next to the
     measured first-run growth (memory/device.py); resident more than 10% off fails;
  4. bench: a few seconds of raw engine throughput per size on the CUDA EP, rows/s;
  5. budget: `[memory] budget_mb` as a ceiling, on the first model with length buckets: at 60%
     of what it measured it is refused with the figures; between two sizes only the sizes that
     fit are served and the device holds no more than the budget;
  6. with --soak SECONDS: tools/memory_soak.py, a real daemon on the repository with its models
     on the CUDA EP and mixed traffic from --soak-clients connections over every model; device
     memory after warm-up, the peak under load and the daemon's plan; fails when a request gets
     an error or the peak exceeds the plan by more than 5% of the models' resident memory.

Models that are not ONNX files (services such as rag, TensorRT plans) are skipped with a line
saying so; a service still gets traffic in the soak. Without a GPU (no CUDA execution provider,
no nvidia-smi, not a Jetson) it says so, runs the CPU probe and, with --soak, the soak on the CPU
(the daemon's resident memory against its plan), and exits 0 when that passes (2 with
--require-gpu). Its checks are in docs/memory.md.

    python tools/gpu_selftest.py [--models engines] [--model NAME ...] [--bench-s 2] [--require-gpu]
                                 [--soak SECONDS] [--soak-clients 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(1, str(ROOT / "tools"))  # memory_soak, also when this file is imported

from edge_batcher.config import (  # noqa: E402
    ExecutionProvider,
    ModelConfig,
    discover_models,
    load_config,
)
from edge_batcher.memory import probe as probes  # noqa: E402
from edge_batcher.memory.device import device_used, warmup_batch  # noqa: E402

MiB = 1 << 20
PROBE_TOLERANCE_MIB = 64  # nvidia-smi reports MiB; the probe's own context and others' churn move it
RESIDENT_TOLERANCE = 0.10
PARITY_RTOL = PARITY_ATOL = 1e-3
CUDA_EP = "CUDAExecutionProvider"


@dataclasses.dataclass
class Check:
    section: str
    name: str
    ok: bool | None  # None: information, not a check
    detail: str


def parse_nvidia_smi(text: str) -> list[dict[str, int]]:
    """`nvidia-smi --query-gpu=memory.total,memory.used,memory.free --format=csv,noheader,nounits`
    -> [{"total": bytes, "used": bytes, "free": bytes}] per GPU."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            total, used, free = (int(p) * MiB for p in parts)
            gpus.append({"total": total, "used": used, "free": free})
    return gpus


def parse_tegrastats(line: str) -> dict[str, int] | None:
    """'RAM 2391/7620MB (lfb ...' -> {"used": bytes, "total": bytes}; None if absent."""
    marker = line.find("RAM ")
    if marker < 0:
        return None
    try:
        used, total = line[marker + 4:].split("MB", 1)[0].split("/")
        return {"used": int(used) * MiB, "total": int(total) * MiB}
    except ValueError:
        return None


def gpu_present() -> tuple[bool, str]:
    """(True, what) when a GPU can be tested here; (False, why not)."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if probes.is_jetson():
        return CUDA_EP in available, "Jetson" + (
            "" if CUDA_EP in available else f", but {CUDA_EP} is not in this onnxruntime build")
    if CUDA_EP not in available:
        return False, f"{CUDA_EP} is not in this onnxruntime build ({', '.join(available)})"
    if shutil.which("nvidia-smi") is None:
        return False, "nvidia-smi not found (no NVIDIA driver)"
    return True, "discrete NVIDIA GPU"


def check_probes(on_gpu: bool) -> list[Check]:
    checks: list[Check] = []
    if not on_gpu:
        snap = probes.CpuProbe().read()
        checks.append(Check("probes", "cpu", None, f"{snap.free_bytes / MiB:.0f} MiB free of "
                            f"{snap.total_bytes / MiB:.0f} MiB ({snap.source})"))
        return checks
    if probes.is_jetson():
        snap = probes.JetsonProbe().read()
        stats = _tegrastats()
        if stats is None:
            checks.append(Check("probes", "jetson vs tegrastats", False, "tegrastats gave no RAM figure"))
        else:
            used = snap.total_bytes - snap.details["memavailable"]
            ok = abs(stats["used"] - used) <= 4 * PROBE_TOLERANCE_MIB * MiB
            checks.append(Check("probes", "jetson vs tegrastats", ok,
                                f"probe used {used / MiB:.0f} MiB (MemTotal - MemAvailable), "
                                f"tegrastats RAM {stats['used'] / MiB:.0f}/{stats['total'] / MiB:.0f} MiB; "
                                f"free {snap.free_bytes / MiB:.0f} MiB"))
        return checks
    for kind in ("cuda", "nvml"):
        try:
            snap = probes.detect_probe(kind).read()
        except Exception as e:  # a missing binding is a failed check here, with its reason
            checks.append(Check("probes", kind, False, f"cannot read: {e}"))
            continue
        smi = parse_nvidia_smi(_run(["nvidia-smi", "--query-gpu=memory.total,memory.used,memory.free",
                                     "--format=csv,noheader,nounits"]))
        if not smi:
            checks.append(Check("probes", kind, False, "nvidia-smi gave no memory figures"))
            continue
        diff = abs(smi[0]["free"] - snap.free_bytes)
        checks.append(Check("probes", f"{kind} vs nvidia-smi", diff <= PROBE_TOLERANCE_MIB * MiB,
                            f"free {snap.free_bytes / MiB:.0f} vs {smi[0]['free'] / MiB:.0f} MiB, "
                            f"total {snap.total_bytes / MiB:.0f} vs {smi[0]['total'] / MiB:.0f} MiB"))
    return checks


def on_cuda(mc: ModelConfig) -> ModelConfig:
    ort_settings = dataclasses.replace(
        mc.onnxruntime, execution_providers=[ExecutionProvider(CUDA_EP), ExecutionProvider("CPUExecutionProvider")])
    return dataclasses.replace(mc, onnxruntime=ort_settings)


def random_feeds(session, mc: ModelConfig, size: int, seq_len: int | None) -> dict[str, np.ndarray]:
    from edge_batcher.memory.measure import _input_shapes

    spec = {"batch": size, "seq_len": seq_len, "sequence_inputs": list(mc.sequence.inputs) if mc.sequence else [],
            "sequence_axis": mc.sequence.axis if mc.sequence else None,
            "overrides": {o.name: list(o.shape) for o in mc.inputs if o.shape}}
    rng = np.random.default_rng(0)
    return {name: (rng.standard_normal(shape).astype(dtype) if dtype.startswith("float") else np.ones(shape, dtype))
            for name, (dtype, shape) in _input_shapes(session.get_inputs(), spec).items()}


def onnx_models(models: list[ModelConfig]) -> tuple[list[ModelConfig], list[Check]]:
    """The models this tool loads itself (ONNX files), and a line for each one it skips."""
    from edge_batcher.engines.registry import is_service

    kept, skipped = [], []
    for mc in models:
        if is_service(mc.backend):
            skipped.append(Check("models", mc.name, None, f"skipped: a service (backend {mc.backend!r}), "
                                 "not a model file; it gets traffic in the soak"))
        elif mc.model_path.suffix != ".onnx" or not mc.model_path.is_file():
            skipped.append(Check("models", mc.name, None, f"skipped: {mc.model_path.name} is not an ONNX file here"))
        else:
            kept.append(mc)
    return kept, skipped


def soak(args: argparse.Namespace, on_gpu: bool) -> list[Check]:
    """tools/memory_soak.py on the repository, the models on the CUDA EP when there is a GPU."""
    import tempfile

    import memory_soak

    with tempfile.TemporaryDirectory(prefix="eb-selftest-") as tmp:
        models = args.models
        if on_gpu:
            models = str(Path(tmp) / "engines")
            on_cuda_repository(Path(args.models), Path(models))
        try:
            result = memory_soak.run_soak(config=args.config, models=models, seconds=args.soak,
                                          clients=args.soak_clients, meter="device" if on_gpu else "process")
        except RuntimeError as exc:
            return [Check("soak", "daemon", False, str(exc).splitlines()[0])]
    print(result.memory_log)
    print(result.report())
    failures = result.failures()
    return [Check("soak", f"{result.meter} memory under load", not failures,
                  f"after warm-up {result.ready / MiB:.0f} MiB, peak {result.peak / MiB:.0f} MiB, plan "
                  f"{result.planned / MiB:.0f} MiB; {result.requests} requests "
                  + ("" if not failures else "; " + "; ".join(failures)))]


def on_cuda_repository(source: Path, target: Path) -> None:
    """A copy of the repository whose ONNX Runtime models run on the CUDA EP first."""
    shutil.copytree(source, target, symlinks=True)
    for toml in target.glob("*/model.toml"):
        text = toml.read_text()
        if "[onnxruntime]" in text and "CUDAExecutionProvider" not in text:
            text = text.replace('execution_providers = ["CPUExecutionProvider"]',
                                'execution_providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]')
            toml.write_text(text)


def check_parity(models: list[ModelConfig]) -> list[Check]:
    import onnxruntime as ort

    checks = []
    for mc in models:
        size = mc.batching.preferred_batch_sizes[-1]
        seq_len = mc.sequence.buckets[-1] if mc.sequence else None
        cpu = ort.InferenceSession(str(mc.model_path), providers=["CPUExecutionProvider"])
        gpu = ort.InferenceSession(str(mc.model_path), providers=[CUDA_EP, "CPUExecutionProvider"])
        if gpu.get_providers()[0] != CUDA_EP:
            checks.append(Check("parity", mc.name, False, f"the session fell back to {gpu.get_providers()}"))
            continue
        feeds = random_feeds(cpu, mc, size, seq_len)
        worst = 0.0
        ok = True
        for a, b in zip(cpu.run(None, feeds), gpu.run(None, feeds)):
            if np.issubdtype(np.asarray(a).dtype, np.floating):
                worst = max(worst, float(np.max(np.abs(a - b))) if a.size else 0.0)
                ok = ok and bool(np.allclose(a, b, rtol=PARITY_RTOL, atol=PARITY_ATOL))
            else:
                ok = ok and bool(np.array_equal(a, b))
        checks.append(Check("parity", mc.name, ok,
                            f"batch {size}{f' x {seq_len}' if seq_len else ''}: max |CUDA - CPU| {worst:.2e}"))
    return checks


def check_device_memory(models: list[ModelConfig], daemon_config) -> tuple[list[Check], dict[str, Any]]:
    from edge_batcher.memory.wiring import build_budget, release_resident
    from edge_batcher.metrics import Metrics
    from edge_batcher.runtime import load_runner

    checks = []
    runners = {}
    budget = build_budget(daemon_config.memory)
    for mc in models:
        before = device_used(budget.probe)
        runner = load_runner(on_cuda(mc), Metrics(), warmup=True, budget=budget)
        lost = device_used(budget.probe) - before
        admission = runner.admission
        if admission is None or admission.device is None:
            checks.append(Check("memory", mc.name, False, f"not measured on the device (probe {budget.probe.name}, "
                                f"providers {runner.engines[0].providers})"))
        else:
            error = (runner.resident_bytes - lost) / lost if lost else 0.0
            checks.append(Check("memory", f"{mc.name} resident", abs(error) <= RESIDENT_TOLERANCE,
                                f"counted {runner.resident_bytes / MiB:.1f} MiB, device lost {lost / MiB:.1f} MiB "
                                f"({error * 100:+.1f}%); load {admission.device.load_bytes / MiB:.1f} MiB, "
                                f"arena {admission.device.arena_bytes / MiB:.1f} MiB"))
            for (size, bucket), m in sorted(admission.device.sizes.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                est = admission.estimator.activation_peak(size, bucket or None) if admission.estimator else 0
                factor = admission.estimator.calibration_for(bucket or None) if admission.estimator else 0
                checks.append(Check("memory", f"{mc.name} {size}{f'x{bucket}' if bucket else ''}", None,
                                    f"runs 1, 2, 3: +{m.first_run[0] / MiB:.1f}, +{m.second_run[0] / MiB:.1f}, "
                                    f"+{m.repeat_run / MiB:.1f} MiB; "
                                    f"liveness estimate x{factor:.2f} "
                                    f"= {est / MiB:.1f} MiB"))
                if m.repeat_run > 0:
                    checks.append(Check("memory", f"{mc.name} {size} settled", False,
                                        f"a third run still grew {m.repeat_run / MiB:.1f} MiB"))
        runners[mc.name] = runner
    for runner in runners.values():
        release_resident(budget, runner.resident_bytes)
    return checks, runners


def check_budget(mc: ModelConfig, daemon_config) -> list[Check]:
    """[memory] budget_mb as a ceiling on the device, for one model: measured without a budget
    (resident R), then a budget of 0.6 R must refuse it with the figures and give everything
    back, and a budget that leaves out half of the last size's growth must serve only the sizes
    that fit, holding no more than the budget."""
    from edge_batcher.memory.device import ModelDoesNotFit
    from edge_batcher.memory.wiring import build_budget, release_resident
    from edge_batcher.metrics import Metrics
    from edge_batcher.runtime import load_runner

    def budget_of(mb: float):
        return build_budget(dataclasses.replace(daemon_config.memory, budget_mb=mb))

    mc = on_cuda(mc)
    budget = budget_of(0)
    runner = load_runner(mc, Metrics(), warmup=False, budget=budget)
    device = runner.admission.device if runner.admission is not None else None
    resident = runner.resident_bytes
    runner.close_unstarted()
    release_resident(budget, resident)
    if device is None:
        return [Check("budget", mc.name, False, "not measured on the device")]
    checks = []
    below = budget_of(round(0.6 * resident / MiB, 1))
    before = device_used(below.probe)
    try:
        refused = load_runner(mc, Metrics(), warmup=False, budget=below)
        refused.close_unstarted()
        checks.append(Check("budget", f"{mc.name} at 60%", False, f"loaded within {below.fixed_bytes / MiB:.1f} MiB "
                            f"although it measured {resident / MiB:.1f} MiB"))
    except ModelDoesNotFit as exc:
        back = device_used(below.probe) - before
        checks.append(Check("budget", f"{mc.name} at 60%", back <= 4 * MiB, f"refused: {exc}; device memory "
                            f"{back / MiB:+.1f} MiB after"))
    last = list(device.sizes.values())[-1]
    if sum(last.held) < 4 * MiB:
        checks.append(Check("budget", f"{mc.name} between sizes", None, f"skipped: its last size grew only "
                            f"{sum(last.held) / MiB:.1f} MiB, too little to set a budget within"))
        return checks
    between = budget_of(round((resident - sum(last.held) // 2) / MiB, 1))
    before = device_used(between.probe)
    runner = load_runner(mc, Metrics(), warmup=True, budget=between)
    held = device_used(between.probe) - before
    profile = runner.admission.device
    served = sorted({s for s, b in profile.sizes if not profile.refuses(s, b)})
    ok = (held <= between.fixed_bytes and bool(profile.failed) and runner.admission.fits(served[0], last.bucket)
          and not runner.admission.fits(last.size, last.bucket))
    checks.append(Check("budget", f"{mc.name} between sizes", ok,
                        f"budget {between.fixed_bytes / MiB:.1f} MiB: holds {held / MiB:.1f} MiB, sizes measured "
                        f"{served}, not served: {'; '.join(profile.failed.values())}"))
    runner.close_unstarted()
    release_resident(between, runner.resident_bytes)
    return checks


def bench(runners: dict[str, Any], seconds: float) -> list[Check]:
    checks = []
    for name, runner in runners.items():
        engine = runner.engines[0]
        config = runner.config
        bucket = config.sequence.buckets[-1] if config.sequence else 0
        for size in config.batching.preferred_batch_sizes:
            batch = warmup_batch(engine.batch_inputs or engine.inputs, config, size, bucket)
            runs, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / len(config.batching.preferred_batch_sizes):
                engine.infer(batch)
                runs += 1
            elapsed = time.perf_counter() - t0
            checks.append(Check("bench", f"{name} {size}{f'x{bucket}' if bucket else ''}", None,
                                f"{runs * size / elapsed:.0f} rows/s, "
                                f"{elapsed / runs * 1e3:.2f} ms a batch ({runs} runs)"))
        for engine in runner.engines:
            engine.close()
    return checks


def format_checks(checks: list[Check]) -> str:
    rows = [("section", "check", "result", "detail")] + [
        (c.section, c.name, "info" if c.ok is None else "ok" if c.ok else "FAIL", c.detail) for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="daemon config (its [memory] section is the budget)")
    ap.add_argument("--models", default=str(ROOT / "engines"), help="model repository (default: engines/)")
    ap.add_argument("--model", action="append", metavar="NAME", help="only this model (repeatable)")
    ap.add_argument("--bench-s", type=float, default=2.0, help="seconds of bench per model (default 2)")
    ap.add_argument("--require-gpu", action="store_true", help="exit 2 when there is no GPU to test")
    ap.add_argument("--soak", type=float, metavar="SECONDS", help="also soak a real daemon with mixed traffic")
    ap.add_argument("--soak-clients", type=int, default=32, help="concurrent connections of the soak (default 32)")
    args = ap.parse_args(argv)

    import onnxruntime as ort

    on_gpu, what = gpu_present()
    print(f"edge-batcher GPU self-test: Python {sys.version.split()[0]}, onnxruntime {ort.__version__}")
    print(f"device: {what}" if on_gpu else f"NO GPU: {what}. Degraded mode: the CPU probe (and the soak, on the "
          "CPU); parity, device memory and bench need a GPU and were skipped.")
    config = load_config(args.config)
    models, skipped = onnx_models(discover_models(Path(args.models), args.model or []))
    checks = check_probes(on_gpu) + skipped
    if on_gpu:
        checks += check_parity(models)
        memory, runners = check_device_memory(models, config)
        checks += memory
        checks += bench(runners, args.bench_s)
        checks += check_budget(next((mc for mc in models if mc.sequence), models[0]), config)
    else:
        checks.append(Check("gpu", "parity, device memory, bench", None, "skipped: no GPU"))
    if args.soak:
        checks += soak(args, on_gpu)
    print(format_checks(checks))
    failed = [c for c in checks if c.ok is False]
    if failed:
        print(f"{len(failed)} check(s) failed")
        return 1
    if not on_gpu and args.require_gpu:
        return 2
    return 0


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _tegrastats() -> dict[str, int] | None:
    try:
        proc = subprocess.Popen(["tegrastats", "--interval", "200"], stdout=subprocess.PIPE, text=True)
    except OSError:
        return None
    try:
        line = proc.stdout.readline() if proc.stdout else ""
    finally:
        proc.terminate()
        proc.wait(timeout=5)
    return parse_tegrastats(line)


if __name__ == "__main__":
    sys.exit(main())
