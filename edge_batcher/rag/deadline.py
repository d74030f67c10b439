"""Whether a local generation can finish before its request's deadline.

The rag service routes each answer to the local generator, a peer or an extractive answer
(pipeline.py). Fitting in memory is not enough on a slow device: a sequence that fits but takes
longer than the request has left only ends in a 504 after burning the decode slots. The time it
would take is estimated from what the generator measured so far (rag/generate.py `step_times`):
its prompt's prefill at the measured time per prompt token, the decode steps of the running
batch that its prefill waits between when it comes in chunks (`prefill_chunk_tokens`) while
others run, and `max_new_tokens` decode steps, each at the measured mean. `max_new_tokens` is
an upper bound (a stop token may end the sequence sooner), so the estimate errs towards
offloading.
Before the generator has measured anything there is no estimate and the deadline does not
veto it: the first request measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Kept back from what the local generator's sequence may wait for admission: the time an
# extractive answer takes (a few ms with the index's sentence vectors, an embedding batch without
# them), so that a sequence that could not start in time is still answered, extractively.
EXTRACTIVE_RESERVE_S = 0.05


@dataclass(frozen=True)
class LocalEstimate:
    prefill_s: float  # this prompt's prefill, at the measured time per prompt token
    step_s: float  # mean decode step
    max_new_tokens: int
    waits: int = 0  # the running batch's decode steps between its prefill's chunks

    @property
    def seconds(self) -> float:
        return self.prefill_s + (self.waits + self.max_new_tokens) * self.step_s

    def describe(self) -> str:
        waits = f"{self.waits} steps of the running batch between its chunks + " if self.waits else ""
        return (f"~{self.seconds:.2f} s (prefill {self.prefill_s * 1e3:.1f} ms + {waits}{self.max_new_tokens} "
                f"steps x {self.step_s * 1e3:.2f} ms, measured)")


def estimate(step_times: tuple[float, float] | None, max_new_tokens: int, prompt_tokens: int = 0,
             chunk_tokens: int = 0, running: int = 0) -> LocalEstimate | None:
    """From (seconds of prefill per prompt token, seconds of a decode step) measured; None
    before anything was measured."""
    if step_times is None:
        return None
    per_token_s, step_s = step_times
    chunks = math.ceil(prompt_tokens / chunk_tokens) if chunk_tokens else 1
    waits = max(chunks - 1, 0) if running else 0  # with nothing running, chunks follow each other
    return LocalEstimate(per_token_s * prompt_tokens, step_s, max_new_tokens, waits)


def too_slow(generator: str, local: LocalEstimate | None, remaining_s: float) -> str | None:
    """Why generating locally would miss the deadline (the route_reason), or None if it would not."""
    if local is None or local.seconds <= remaining_s:
        return None
    return (f"local generator {generator!r}: generation would take {local.describe()}, "
            f"the request has {max(remaining_s, 0.0):.2f} s left")


def extractive_reserve(left_s: float) -> float:
    """Of the `left_s` seconds a request has, what is kept back for an extractive answer."""
    return min(EXTRACTIVE_RESERVE_S, max(left_s, 0.0) / 2)


def start_within(left_s: float, local: LocalEstimate | None) -> float:
    """How long the local generator's sequence may wait to start, of the `left_s` seconds its
    request has: what its estimated generation and the extractive answer's reserve leave, so
    that a sequence that starts in time can also end in time (the estimate is an upper bound),
    and one that cannot start in time is still answered. Without an estimate, all but the
    reserve."""
    return max(left_s - extractive_reserve(left_s) - (local.seconds if local is not None else 0.0), 1e-3)
