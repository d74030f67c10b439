"""Summaries the phases and load generators share: latency percentiles, the median of runs."""

from __future__ import annotations

import statistics
from collections import Counter

import numpy as np


def percentiles(latencies: list[float]) -> dict:
    if not latencies:
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None}
    a = np.array(latencies) * 1e3
    return {f"p{q}_ms": float(np.percentile(a, q)) for q in (50, 95, 99)}


def by_status(statuses: Counter) -> dict[str, int]:
    """Answers counted by status, as JSON keys in status order."""
    return {str(status): statuses[status] for status in sorted(statuses)}


def median_run(runs: list[dict]) -> dict:
    """The run with the median throughput (its other figures belong to the same run)."""
    ordered = sorted(runs, key=lambda r: r["throughput_rps"])
    best = dict(ordered[len(ordered) // 2])
    # Unrounded, as throughput_rps is: rounded here and again for display, the range printed
    # beside the median could end below it (12,764.54 -> 12,764.5 -> "12764" against "12765").
    best["throughput_rps_all"] = [r["throughput_rps"] for r in runs]
    return best


def latency_summary(sorted_ms: list[float]) -> dict[str, float]:
    """p50/p95/p99/p99.9, mean and max of sorted latencies (NaN for none): what http_load and
    mqtt_load report."""
    nan = float("nan")
    return {"p50": _percentile(sorted_ms, 50), "p95": _percentile(sorted_ms, 95), "p99": _percentile(sorted_ms, 99),
            "p99.9": _percentile(sorted_ms, 99.9),
            "mean": statistics.fmean(sorted_ms) if sorted_ms else nan, "max": sorted_ms[-1] if sorted_ms else nan}


def _percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(p / 100.0 * (len(sorted_values) - 1))))
    return sorted_values[k]
