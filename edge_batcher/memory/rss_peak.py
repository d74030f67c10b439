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
from collections.abc import Callable, Iterator
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

    @property
    def transient(self) -> int:
        """The peak above what the work still holds at its end (what it allocated and freed)."""
        return max(0, self.peak - self.after)


def resident() -> int:
    """This process's resident bytes now."""
    return _read()["VmRSS"]


@contextmanager
def measure(settle: Callable[[], None] | None = None) -> Iterator[Peak]:
    """Measure the resident peak of the block's work. `settle` (e.g. trimming the C heap) runs
    before it, so that memory freed earlier is not counted as its start, and after it, so that
    `after` is what the work still holds, not what it freed and the heap kept. Raises OSError
    where the mark cannot be reset (not Linux, /proc not mounted)."""
    with _lock:
        if settle is not None:
            settle()
        with open(_CLEAR_REFS, "w") as fh:
            fh.write("5")
        result = Peak(before=_read()["VmRSS"])
        yield result
        peak = _read()["VmHWM"]
        if settle is not None:
            settle()
        result.peak, result.after = max(peak, result.before), _read()["VmRSS"]
