"""The one CPU that the daemon's Python threads share (`[server] loop_cpu`).

Why: the event loop and the engine worker threads take turns holding Python's GIL several
times per batch. On separate cores every hand-over is a cross-core wake-up, and both threads
spend CPU time on it: measured on the 2-core development VM with the demo model, both on one
core give 1.7x the throughput, a third of the engine time per batch and a tenth of the
loop's system time (docs/benchmarks.md). Engine compute itself runs without the GIL
in native threads: ONNX Runtime's and TensorRT's own pools are created while loading (see
`full_affinity`), so they keep every CPU.

Mechanics (Linux): `os.sched_setaffinity(0, ...)` sets the calling thread's mask only, and a
new thread inherits its creator's mask. Pinning the event-loop thread at start-up therefore
pins every thread it starts afterwards: engine workers, executor threads, paho's network
thread. Elsewhere (no sched_setaffinity) this is a no-op.

`loop_cpu = "auto"` (the default) measures whether this sharing pays on the host, after
warm-up, and keeps threads on any CPU where it does not (placement.py).

One exception: a model whose batches take long (scheduler/runner.py,
WORKER_ON_EVERY_CPU_FROM_S, measured at warm-up) gets engine workers on every CPU. The loop
then mostly waits for that engine, and an engine that computes on its calling thread (ONNX
Runtime with intra_op_threads = 1) would otherwise be held to the loop's one core.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from .errors import ConfigError

_get = getattr(os, "sched_getaffinity", None)
_set = getattr(os, "sched_setaffinity", None)
# The process's CPUs, read before anything is pinned (this module is imported at start-up).
PROCESS_CPUS: frozenset[int] | None = frozenset(_get(0)) if _get is not None else None


def choose(setting: str) -> int | None:
    """The CPU for the Python threads: for "auto" the highest CPU the process may use (the
    candidate that placement.py measures against threads on any CPU), "off" (None: the OS
    places threads), or a CPU number. None also when there is nothing to choose: a single
    allowed CPU, or no affinity API."""
    if setting == "off" or PROCESS_CPUS is None or _set is None:
        return None
    if setting == "auto":
        return max(PROCESS_CPUS) if len(PROCESS_CPUS) > 1 else None
    try:
        cpu = int(setting)
    except ValueError:
        raise ConfigError(f"[server] loop_cpu: expected \"auto\", \"off\" or a CPU number, got {setting!r}") from None
    if cpu not in PROCESS_CPUS:
        raise ConfigError(f"[server] loop_cpu = {cpu}: this process may only run on CPUs {sorted(PROCESS_CPUS)}")
    return cpu


def pin_this_thread(cpu: int | None) -> None:
    """Keep the calling thread (and the threads it starts from now on) on `cpu`; None: on
    every CPU of the process. Raises OSError when the system refuses (a seccomp filter, a
    cpuset that changed)."""
    pin_thread(0, cpu)  # 0: the calling thread


def pin_thread(native_id: int, cpu: int | None) -> None:
    """`pin_this_thread` for another thread of this process, by its native id (Linux TID)."""
    if _set is None or PROCESS_CPUS is None:
        return
    _set(native_id, {cpu} if cpu is not None else PROCESS_CPUS)


def follow_this_thread(native_id: int) -> None:
    """Give thread `native_id` the calling thread's CPUs (an engine worker made on the loader's
    thread joins the event loop's CPU when it starts serving)."""
    if _get is None or _set is None:
        return
    _set(native_id, _get(0))


def thread_is_pinned() -> bool:
    """Whether the calling thread runs on fewer CPUs than the process may use."""
    return _get is not None and PROCESS_CPUS is not None and frozenset(_get(0)) != PROCESS_CPUS


@contextlib.contextmanager
def full_affinity() -> Iterator[None]:
    """Run the block with every CPU of the process, then restore the thread's mask. Engines
    are created inside it, so the native thread pools they start may use every core."""
    if _get is None or _set is None or PROCESS_CPUS is None:  # _get is set whenever PROCESS_CPUS is
        yield
        return
    before = _get(0)
    if before == PROCESS_CPUS:
        yield
        return
    _set(0, PROCESS_CPUS)
    try:
        yield
    finally:
        _set(0, before)
