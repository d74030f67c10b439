"""The daemon's long-lived objects, kept out of the cyclic garbage collector's walks.

A serving daemon holds tens of thousands of objects that live as long as it does: modules,
configs, the models' runners, aiohttp's, grpc's and paho's machinery. Each full collection walks
all of them with the event loop stopped; on the 2-core VM ~63k objects took 60-70 ms, the longest
pause a request saw (docs/benchmarks.md, "The cyclic GC's pauses"). Once the daemon is ready,
`freeze_survivors` collects what is garbage and moves every object still alive to the permanent
generation (`gc.freeze`); what requests allocate is collected as before. A frozen object is still
freed by reference counting, but a reference cycle of frozen objects is never collected: an
unloaded model's runner is such a cycle, so after a model goes, the runtime calls this again,
which first hands the frozen objects back to the collector (`gc.unfreeze`) and collects them.
`[server] gc_freeze = false` leaves the collector as Python sets it.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_survivors(why: str) -> int:
    """Collect every generation, then freeze what survived; returns how many objects are frozen.
    Blocks the calling thread for one full collection (tens of ms on a small device)."""
    started = time.perf_counter()
    gc.unfreeze()  # what an earlier call froze and is garbage now (an unloaded runner) is collected below
    collected = gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("gc: %s: %d objects frozen, out of later collections' walks (%d collected first, %.0f ms)",
             why, frozen, collected, (time.perf_counter() - started) * 1e3)
    return frozen


def thaw() -> None:
    """Hand every frozen object back to the collector (the daemon has stopped serving)."""
    gc.unfreeze()
