"""`edge-batcher estimate`: what each batch of each model needs, next to the device's budget.

For every ONNX Runtime model of the repository, every preferred batch size and every sequence
bucket (or none), the table shows the estimator's figures (estimator.py: weights, peak
activations, KV cache, total), the budget the daemon would plan with right now
(wiring.build_budget) and whether the batch fits, ``total <= available``. Nothing is loaded,
so "total" counts the weights; the running daemon counts them as resident. ``--measure`` also
runs every batch for real (measure.py) and shows the estimator's error before and after
calibration (calibration.py); docs/memory-measurement.md explains both.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import DaemonConfig, ModelConfig, discover_models, load_config
from ..errors import ConfigError, EdgeBatcherError
from .budget import MemoryBudget
from .calibration import trusted_factor
from .device import measure_fresh_engine, measures_device
from .measure import (
    DEFAULT_TIMEOUT_S,
    RESOLUTION_BYTES,
    KiB,
    MiB,
    measure_activation_peak,
)
from .wiring import build_budget

log = logging.getLogger(__name__)


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
    bar = None
    if args.measure:  # a bar on a terminal, a line per size in logs and CI (edge_batcher/progress.py)
        from ..progress import Progress

        measured = [mc for mc in discover_models(Path(config.models.repository), args.model or config.models.load)
                    if mc.model_path.suffix == ".onnx"]
        bar = Progress("estimate --measure", sum(
            len(mc.batching.preferred_batch_sizes) * len(mc.sequence.buckets if mc.sequence else [0])
            for mc in measured))
    try:
        report = build_report(
            config, only=args.model, measure=args.measure, repeat=args.repeat,
            timeout_s=args.timeout, progress=bar.step if bar is not None else None,
        )
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if any(r.get("measure_error") for m in report["models"] for r in m["rows"]) else 0


def budget_json(config: DaemonConfig, budget: MemoryBudget | None = None) -> dict[str, Any]:
    """The daemon's budget right now (wiring.build_budget, so the same as `serve` would use)."""
    budget = budget or build_budget(config.memory)
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
    memory_budget: MemoryBudget | None = None,
) -> dict[str, Any]:
    """The report as a JSON-able dict: budget, models (with rows), skipped models. With
    `measure` on a device (a probe that measures it, a model on a device provider) every row
    also gets the device's growth around its first run (device.measure_fresh_engine)."""
    from .estimator import OnnxFootprintEstimator

    memory_budget = memory_budget or build_budget(config.memory)
    budget = budget_json(config, memory_budget)
    available = budget["available_bytes"]
    on_device = measure and measures_device(memory_budget.probe)
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
                    where = f"{mc.name} batch {size}" + (f" x {bucket}" if bucket else "")
                    log.info("measuring %s", where)
                    if progress is not None:
                        progress(f"measuring {where}")
                    if on_device:
                        _add_device_measurement(row, mc, memory_budget, size, bucket)
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
            _add_device_errors(rows, buckets)
        report["models"].append({
            "name": mc.name, "backend": mc.backend, "model_path": str(mc.model_path),
            "weights_bytes": estimator.weights_bytes(), "calibration": estimator.calibration,
            "rows": rows,
        })
    return report


def _add_device_measurement(row: dict[str, Any], mc: ModelConfig, budget: MemoryBudget, size: int,
                            bucket: int | None) -> None:
    """row["device"]: the device's growth around a fresh engine's load and first run; absent
    when the model's engine does not run on the device (CPU EP: the RSS measurement stands)."""
    try:
        measured = measure_fresh_engine(mc, budget.probe, size, bucket or 0)
    except EdgeBatcherError as e:
        row["device_error"] = str(e)
        return
    if measured is not None:
        row["device"] = measured


def _add_device_errors(rows: list[dict[str, Any]], buckets: list[int | None]) -> None:
    """Per bucket, against its smallest size: what a size holds more (first + second run) next
    to what the estimate says it needs more. The difference leaves out the one-time costs that
    every fresh engine's first run pays (library workspaces: ~64 MiB on an H200)."""
    for bucket in buckets:
        measured = [r for r in rows if r["seq_len"] == bucket and "device" in r and "out_of_memory" not in r["device"]]
        if len(measured) < 2:
            continue
        base = measured[0]
        base_held = base["device"]["first_run"] + base["device"]["second_run"]
        for r in measured[1:]:
            held = r["device"]["first_run"] + r["device"]["second_run"] - base_held
            estimated = r["activations"] - base["activations"]
            r["device_above_smallest"] = held
            r["device_estimate_error"] = (estimated - held) / held if held > 0 else None


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
        factor, reason = trusted_factor(point["activations"], m["activation_peak"], m["run_peak"])
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
    table: list[list[str]] = [
        header, ["", "", "", "MiB", "MiB", "MiB", "MiB", ""] + (["MiB", "", "error"] if measured else [])
    ]
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
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
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
    lines += _device_table(report)
    for s in report["skipped"]:
        notes.append(f"skipped {s['name']}: {s['reason']}")
    if notes:
        lines += [""] + notes
    return "\n".join(lines)


def _device_table(report: dict[str, Any]) -> list[str]:
    """The device's own figures, for the rows measured on it: growth around a fresh engine's
    load and first run (what the daemon counts as resident), next to the raw estimate."""
    table = [["model", "batch", "seq", "load MiB", "run 1 MiB", "run 2 MiB", "run 3 MiB", "held MiB",
              "above smallest", "activ. above", "error"]]
    for model in report["models"]:
        for r in model["rows"]:
            d = r.get("device")
            if d is None:
                continue
            if "out_of_memory" in d:
                table.append([model["name"], str(r["batch"]), str(r["seq_len"] or "-"), "-", "out of memory"]
                             + ["-"] * 6)
                continue
            above = r.get("device_above_smallest")
            smallest = next(x for x in model["rows"] if x["seq_len"] == r["seq_len"])
            table.append([model["name"], str(r["batch"]), str(r["seq_len"] or "-"), _mib(d["load_bytes"]),
                          _mib(d["first_run"]), _mib(d["second_run"]), _mib(d["repeat_run"]),
                          _mib(d["first_run"] + d["second_run"]),
                          "-" if above is None else _mib(above),
                          "-" if above is None else _mib(r["activations"] - smallest["activations"]),
                          _pct(r.get("device_estimate_error"))])
    if len(table) == 1:
        return []
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["", f"Device memory ({report['budget']['source']}): growth around a fresh engine's load and its first "
             "three runs at each size"]
    for row in table:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    lines.append("held = run 1 + run 2 (a memory pattern, where it is on, is allocated on the second run); "
                 "above smallest:")
    lines.append("  held minus the bucket's smallest size's (one-time workspaces cancel out); "
                 "error = (activ. above - above")
    lines.append("  smallest) / above smallest. The daemon counts load and held as resident, run 3 per batch.")
    return lines
