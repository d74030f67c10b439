"""The resident peak around a piece of work, read from the kernel's high-water mark."""

from __future__ import annotations

import numpy as np

from edge_batcher.memory import rss_peak
from edge_batcher.memory.heap import malloc_trim

MiB = 1 << 20


def _settle() -> None:
    trim = malloc_trim()
    if trim is not None:
        trim(0)


def test_memory_allocated_and_freed_within_the_work_is_its_transient_peak():
    with rss_peak.measure(_settle) as peak:
        scratch = np.ones(64 * MiB, dtype=np.uint8)  # written: resident
        del scratch
    assert peak.transient >= 60 * MiB
    assert peak.after - peak.before < 16 * MiB  # gone by the end


def test_memory_the_work_still_holds_at_its_end_is_not_transient():
    with rss_peak.measure(_settle) as peak:
        kept = np.ones(64 * MiB, dtype=np.uint8)
    assert peak.after - peak.before >= 60 * MiB
    assert peak.transient < 16 * MiB
    del kept
