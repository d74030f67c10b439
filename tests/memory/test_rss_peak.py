"""The resident peak around a piece of work, read from the kernel's high-water mark."""

from __future__ import annotations

import numpy as np

from edge_batcher.memory import rss_peak

MiB = 1 << 20


def test_memory_allocated_and_freed_within_the_work_shows_in_its_peak_not_at_its_end():
    with rss_peak.measure() as peak:
        scratch = np.ones(64 * MiB, dtype=np.uint8)  # written: resident; freed: unmapped at once
        del scratch
    assert peak.peak - peak.before >= 60 * MiB
    assert peak.after - peak.before < 16 * MiB


def test_memory_the_work_still_holds_at_its_end_is_there_after_it():
    with rss_peak.measure() as peak:
        kept = np.ones(64 * MiB, dtype=np.uint8)
    assert peak.after - peak.before >= 60 * MiB
    assert peak.peak - peak.after < 16 * MiB
    del kept
