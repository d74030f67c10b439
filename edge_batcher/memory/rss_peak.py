"""The peak of this process's resident memory around one piece of work (Linux).

Memory a run allocates and frees again (ONNX Runtime's intermediates outside an arena) is gone
from every probe by the time anyone reads it; the kernel's high-water mark (VmHWM in
/proc/self/status, reset to the current resident set by writing 5 to /proc/self/clear_refs)
keeps it. The mark is the whole process's: other threads' allocations during the work count too
(so a measured peak errs high, never low), and two measurements at once would reset each
other's, hence the lock. Used at a generator's load (rag/prefill_memory.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_lock = threading.Lock()


def _read() -> dict[str, int]:
    values = {}
    with open(_STATUS, "rb") as fh:
        for line in fh.read().decode().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return values


@dataclass
class Peak:
    before: int = 0  # resident bytes when the work began
    peak: int = 0  # the most resident at any moment of it
    after: int = 0  # resident bytes when it ended


def resident() -> int:
    """This process's resident bytes now."""
    return _read()["VmRSS"]


@contextmanager
def measure() -> Iterator[Peak]:
    """Measure the resident peak of the block's work. Raises OSError where the mark cannot be
    reset (not Linux, /proc not mounted)."""
    with _lock:
        with open(_CLEAR_REFS, "w") as fh:
            fh.write("5")
        result = Peak(before=resident())
        yield result
        end = _read()
        result.peak, result.after = max(end["VmHWM"], result.before), end["VmRSS"]
