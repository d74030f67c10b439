"""KV-cache arithmetic and the guaranteed-no-evict admission rule. Pure: no clocks, no I/O.

    KV bytes per token = 2 (key and value) x layers x kv_heads x head_dim x dtype_bytes

(the figure vLLM sizes its pages with, and TGI / TensorRT-LLM their caches). A sequence's KV
need is that times prompt + max_new_tokens: the most its cache can ever hold. Admission is
TensorRT-LLM's GUARANTEED_NO_EVICT: a waiting sequence joins only when its whole need fits in
what the memory budget has left after the needs of the running sequences (reserved when they
were admitted, released when they finish). A running sequence is therefore never evicted or
recomputed, whatever the others generate. Waiting sequences are admitted in arrival order; the
first one that does not fit stops the rest (no overtaking: a long prompt is not starved by a
stream of short ones).
"""

from __future__ import annotations

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

    def sequence_bytes(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The most KV one sequence can hold: its prompt plus every token it may generate."""
        return self.bytes_per_token * (prompt_tokens + max_new_tokens)

    def describe(self) -> str:
        return (f"2 x {self.layers} layers x {self.kv_heads} KV heads x {self.head_dim} dims x "
                f"{self.dtype_bytes} bytes = {self.bytes_per_token} bytes per token")


def admit_count(waiting_needs: list[int], available: int) -> int:
    """How many waiting sequences (in arrival order) to admit now: the longest prefix whose
    needs together fit in `available` bytes."""
    total = 0
    for n, need in enumerate(waiting_needs):
        total += need
        if total > available:
            return n
    return len(waiting_needs)


def never_fits(need: int, capacity: int) -> bool:
    """A sequence needing more than the whole plannable budget (free now plus everything that
    is reserved and will come back) cannot be admitted however long it waits."""
    return need > capacity
