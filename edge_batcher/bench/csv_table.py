"""`bench --csv FILE`: the results as one row per phase and model, as perf_analyzer's `-f` writes
one per load: a header of COLUMNS, then the phases in the order they ran. What each column
holds is documented in docs/benchmarks.md (its `--csv FILE` table); an empty cell is a figure
that does not apply to that phase (an open loop has no callers, the raw ceiling no latency)."""

from __future__ import annotations

import csv
from pathlib import Path

COLUMNS = ["model", "phase", "target", "load", "concurrency", "offered_rps", "throughput_rps", "runs_rps",
           "requests", "p50_ms", "p95_ms", "p99_ms", "statuses", "batch_sizes", "dispatch_reasons"]
IN_PROCESS = ["in_process_closed", "in_process_open", "in_process_no_batching", "in_process_closed_any_cpu",
              "in_process_closed_auto"]


def write_csv(results: dict, path: Path) -> None:
    """The results of one model's bench, or of --url's models, as rows with a header."""
    models = results["models"] if "models" in results else [results]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in models:
            for row in rows(r):
                writer.writerow({k: _cell(k, v) for k, v in row.items()})


def rows(r: dict) -> list[dict]:
    """One model's phases as CSV rows, in the order they ran."""
    model = r["model"]
    out = []
    if "raw_ceiling_rps" in r:
        out.append({"model": model, "phase": "raw_ceiling", "target": "engine", "throughput_rps": r["raw_ceiling_rps"]})
        if "raw_ceiling_plain_rps" in r:  # the ceiling above is with CUDA graphs; this one without
            out.append({"model": model, "phase": "raw_ceiling_plain", "target": "engine",
                        "throughput_rps": r["raw_ceiling_plain_rps"]})
        out.append({"model": model, "phase": "minimal_batcher", "target": "engine", "concurrency": r["concurrency"],
                    "throughput_rps": r["minimal_batcher_rps"]})
    for key in IN_PROCESS:
        phases = r.get(key)
        for p in phases if isinstance(phases, list) else [phases] if phases else []:
            closed = p.get("offered_rps") is None
            out.append(_load_row(model, key, "in-process", p, r["concurrency"] if closed else None))
    for key in ("unix_socket_closed", "url_closed"):
        if key in r:
            out.append(_load_row(model, key, r[key]["url"], r[key], r["concurrency"]))
    if "mqtt" in r:
        m = r["mqtt"]
        lat = m["latency_ms"]
        out.append({"model": model, "phase": "mqtt", "target": f"mqtt://{m['address']}/{m['topic']}",
                    "concurrency": m["concurrency"], "throughput_rps": m["throughput_rps"],
                    "runs_rps": _runs(m), "requests": m["completed"], "p50_ms": lat["p50"], "p95_ms": lat["p95"],
                    "p99_ms": lat["p99"], "statuses": _counts(m["status"])})
    return out


def _load_row(model: str, phase: str, target: str, p: dict, concurrency: int | None) -> dict:
    return {"model": model, "phase": phase, "target": target, "load": p.get("load"), "concurrency": concurrency,
            "offered_rps": p.get("offered_rps"), "throughput_rps": p["throughput_rps"], "runs_rps": _runs(p),
            "requests": p["requests"], "p50_ms": p["p50_ms"], "p95_ms": p["p95_ms"], "p99_ms": p["p99_ms"],
            "statuses": _counts(p.get("statuses")), "batch_sizes": _counts(p.get("batch_sizes")),
            "dispatch_reasons": _counts(p.get("dispatch_reasons"))}


def _cell(column: str, value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):  # rates to 0.1/s, latencies to the microsecond
        return f"{value:.3f}" if column.endswith("_ms") else f"{value:.1f}"
    return str(value)


def _runs(p: dict) -> str:
    return " ".join(f"{x:.1f}" for x in p.get("throughput_rps_all", [p["throughput_rps"]]))


def _counts(counts: dict | None) -> str:
    return " ".join(f"{k}:{v}" for k, v in (counts or {}).items())
