"""The C heap's free pages given back to the system: glibc's `malloc_trim`.

glibc serves allocations below its mmap threshold from its heap, and raises that threshold to
the size of the largest mapped block freed so far (up to 32 MiB): after one large buffer is
freed, the next ones of that size come from the heap, and stay in the process when freed while
anything allocated later sits above them. What the daemon held once then counts as held for
good (the memory watch sees it as growth beyond the plan). `malloc_trim(0)` returns the free
pages, wherever they are in the heap, at a cost that grows with the heap (well under a
millisecond here): called after a large request body was let go (transports/body_budget.py) and
after a generator's prefill or a finished sequence (rag/decode_loop.py), and around model loads
and unloads (`trim_heap`: memory/device.py, runtime.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache  # find_library runs `ldconfig -p`: 1.5-3 ms a call
def malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library is not glibc (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_heap() -> None:
    """Give the C heap's free pages back to the system now, where the C library is glibc.
    Blocking (milliseconds for a heap of hundreds of MiB): call it off the event loop."""
    trim = malloc_trim()
    if trim is not None:
        trim(0)
