"""KV-cache arithmetic and the guaranteed-no-evict admission rule. Pure: no clocks, no I/O.

    KV bytes per token = 2 (key and value) x layers x kv_heads x head_dim x dtype_bytes

(the figure vLLM sizes its pages with, and TGI / TensorRT-LLM their caches). A sequence can hold
at most prompt + max_new_tokens tokens. The batch's cache is contiguous, not paged: every row
has the columns of the longest, so what a set of sequences holds is rows x the longest one's
columns, and more for a moment while the cache is copied (CacheFootprint: the figure admission
reserves; docs/rag.md, "Continuous batching and KV admission"). Admission is TensorRT-LLM's
GUARANTEED_NO_EVICT: a waiting sequence joins only when the footprint with it fits in what the
memory budget has left, so a running sequence is never evicted or recomputed, whatever the
others generate. Waiting sequences are admitted in arrival order; the first one that does not
fit stops the rest (no overtaking: a long prompt is not starved by a stream of short ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}


@dataclass(frozen=True)
class KvShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def describe(self) -> str:
        return (f"2 x {self.layers} layers x {self.kv_heads} KV heads x {self.head_dim} dims x "
                f"{self.dtype_bytes} bytes = {self.bytes_per_token} bytes per token")


COLUMN_STEP = 64  # the in-place cache allocates columns in multiples of this many tokens


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass(frozen=True)
class CacheFootprint:
    """The most a running batch's KV cache holds, by layout: what admission reserves.

    In place (kv_slots.SlotCache): rows x the longest row's columns (whole COLUMN_STEPs), and one
    of the 2 x layers buffers twice while the cache grows, shrinks or reorders; rows and columns
    at least what its buffers have now (they shrink only once less than half is used, so they
    keep the room of sequences that left). Optimum's layout
    (decoder.BatchCache): rows x the longest row, twice: a step returns the new cache while the
    old one is still alive, and a join builds the joined cache beside the old one. A prompt
    prefilled beside a running batch holds a one-row cache of its own until it joins.
    """

    kv: KvShape
    in_place: bool
    max_context: int

    def columns(self, tokens: int) -> int:
        """Columns allocated to a row that holds `tokens` tokens at most."""
        if not self.in_place:
            return tokens
        return max(tokens, min(round_up(tokens, COLUMN_STEP), self.max_context))

    def batch_bytes(self, token_bounds: Sequence[int], prompt_beside: int = 0, held: tuple[int, int] = (0, 0)) -> int:
        """Sequences that hold at most `token_bounds` tokens each (prompt + max_new_tokens),
        batched in buffers that have `held` (rows, columns) now, and beside them the longest
        prompt that is prefilled in a cache of its own (0: none)."""
        per_token = self.kv.bytes_per_token
        rows = max(len(token_bounds), held[0])
        columns = max(self.columns(max(token_bounds, default=0)), held[1])
        cache = rows * columns * per_token if rows else 0
        if self.in_place:
            beside = self.columns(prompt_beside + 1) * per_token if prompt_beside else 0
            return self.holding(cache) + beside
        return self.holding(cache) + 2 * prompt_beside * per_token

    def sequence_bytes(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """One sequence alone: the least a budget must give for it ever to run."""
        return self.batch_bytes([prompt_tokens + max_new_tokens])

    def holding(self, cache_bytes: int) -> int:
        """The most a batch's cache of `cache_bytes` holds while it is copied (grown, shrunk,
        stepped)."""
        if self.in_place:
            return cache_bytes + -(-cache_bytes // (2 * self.kv.layers))
        return 2 * cache_bytes

    def holding_beside(self, cache_bytes: int) -> int:
        """The same for a prompt's cache beside the batch: sized once for the whole prompt in
        place; in Optimum's layout each chunk returns a new cache beside the old one."""
        return cache_bytes if self.in_place else 2 * cache_bytes


def never_fits(need: int, capacity: int) -> bool:
    """A sequence needing more than the whole plannable budget (free now plus everything that
    is reserved and will come back) cannot be admitted however long it waits."""
    return need > capacity
