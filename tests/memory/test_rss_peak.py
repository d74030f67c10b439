"""The resident peak around a piece of work, read from the kernel's high-water mark."""

from __future__ import annotations

import mmap

from edge_batcher.memory import rss_peak

MiB = 1 << 20


def touched(nbytes: int) -> mmap.mmap:
    """nbytes of new pages, written: resident. A mapping of their own, not an array from the C
    heap, which may hand out pages an earlier test freed and left resident (a CI run read
    before = peak = after, 359.8 MiB, with 64 MiB arrays from numpy)."""
    pages = mmap.mmap(-1, nbytes)
    chunk = b"\1" * MiB  # written a MiB at a time: a whole-size bytes object would be a peak of its own
    for _ in range(nbytes // MiB):
        pages.write(chunk)
    return pages


def test_memory_allocated_and_freed_within_the_work_shows_in_its_peak_not_at_its_end():
    with rss_peak.measure() as peak:
        touched(64 * MiB).close()  # unmapped at once
    assert peak.peak - peak.before >= 60 * MiB
    assert peak.after - peak.before < 16 * MiB


def test_memory_the_work_still_holds_at_its_end_is_there_after_it():
    with rss_peak.measure() as peak:
        kept = touched(64 * MiB)
    assert peak.after - peak.before >= 60 * MiB
    assert peak.peak - peak.after < 16 * MiB
    kept.close()
