"""Choosing the next token: greedy, or sampled with temperature / top-k / top-p. Pure.

Each sequence has its own random generator (seeded from the request's `seed` when given), so a
sampled sequence draws the same tokens whatever it is batched with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidInput


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_stop: bool = False  # generate exactly max_new_tokens (benchmarks, tests)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def choose(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token from one row of logits [vocab]."""
    if params.greedy:
        return int(np.argmax(logits))  # the first of equal maxima: deterministic
    x = np.asarray(logits, dtype=np.float64)
    # The largest logit first subtracted: a tiny temperature (1e-310) then sends the others to
    # -inf, not every logit to +-inf (whose difference is NaN, and the token drawn nonsense).
    with np.errstate(over="ignore"):
        x = (x - x.max()) / params.temperature
    candidates: np.ndarray = np.arange(x.shape[0])  # annotated: numpy 2.2 types it 1-d, its slices not
    if 0 < params.top_k < x.shape[0]:
        candidates = np.argpartition(-x, params.top_k - 1)[: params.top_k]
    x = x[candidates]
    order = np.argsort(-x, kind="stable")
    candidates, x = candidates[order], x[order]
    p = np.exp(x - x[0])
    p /= p.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), params.top_p) + 1)
        candidates, p = candidates[:keep], p[:keep] / p[:keep].sum()
    index = int(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"))
    return int(candidates[min(index, len(candidates) - 1)])


def parse_params(parameters: dict, *, default_max_new_tokens: int, max_new_tokens_limit: int,
                 defaults: dict | None = None, stop_token_ids: frozenset[int] = frozenset()) -> SamplingParams:
    """SamplingParams from a request's parameters; a bad value is InvalidInput naming it."""
    d = dict(defaults or {})
    d.update({k: v for k, v in parameters.items() if v is not None})

    def integer(name: str, default: int, low: int, high: int | None = None) -> int:
        value = d.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInput(f"parameters.{name} must be an integer, got {value!r}")
        if value < low or (high is not None and value > high):
            raise InvalidInput(
                f"parameters.{name} must be in {low}..{high if high is not None else 'inf'}, got {value}"
            )
        return value

    def number(name: str, default: float, low: float, high: float) -> float:
        value = d.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidInput(f"parameters.{name} must be a number, got {value!r}")
        if not low <= value <= high:
            raise InvalidInput(f"parameters.{name} must be in [{low}, {high}], got {value}")
        return float(value)

    max_new = integer("max_new_tokens", default_max_new_tokens, 1, max_new_tokens_limit)
    temperature = number("temperature", 0.0, 0.0, 100.0)
    top_k = integer("top_k", 0, 0)
    top_p = number("top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise InvalidInput("parameters.top_p must be above 0")
    seed = d.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise InvalidInput(f"parameters.seed must be a non-negative integer, got {seed!r}")
    ignore = d.get("ignore_stop", False)
    if not isinstance(ignore, bool):
        raise InvalidInput(f"parameters.ignore_stop must be true or false, got {ignore!r}")
    return SamplingParams(max_new, temperature, top_k, top_p, seed, stop_token_ids, ignore)
