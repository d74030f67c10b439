"""Sequence: one prompt being generated, created on the event loop and advanced by the decode
loop's worker thread, which hands the caller its events (token pieces, then the result or an
error) with loop.call_soon_threadsafe; GenerationResult is what a finished sequence returns.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import numpy as np

from ..errors import EdgeBatcherError
from .sampling import SamplingParams
from .tokenize import IncrementalDecoder, TextTokenizer


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    queue_s: float = 0.0  # waiting for admission
    first_token_s: float = 0.0  # arrival -> first token

    def parameters(self) -> dict:
        return {"finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": len(self.token_ids)}


class Sequence:
    """One prompt being generated. Its events queue holds ("token", piece) ..., then
    ("done", GenerationResult) or ("error", exception), the shape a peer's stream has too."""

    _ids = itertools.count(1)

    def __init__(self, prompt_ids: list[int], params: SamplingParams, need: int, deadline: float,
                 loop: asyncio.AbstractEventLoop, tokenizer: TextTokenizer):
        self.id = next(self._ids)
        self.prompt_ids = prompt_ids
        self.params = params
        self.need = need  # KV bytes it needs alone (kv.CacheFootprint.sequence_bytes)
        self.deadline = deadline  # monotonic; past it a sequence still waiting for admission fails
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.text = IncrementalDecoder(tokenizer)
        self.rng = np.random.default_rng(params.seed)
        self.generated: list[int] = []
        self.next_token = -1
        self.held_back = False
        self.in_batch = False
        self.cancelled = False  # set by the loop when the caller went away; read by the worker
        self.finished = False
        self.arrival = time.monotonic()
        self.admitted_at = 0.0
        self.first_token_at = 0.0

    @property
    def tokens_bound(self) -> int:
        """The most tokens its cache can hold: the prompt and every token it may generate."""
        return len(self.prompt_ids) + self.params.max_new_tokens

    def emit_token(self, piece: str) -> None:
        self._send(("token", piece))

    def emit_done(self, result: GenerationResult) -> None:
        self._send(("done", result))

    def fail(self, error: EdgeBatcherError) -> None:
        self._send(("error", error))

    def _send(self, event: tuple[str, object]) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass
