#!/usr/bin/env python3
"""Accuracy of the activation estimator against what ONNX Runtime really uses.

For the vibration demo model (batch 1/2/4/8, plus larger batches where its activations rise
above the measurement's resolution) and the random-weight encoder (batch 1/2/4/8 at sequence
length 128), prints the raw liveness estimate (OnnxFootprintEstimator.activation_peak), the
measured activation peak (edge_batcher.memory.report.measure_activation_peak: RSS high-water
rise of one run in a fresh subprocess, CPU EP, arena and memory pattern off, + input bytes;
median of --repeat runs) and the error (estimated - measured) / measured.

Calibration is honest: the factor measured / estimated is taken at ONE size per (model, seq)
(--calibrate-at, default 2) and applied to the other sizes; the calibration row itself has no
calibrated error. report.calibration_factor refuses measurements too small to trust (below
report.MIN_CALIBRATION_BYTES), in which case the calibrated estimate is the raw one.

--arena also measures with ONNX Runtime's defaults (arena + memory pattern on, first run of a
fresh process), i.e. what the daemon's own process grows by, for comparison.

Usage::

    python tools/bench_estimator.py [--repo DIR] [--repeat 3] [--calibrate-at 2] [--arena] [--json]

Without --repo the two models are built into a temporary directory first (about 10 s).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_batcher.config import load_model_config  # noqa: E402
from edge_batcher.memory.calibration import MIN_CALIBRATION_BYTES, calibration_factor  # noqa: E402
from edge_batcher.memory.estimator import OnnxFootprintEstimator  # noqa: E402
from edge_batcher.memory.measure import RESOLUTION_BYTES, measure_activation_peak  # noqa: E402

MiB = 1 << 20
TARGET = 0.15


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def build_models(out: Path) -> None:
    if not (out / "vibration" / "model.onnx").exists():
        _load_tool("build_demo_models").build_vibration(out)
    if not (out / "encoder" / "model.onnx").exists():
        _load_tool("build_encoder_model").build_encoder(out)


def bench(repo: Path, cases: list[tuple[str, int | None, list[int]]], *, repeat: int,
          calibrate_at: int, arena: bool, log=print) -> dict:
    rows = []
    for case, (name, seq, sizes) in enumerate(cases):
        mc = load_model_config(repo / name)
        s = mc.sequence
        est = OnnxFootprintEstimator(mc.model_path, sequence_axes={i: s.axis for i in s.inputs} if s else None)
        case_rows = []
        for size in sizes:
            log(f"  {name} batch {size}" + (f" x {seq}" if seq else "") + " ...")
            raw = est.activation_peak(size, seq)
            m = measure_activation_peak(mc, size, seq, repeat=repeat)
            row = {
                "case": case, "model": name, "batch": size, "seq_len": seq, "estimated": raw,
                "measured": m.activation_peak, "run_peak": m.run_peak, "input_bytes": m.input_bytes,
                "samples": list(m.samples), "raw_error": (raw - m.activation_peak) / m.activation_peak,
                "below_resolution": m.run_peak < MIN_CALIBRATION_BYTES, "measurement": m,
            }
            if arena:
                a = measure_activation_peak(mc, size, seq, repeat=repeat, arena=True)
                row["arena_measured"] = a.activation_peak
                row["arena_samples"] = list(a.samples)
            case_rows.append(row)
        point = next((r for r in case_rows if r["batch"] == calibrate_at), None)
        factor, reason = (None, f"no batch {calibrate_at} in this case")
        if point is not None:
            factor, reason = calibration_factor(point["estimated"], point["measurement"])
        for r in case_rows:
            r["calibration_point"] = r is point
            r["factor"] = factor
            r["factor_reason"] = reason
            if r is point:
                r["calibrated"] = r["calibrated_error"] = None
            else:
                r["calibrated"] = round(r["estimated"] * (factor or 1.0))
                r["calibrated_error"] = (r["calibrated"] - r["measured"]) / r["measured"]
            del r["measurement"]
        rows.extend(case_rows)
    return {"rows": rows}


def environment() -> dict:
    import onnxruntime

    return {
        "machine": platform.machine(), "cpus": os.cpu_count(), "kernel": platform.release(),
        "python": platform.python_version(), "onnxruntime": onnxruntime.__version__,
        "execution_provider": "CPUExecutionProvider",
    }


def _m(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.3f}"


def _p(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def format_table(result: dict) -> str:
    env = result["environment"]
    lines = [
        f"Activation peak, estimated vs measured (median of {result['repeat']} runs); "
        f"{env['machine']}, {env['cpus']} CPUs, Linux {env['kernel']}, onnxruntime {env['onnxruntime']}, CPU EP",
        f"calibration: factor measured/estimated at batch {result['calibrate_at']} of each (model, seq), "
        "applied to the other sizes",
        "",
    ]
    arena = result["arena"]
    header = ["model", "batch", "seq", "estimated", "measured", "raw err", "factor", "calibrated", "cal. err"]
    if arena:
        header += ["arena", "arena/meas."]
    header.append("note")
    table = [header, ["", "", "", "MiB", "MiB", "", "", "MiB", ""] + (["MiB", ""] if arena else []) + [""]]
    for r in result["rows"]:
        note = "calibration point" if r["calibration_point"] else ""
        if r["below_resolution"]:
            note = (note + "; " if note else "") + f"run peak < {MIN_CALIBRATION_BYTES // MiB} MiB: noise"
        cells = [
            r["model"], str(r["batch"]), "-" if r["seq_len"] is None else str(r["seq_len"]),
            _m(r["estimated"]), _m(r["measured"]), _p(r["raw_error"]),
            "-" if r["factor"] is None else f"{r['factor']:.3f}",
            _m(r["calibrated"]), _p(r["calibrated_error"]),
        ]
        if arena:
            cells += [_m(r["arena_measured"]), f"{r['arena_measured'] / r['measured']:.2f}x"]
        cells.append(note)
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        lines.append("  ".join(c.ljust(w) if i in (0, len(row) - 1) else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    scored = [r for r in result["rows"] if not r["below_resolution"]]
    raw_ok = sum(abs(r["raw_error"]) <= TARGET for r in scored)
    evaluated = [r for r in scored if r["calibrated_error"] is not None]
    cal_ok = sum(abs(r["calibrated_error"]) <= TARGET for r in evaluated)
    lines += [
        "",
        f"target |error| <= {TARGET:.0%} (rows whose measured run peak is >= {MIN_CALIBRATION_BYTES // MiB} MiB, "
        f"i.e. 4x the {RESOLUTION_BYTES // 1024} KiB resolution):",
        f"  raw:        {raw_ok}/{len(scored)} rows",
        f"  calibrated: {cal_ok}/{len(evaluated)} rows (calibration points excluded)",
    ]
    reasons = {
        r["case"]: (r["model"], r["seq_len"], [x["batch"] for x in result["rows"] if x["case"] == r["case"]],
                    r["factor_reason"])
        for r in result["rows"] if r["factor"] is None
    }
    for model, seq, sizes, reason in reasons.values():
        lines.append(f"  {model} seq {seq or '-'} batches {sizes}: not calibrated (calibrated = raw): {reason}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Estimator accuracy: estimated vs measured activation peak.")
    ap.add_argument("--repo", type=Path,
                    help="model repository holding vibration/ and encoder/ (default: build them in a temp dir)")
    ap.add_argument("--repeat", type=int, default=3, help="measurements per row, median reported (default 3)")
    ap.add_argument("--calibrate-at", type=int, default=2,
                    help="batch size the calibration factor is measured at (default 2)")
    ap.add_argument("--sizes", default="1,2,4,8", help="batch sizes (default 1,2,4,8)")
    ap.add_argument("--seq", type=int, default=128, help="encoder sequence length (default 128)")
    ap.add_argument("--vibration-extra", default="256,1024,4096",
                    help="larger vibration batches whose activations the measurement can resolve "
                         "(default 256,1024,4096; '' for none)")
    ap.add_argument("--arena", action="store_true", help="also measure with ORT's defaults (arena + memory pattern on)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)

    sizes = [int(s) for s in args.sizes.split(",") if s]
    extra = [int(s) for s in args.vibration_extra.split(",") if s]
    log = (lambda text: print(text, file=sys.stderr)) if not args.json else (lambda text: None)
    with tempfile.TemporaryDirectory(prefix="bench-estimator-") as tmp:
        repo = args.repo or Path(tmp)
        if args.repo is None:
            log(f"building the models into {repo} ...")
            build_models(repo)
        cases = [("vibration", None, sizes), ("encoder", args.seq, sizes)]
        if extra:
            cases.insert(1, ("vibration", None, extra))
        log("measuring:")
        result = bench(repo, cases, repeat=args.repeat, calibrate_at=args.calibrate_at, arena=args.arena, log=log)
    result.update(environment=environment(), repeat=args.repeat, calibrate_at=args.calibrate_at,
                  arena=args.arena, target=TARGET)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
