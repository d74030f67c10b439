"""What a prefill run of a decoder holds beyond its KV cache and logits, measured at load.

The decode loop reserves the batch's KV cache and the logits of its largest run (kv.py,
decode_loop.py). A prefill run's own intermediates (attention over the chunk and its past, the
MLP's activations, ONNX Runtime's copies, and with no arena what glibc's heap keeps between
them) come on top while it runs, and depend on the allocator as much as on the graph (SmolLM2 in
Optimum's layout: 17-300 MiB for one run of 128 tokens, by the heap's history), so they are measured
the way the loop runs them: a prompt as long as the context (or as the budget has room for)
prefilled in chunks of `prefill_chunk_tokens`, the heap trimmed before the prompt and not
between its chunks; each run's resident peak above where the prompt began, less the caches and
logits it holds. The prompt goes in twice: the first time does one-time work (ONNX Runtime's
first runs of each shape), the second is what serving sees, and its largest run is what the loop
reserves while a prompt is being prefilled. What the runs leave behind (an arena's growth)
counts in the model's load (generate.py). Blocking: call it off the event loop. docs/rag.md,
"Continuous batching and KV admission".
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from ..memory import rss_peak
from .decoder import Decoder

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class PrefillMemory:
    tokens: int  # the chunk
    context: int  # the prompt's length
    scratch: int  # the second prompt's largest run: bytes above where it began, less its caches and logits
    first: int  # the same for the first prompt (one-time work)

    def describe(self) -> str:
        return (f"a prefill run of {self.tokens} tokens (a {self.context}-token prompt) held {self.scratch / MiB:.1f} "
                f"MiB beyond its cache and logits ({self.first / MiB:.1f} MiB the first time, once)")


def measurable_context(decoder: Decoder, available: int) -> int:
    """The prompt to measure with: the whole context, or less where its cache (twice in
    Optimum's layout: a run returns a new one beside the old) would take more than half of what
    the budget has (the other half for what is measured)."""
    assert decoder.kv is not None
    per_token = decoder.footprint().holding_beside(decoder.kv.bytes_per_token)
    return max(0, min(decoder.max_context, available // 2 // per_token))


def measure_prefill(decoder: Decoder, tokens: int, context: int,
                    settle: Callable[[int], int] | None = None) -> PrefillMemory:
    """Prefill a `context`-token prompt in chunks of `tokens`, twice, and measure each run's
    resident peak above where its prompt began, less the caches (the one it extends and the one
    it returns) and logits it holds. `settle`: glibc's malloc_trim, run before each prompt and
    after, as the decode loop trims after a prompt is in. Raises OSError where the peak cannot
    be read."""
    def clean() -> None:
        gc.collect()
        if settle is not None:
            settle(0)

    largest = []
    for _ in range(2):
        clean()
        base = rss_peak.resident()
        cache = None
        most = 0
        for start in range(0, context, tokens):
            n = min(tokens, context - start)
            with rss_peak.measure() as peak:
                logits, new = decoder.extend(cache, [0] * n, room=context)  # any token: memory does not depend on it
            held = int(logits.nbytes) + new.nbytes + (cache.nbytes if cache is not None and cache is not new else 0)
            most = max(most, peak.peak - base - held)
            cache = new
            del logits, new
        del cache
        largest.append(max(0, most))
    clean()
    return PrefillMemory(tokens, context, scratch=largest[1], first=largest[0])


def measuring_bytes(decoder: Decoder, tokens: int, context: int) -> int:
    """What the measuring prompt's caches and logits hold at most: reserved in the budget while
    it runs, so that models serving beside a reload do not take that memory meanwhile."""
    assert decoder.kv is not None
    caches = decoder.footprint().holding_beside(context * decoder.kv.bytes_per_token)
    return caches + decoder.logits_bytes(prefill_tokens=tokens)


def prefill_scratch(decoder: Decoder, chunk: int, available: int, name: str,
                    settle: Callable[[int], int] | None = None,
                    reservation: Callable[[int], AbstractContextManager[None]] | None = None) -> int:
    """The bytes to reserve for a prefill run's intermediates (0 for whole prompts, not
    measured: at the whole context they would be the largest allocation of all), measured and
    logged, the measuring prompt's caches and logits held in `reservation` (the budget's) while
    it runs. Where the peak cannot be read, 0 and a warning."""
    if not chunk:
        return 0
    tokens = min(chunk, decoder.max_context)
    context = measurable_context(decoder, available)
    if context == 0:
        log.warning("model %s: the memory budget has no room to measure a prefill run's memory (%.1f MiB): its "
                    "intermediates are in no plan (set [generator] prefill_memory_mb)", name, available / MiB)
        return 0
    t0 = time.perf_counter()
    held = reservation(measuring_bytes(decoder, tokens, context)) if reservation is not None else nullcontext()
    try:
        with held:
            measured = measure_prefill(decoder, tokens, context, settle)
    except OSError as exc:
        log.warning("model %s: cannot measure a prefill run's memory (%s): its intermediates are in no plan "
                    "(set [generator] prefill_memory_mb)", name, exc)
        return 0
    where = "" if context >= decoder.max_context else (
        f" (not the whole {decoder.max_context}-token context: the budget had {available / MiB:.1f} MiB)")
    log.info("model %s: %s%s (measured in %.2f s)", name, measured.describe(), where,
             time.perf_counter() - t0)
    return measured.scratch
