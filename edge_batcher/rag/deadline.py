"""Whether a local generation can finish before its request's deadline.

The rag service routes each answer to the local generator, a peer or an extractive answer
(pipeline.py). Fitting in memory is not enough on a slow device: a sequence that fits but takes
longer than the request has left only ends in a 504 after burning the decode slots. The time it
would take is estimated from what the generator measured so far (rag/generate.py `step_times`):
one prefill plus `max_new_tokens` decode steps, each at its mean. `max_new_tokens` is an upper
bound (a stop token may end the sequence sooner), so the estimate errs towards offloading.
Before the generator has measured anything there is no estimate and the deadline does not
veto it: the first request measures.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LocalEstimate:
    prefill_s: float  # mean prefill of the sequences generated so far
    step_s: float  # mean decode step
    max_new_tokens: int

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.max_new_tokens * self.step_s

    def describe(self) -> str:
        return (f"~{self.seconds:.2f} s (prefill {self.prefill_s * 1e3:.1f} ms + {self.max_new_tokens} steps x "
                f"{self.step_s * 1e3:.2f} ms, measured)")


def estimate(step_times: tuple[float, float] | None, max_new_tokens: int) -> LocalEstimate | None:
    if step_times is None:
        return None
    prefill_s, step_s = step_times
    return LocalEstimate(prefill_s, step_s, max_new_tokens)


def too_slow(generator: str, local: LocalEstimate | None, remaining_s: float) -> str | None:
    """Why generating locally would miss the deadline (the route_reason), or None if it would not."""
    if local is None or local.seconds <= remaining_s:
        return None
    return (f"local generator {generator!r}: generation would take {local.describe()}, "
            f"the request has {max(remaining_s, 0.0):.2f} s left")
