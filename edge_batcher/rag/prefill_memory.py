"""What one prefill run of a decoder holds beyond its KV cache and logits, measured at load.

The decode loop reserves the batch's KV cache and the logits of its largest run (kv.py,
decode_loop.py). A prefill run's own intermediates (attention over the chunk and its past, the
MLP's activations, ONNX Runtime's copies) come on top while it runs, and depend on the graph and
the allocator more than on any arithmetic (SmolLM2 in Optimum's layout: 25-300 MiB for a chunk
of 128), so they are measured: a chunk of `prefill_chunk_tokens` near the end of the context
(the most past a chunk attends to, within what the budget has), on a cache filled to that point,
once not counted (one-time work) and then RUNS times; the resident peak above the cache, the new
cache and the logits, the largest of the counted runs. The loop reserves it while a prompt is
being prefilled. What the runs leave behind (an arena's growth) is counted in the model's load
(generate.py). Blocking: call it off the event loop. docs/rag.md, "Continuous batching and KV
admission".
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..memory import rss_peak
from .decoder import Decoder

log = logging.getLogger(__name__)

MiB = 1 << 20
RUNS = 4  # measured runs, after a first one: the peaks vary with the heap's state (25-300 MiB, SmolLM2)


@dataclass(frozen=True)
class PrefillMemory:
    tokens: int  # the chunk measured
    past: int  # the tokens before it
    scratch: int  # bytes at the measured runs' higher peak above what each still held at its end
    peaks: tuple[int, ...]  # each measured run's
    first: int  # the same for the first run, which does one-time work and is not counted

    def describe(self) -> str:
        runs = " / ".join(f"{p / MiB:.1f}" for p in self.peaks)
        return (f"a prefill run of {self.tokens} tokens after ~{self.past} held {runs} MiB beyond its cache and "
                f"logits ({self.first / MiB:.1f} MiB the first time, once)")


def measurable_past(decoder: Decoder, tokens: int, available: int) -> int:
    """The past to measure a chunk of `tokens` after: the end of the context, or less where the
    filled cache and the chunk's new one would take more than half of what the budget has (the
    other half for what is measured)."""
    assert decoder.kv is not None
    past = max(0, decoder.max_context - tokens)
    copies = 1 if decoder.shared_kv else 2  # Optimum's layout returns a new cache beside the old
    fits = available // 2 // (copies * decoder.kv.bytes_per_token) - tokens
    return max(0, min(past, fits))


def measure_prefill(decoder: Decoder, tokens: int, past: int,
                    settle: Callable[[int], int] | None = None) -> PrefillMemory:
    """Run `tokens` tokens after `past`, and RUNS more times after a past one shorter each time,
    and measure what each run held at its peak beyond what it still holds at its end: the
    cache, its new cache and its logits, and what it keeps for good (an arena's growth: the
    load's). The first run does one-time work (ONNX Runtime's first run of a merged export's
    with-past branch: 333 MiB for SmolLM2 in Optimum's layout), so it is not counted; the others
    are each a shape not run before, as a served chunk's mostly is (one run again at a shape
    already seen: 25 MiB there, against 42 at a new one). `settle`: glibc's malloc_trim, so that
    what earlier work freed is not taken for a run's start. Raises OSError where the peak cannot
    be read."""
    ids = [0] * tokens  # any token: the memory of a run does not depend on which
    room = past + tokens
    peaks = []

    def clean() -> None:
        gc.collect()
        if settle is not None:
            settle(0)

    for run in range(RUNS + 1):
        cache = decoder.filled_cache(max(0, past - run), room)
        with rss_peak.measure(clean) as peak:  # its end is read with the new cache and the logits alive
            logits, new = decoder.extend(cache, ids, room=room)
        peaks.append(peak.transient)
        del cache, new, logits
    return PrefillMemory(tokens, past, max(peaks[1:]), tuple(peaks[1:]), peaks[0])


def prefill_scratch(decoder: Decoder, chunk: int, available: int, name: str,
                    settle: Callable[[int], int] | None = None) -> int:
    """The bytes to reserve for a prefill run's intermediates (0 for whole prompts, not
    measured: at the whole context they would be the largest allocation of all), measured and
    logged. Where the peak cannot be read, 0 and a warning."""
    if not chunk:
        return 0
    tokens = min(chunk, decoder.max_context)
    past = measurable_past(decoder, tokens, available)
    t0 = time.perf_counter()
    try:
        measured = measure_prefill(decoder, tokens, past, settle)
    except OSError as exc:
        log.warning("model %s: cannot measure a prefill run's memory (%s): its intermediates are in no plan "
                    "(set [generator] prefill_memory_mb)", name, exc)
        return 0
    where = "" if past + tokens >= decoder.max_context else (
        f" (not at the end of the {decoder.max_context}-token context: the budget had {available / MiB:.1f} MiB)")
    log.info("model %s: %s%s (measured in %.2f s)", name, measured.describe(), where,
             time.perf_counter() - t0)
    return measured.scratch
