"""DecodeLoop: the generator's worker thread, iteration-level continuous batching. One dedicated
thread owns the decoder session and the running batch's KV cache; between two decode steps it
admits waiting sequences while the cache's footprint with them (kv.CacheFootprint) fits the
memory budget and prefills one chunk of the oldest admitted prompt (a prompt all in joins the
batch), runs one decode step for every running sequence, and lets finished or cancelled ones
leave at once. After each round the loop's reservation follows what the batch can still hold,
and only then are finished callers answered. GenerationService (generate.py) queues sequences
and reads the counters; docs/rag.md ("Continuous batching and KV admission") explains the
scheduling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..errors import DeadlineExceeded, EdgeBatcherError, EngineError, Unavailable
from ..memory.heap import malloc_trim
from .decoder import Decoder, KvCache, held_shape, join, keep, limit
from .kv import CacheFootprint
from .sampling import choose
from .sequence import GenerationResult, Sequence

log = logging.getLogger(__name__)

MiB = 1 << 20
# Held back with nothing of ours running: the memory we wait for belongs to other models'
# batches. The budget announces their releases (on_memory_back); memory freed outside it (the
# probe's free figure) is announced by nobody, so look again this often too.
HELD_BACK_RECHECK_S = 0.02


@dataclass
class GenerationCounters:
    """What the loop counted since the model was loaded (the model's statistics show them)."""

    admitted: int = 0
    joined_mid_generation: int = 0  # admitted while others were decoding
    held_back_for_memory: int = 0
    rejected_does_not_fit: int = 0
    prefills: int = 0
    decode_steps: int = 0
    tokens_generated: int = 0
    max_running_seen: int = 0
    prefill_ns: int = 0
    prefill_tokens: int = 0  # prompt tokens prefilled (the chunks of prompts cancelled midway too)
    decode_ns: int = 0
    cancelled: int = 0
    expired: int = 0


@dataclass
class DecodeSnapshot:
    """A consistent copy of the loop's state for statistics."""

    counters: dict[str, int]
    running: int
    kv_reserved: int  # bytes reserved in the budget for the admitted sequences' cache
    kv_in_use: int  # bytes the batch's cache (and a prompt's beside it) holds now
    finish_reasons: dict[str, int]
    decode_sizes: dict[int, list[int]] = field(default_factory=dict)  # rows -> [steps, ns]


@dataclass
class _Filling:
    """An admitted sequence whose prompt is being prefilled, chunk by chunk."""

    seq: Sequence
    cache: KvCache | None = None
    done: int = 0  # prompt tokens already in the cache


class DecodeLoop:
    """The worker thread and everything only it changes; other threads go through the methods.

    `waiting` is guarded by a condition the worker sleeps on; the counters by a lock that the
    statistics take too.
    """

    def __init__(self, name: str, decoder: Decoder, budget: Any, max_running: int, prefill_chunk: int = 0):
        self.name = name
        self.decoder = decoder
        self.budget = budget
        self.line_key = budget.consumer(name)  # this loop's place in the budget's line
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk  # prompt tokens per prefill run between decode steps; 0: whole
        self.prefill_scratch = 0  # bytes a prefill run holds beyond its cache and logits (start())
        self.waiting: deque[Sequence] = deque()
        self.broken: str | None = None  # why the worker thread died, if it did
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stop_why = "was unloaded"  # what the sequences left at stop() are told
        self._lock = threading.Lock()  # guards the counters and figures below
        self._counters = GenerationCounters()
        self._running = 0
        self._kv_reserved = 0
        self._kv_in_use = 0
        self._finish_reasons: dict[str, int] = {}
        self._decode_sizes: dict[int, list[int]] = {}
        # token bounds, prompt beside, the batch's buffers (rows, columns): for extra_bytes()
        self._admitted: tuple[list[int], int, tuple[int, int]] = ([], 0, (0, 0))
        self.over_reservation = 0  # rounds that found the cache holding more than reserved (a bug)
        # worker thread only:
        self.footprint: CacheFootprint | None = None
        self._held = 0  # bytes this loop has reserved in the budget
        # Of them, the cache's arrays allocated now, which a probe of host memory already shows
        # (budget.visible): resident once allocated, the in-place buffers populated when mapped,
        # Optimum's arrays written whole by ONNX Runtime.
        self._visible = 0
        # Optimum's layout: each step's new cache, and a prefill's activations on the CPU (no
        # arena), come from glibc's heap, which keeps what is freed (memory/heap.py): trimmed
        # after a prefill and when sequences leave. Set by start(), once the decoder loaded.
        self._trim: Callable[[int], int] | None = None
        self._trim_due = False
        self._limits = (0, 0)  # this round's admitted rows and their longest token bound
        self._answers: list[Callable[[], None]] = []  # callers to answer once the reservation is settled

    # ------------------------------------------------------------------ from other threads

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, prefill_scratch: int = 0) -> None:
        """After the decoder loaded. `prefill_scratch`: what a prefill run holds beyond its cache
        and logits, as measured at load (prefill_memory.py)."""
        self.prefill_scratch = prefill_scratch
        self.footprint = self.decoder.footprint()
        self._trim = None if self.decoder.shared_kv else malloc_trim()
        self._thread = threading.Thread(target=self._run, name=f"generate-{self.name}", daemon=True)
        self.budget.on_memory_back(self.line_key, self._memory_back)  # held back: admit once memory is back
        self._thread.start()

    def stop(self, timeout: float, why: str = "was unloaded") -> None:
        """Ask the worker to stop and wait for it (blocking: run it off the event loop). The
        sequences it still has fail with Unavailable: "model NAME {why}"."""
        with self._cond:
            if not self._stopping:
                self._stop_why = why
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self.budget.forget_waker(self.line_key, self._memory_back)

    def enqueue(self, seq: Sequence) -> None:
        with self._cond:
            self.waiting.append(seq)
            self._cond.notify()

    def wake(self) -> None:
        """A sequence was cancelled: let the worker drop it before its next step."""
        with self._cond:
            self._cond.notify()

    def _memory_back(self) -> None:
        """The budget: memory came back, or someone ahead in its line left it. Called on any
        thread, maybe one that holds another loop's condition while it admits (two generators in
        the line): never block on ours for it. If the worker holds it now, it is awake already,
        and its recheck (HELD_BACK_RECHECK_S) covers a wait it was about to begin."""
        if self._cond.acquire(blocking=False):
            try:
                self._cond.notify()
            finally:
                self._cond.release()

    def count_rejected(self) -> None:
        with self._lock:
            self._counters.rejected_does_not_fit += 1

    def waiting_count(self) -> int:
        with self._cond:
            return len(self.waiting)

    def extra_bytes(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """What admitting such a sequence now would add to this loop's reservation (as of the
        last round)."""
        assert self.footprint is not None
        with self._lock:
            bounds, beside, shape = self._admitted
            held = self._kv_reserved
        if bounds:  # it would be prefilled beside the batch or the prompts before it
            beside = max(beside, prompt_tokens)
        need = (self.footprint.batch_bytes(bounds + [prompt_tokens + max_new_tokens], beside, shape)
                + self.run_bytes(len(bounds) + 1, prompt_tokens))
        return max(0, need - held)

    def running(self) -> int:
        with self._lock:
            return self._running

    def runs_started(self) -> int:
        """Prefills and decode steps so far."""
        with self._lock:
            return self._counters.prefills + self._counters.decode_steps

    def snapshot(self) -> DecodeSnapshot:
        with self._lock:
            return DecodeSnapshot(asdict(self._counters), self._running, self._kv_reserved, self._kv_in_use,
                                  dict(self._finish_reasons), {k: list(v) for k, v in self._decode_sizes.items()})

    def decode_steps_by_size(self) -> dict[int, int]:
        with self._lock:
            return {rows: entry[0] for rows, entry in self._decode_sizes.items()}

    # ------------------------------------------------------------------ the worker thread

    def _run(self) -> None:
        cache: KvCache | None = None
        running: list[Sequence] = []
        filling: list[_Filling] = []  # admitted, their prompts being prefilled (oldest first)
        try:
            while True:
                with self._cond:
                    while not self.waiting and not running and not filling and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        break
                    admitted = self._admit(running, [f.seq for f in filling], cache)
                    held_back = bool(self.waiting) and not admitted and not running and not filling
                filling += [_Filling(seq) for seq in admitted]
                admitted_now = running + [f.seq for f in filling]
                self._limits = (len(admitted_now), max((s.tokens_bound for s in admitted_now), default=0))
                filling = self._drop_cancelled_fills(filling)
                if filling:  # one prefill run (a chunk of the oldest prompt) between two decode steps
                    cache = self._prefill(filling, running, cache)
                cache, running = self._drop(cache, running, lambda s: s.cancelled, cancelled=True)
                if running:
                    assert cache is not None  # every running sequence joined the cache
                    # the step's new cache replaces the old here, before finished rows are cut
                    # out of it: the footprint holds two caches at once, not three
                    cache, finished = self._step(cache, running)
                    cache, running = self._drop_finished(cache, running, finished)
                elif held_back:
                    with self._cond:
                        self._cond.wait(HELD_BACK_RECHECK_S)
                self._settle(cache, running, filling)
        except BaseException as exc:  # a bug: fail everyone rather than hang them
            log.exception("model %s: generation worker failed", self.name)
            self.broken = f"{type(exc).__name__}: {exc}"
            error = EngineError(f"model {self.name!r}: generation worker failed: {exc}")
            for seq in running + [f.seq for f in filling]:
                self._fail(seq, error)
            running, filling = [], []
        finally:
            stop = Unavailable(f"model {self.name!r} {self._stop_why}")
            for seq in running + [f.seq for f in filling]:
                self._fail(seq, stop)
            with self._cond:
                while self.waiting:
                    self.waiting.popleft().fail(stop)
            self._settle(None, [], [])
            self.budget.leave_line(self.line_key)

    def _admit(self, running: list[Sequence], filling: list[Sequence], cache: KvCache | None) -> list[Sequence]:
        """Under self._cond: pop the waiting sequences that may join now (arrival order,
        guaranteed-no-evict: the batch's footprint with them is reserved). Cancelled and expired
        ones are answered and removed, wherever they wait."""
        self._drop_waiting(time.monotonic())
        admitted: list[Sequence] = []
        held_back = False
        while self.waiting and len(running) + len(filling) + len(admitted) < self.max_running:
            seq = self.waiting[0]
            extra = self._need(running, filling + admitted + [seq], cache) - self._held
            # In the budget's line: while an engine model has waited longer for memory, nothing
            # new is admitted, and what the running sequences free reaches it first.
            if extra > 0 and not self.budget.try_reserve(extra, waiter=self.line_key, keeps=self._held):
                if not seq.held_back:
                    seq.held_back = True
                    with self._lock:
                        self._counters.held_back_for_memory += 1
                held_back = True
                break  # no overtaking: the head waits for memory, the rest wait behind it
            self._held += max(extra, 0)
            self.waiting.popleft()
            admitted.append(seq)
        if not held_back:
            self.budget.leave_line(self.line_key)
        return admitted

    def _drop_waiting(self, now: float) -> None:
        """Under self._cond: answer and remove the waiting sequences whose caller went away or
        whose deadline passed, every round: not only the head, and also while every running
        place is taken (before, one waiting for a place waited until a place freed, whatever its
        deadline)."""
        if not any(seq.cancelled or now >= seq.deadline for seq in self.waiting):
            return
        kept: deque[Sequence] = deque()
        for seq in self.waiting:
            if seq.cancelled:  # its caller went away while it waited
                with self._lock:
                    self._counters.cancelled += 1
                seq.finished = True
            elif now >= seq.deadline:
                with self._lock:
                    self._counters.expired += 1
                seq.finished = True
                seq.fail(DeadlineExceeded(
                    f"model {self.name!r}: waited {now - seq.arrival:.1f} s to start (a place among its "
                    f"{self.max_running} running sequences and {seq.need / MiB:.2f} MiB of KV-cache memory) "
                    "and its deadline passed"))
            else:
                kept.append(seq)
        self.waiting.clear()
        self.waiting.extend(kept)

    def _prefill(self, filling: list[_Filling], running: list[Sequence], cache: KvCache | None) -> KvCache | None:
        """Prefill the next chunk of the oldest admitted prompt; once the whole prompt is in its
        cache, its first token is chosen and it joins the running batch."""
        fill = filling[0]
        seq = fill.seq
        if not fill.done:
            seq.admitted_at = time.monotonic()
        prompt = seq.prompt_ids
        size = self.prefill_chunk or len(prompt)
        t0 = time.perf_counter()
        try:
            logits, fill.cache = self.decoder.extend(fill.cache, prompt[fill.done:fill.done + size], room=len(prompt))
        except EdgeBatcherError as exc:
            filling.pop(0)
            self._fail(seq, exc)
            return cache
        chunk = len(prompt[fill.done:fill.done + size])
        fill.done += size
        with self._lock:
            self._counters.prefill_ns += int((time.perf_counter() - t0) * 1e9)
            self._counters.prefill_tokens += chunk
        if fill.done < len(prompt):
            return cache
        filling.pop(0)
        self._trim_due = True
        own = fill.cache
        with self._lock:
            c = self._counters
            c.prefills += 1
            c.admitted += 1
            if running:
                c.joined_mid_generation += 1
        seq.in_batch = True  # counted as running from its first token on
        with self._lock:
            self._running += 1
            self._counters.max_running_seen = max(self._counters.max_running_seen, self._running)
        if self._advance(seq, logits[-1]):
            return cache  # finished at its first token: never joins
        try:
            limit(cache, *self._limits)
            joined = join(cache, own)
        except EdgeBatcherError as exc:  # the batch's cache could not grow for it: it alone fails
            log.error("model %s: a sequence could not join the batch: %s", self.name, exc)
            self._fail(seq, exc)
            return cache
        running.append(seq)
        return joined

    def _step(self, cache: KvCache, running: list[Sequence]) -> tuple[KvCache | None, set[int]]:
        """One decode step of the batch: its new cache, and the ids of the sequences it finished
        (all of them when the step failed: they have been answered)."""
        rows = len(running)
        t0 = time.perf_counter()
        try:
            limit(cache, *self._limits)
            logits, cache = self.decoder.step(cache, np.array([s.next_token for s in running], dtype=np.int64))
        except EdgeBatcherError as exc:
            log.error("model %s: decode step of %d sequences failed: %s", self.name, rows, exc)
            for seq in running:
                self._fail(seq, exc)
            return None, {id(seq) for seq in running}
        ns = int((time.perf_counter() - t0) * 1e9)
        with self._lock:
            self._counters.decode_steps += 1
            self._counters.decode_ns += ns
            entry = self._decode_sizes.setdefault(rows, [0, 0])
            entry[0] += 1
            entry[1] += ns
        return cache, {id(seq) for row, seq in enumerate(running) if self._advance(seq, logits[row])}

    def _drop_finished(self, cache: KvCache | None, running: list[Sequence],
                       finished: set[int]) -> tuple[KvCache | None, list[Sequence]]:
        return self._drop(cache, running, lambda s: id(s) in finished, cancelled=False)

    def _drop(self, cache: KvCache | None, running: list[Sequence], leaves: Callable[[Sequence], bool],
              cancelled: bool) -> tuple[KvCache | None, list[Sequence]]:
        """Remove finished (or, with `cancelled`, cancelled) sequences from the batch at once."""
        rows = [i for i, s in enumerate(running) if not leaves(s)]
        if len(rows) == len(running):
            return cache, running
        if cancelled:
            for i, seq in enumerate(running):
                if i not in rows:
                    with self._lock:
                        self._counters.cancelled += 1
                    self._leave(seq)
                    seq.finished = True
        return (keep(cache, rows) if cache is not None else None), [running[i] for i in rows]

    def _advance(self, seq: Sequence, logits: np.ndarray) -> bool:
        """Choose the sequence's next token, stream it; True when the sequence is finished."""
        token = choose(logits, seq.params, seq.rng)
        now = time.monotonic()
        if not seq.first_token_at:
            seq.first_token_at = now
        with self._lock:
            self._counters.tokens_generated += 1
        if token in seq.params.stop_token_ids and not seq.params.ignore_stop:
            self._finish(seq, "stop")
            return True
        seq.generated.append(token)
        piece = seq.text.add(token)
        if piece:
            seq.emit_token(piece)
        if len(seq.generated) >= seq.params.max_new_tokens:
            self._finish(seq, "length")
            return True
        seq.next_token = token
        return False

    def _finish(self, seq: Sequence, reason: str) -> None:
        rest = seq.text.flush()
        if rest:
            seq.emit_token(rest)
        self._leave(seq)
        seq.finished = True
        with self._lock:
            self._finish_reasons[reason] = self._finish_reasons.get(reason, 0) + 1
        result = GenerationResult(
            text=seq.text.emitted, token_ids=list(seq.generated), finish_reason=reason,
            prompt_tokens=len(seq.prompt_ids), queue_s=seq.admitted_at - seq.arrival,
            first_token_s=seq.first_token_at - seq.arrival)
        self._answers.append(lambda: seq.emit_done(result))

    def _fail(self, seq: Sequence, error: EdgeBatcherError) -> None:
        self._leave(seq)
        seq.finished = True
        self._answers.append(lambda: seq.fail(error))

    def _leave(self, seq: Sequence) -> None:
        """The sequence no longer runs (its memory goes back at the end of the round: _settle)."""
        with self._lock:
            if seq.in_batch:
                seq.in_batch = False
                self._running -= 1

    def _need(self, running: list[Sequence], filling: list[Sequence], cache: KvCache | None) -> int:
        """The most the cache can hold while these sequences run: the batch's rows at the longest
        one's columns (at least the rows and columns its buffers have now), and the longest
        prompt prefilled beside the batch (with nothing running, the oldest prompt's cache becomes
        the batch)."""
        assert self.footprint is not None
        return (self.footprint.batch_bytes([s.tokens_bound for s in running + filling], _beside(running, filling),
                                           held_shape(cache))
                + self.run_bytes(len(running) + len(filling), max((len(s.prompt_ids) for s in filling), default=0)))

    def run_bytes(self, rows: int, longest_prompt: int) -> int:
        """What the largest run among these sequences' holds beyond the KV cache (one run at a
        time), which the KV footprint counts none of: its logits (a decode step's rows, every
        admitted sequence once all are running, or a prefill run's chunk: Decoder.logits_bytes),
        and while a prompt is prefilled, the prefill run's intermediates as measured at load."""
        chunk = min(self.prefill_chunk or longest_prompt, longest_prompt)
        scratch = self.prefill_scratch if longest_prompt else 0
        return self.decoder.logits_bytes(rows, chunk) + scratch

    def _settle(self, cache: KvCache | None, running: list[Sequence], filling: list[_Filling]) -> None:
        """End of a round: the reservation comes down to what the admitted sequences can still
        hold (never below what the cache holds now), then finished callers are answered, so the
        statistics they may read next are already up to date."""
        assert self.footprint is not None
        beside = sum(f.cache.nbytes for f in filling if f.cache is not None)
        batch = cache.nbytes if cache is not None else 0
        held_now = batch + beside
        fills = [f.seq for f in filling]
        target = max(self._need(running, fills, cache),
                     self.footprint.holding(batch) + self.footprint.holding_beside(beside))
        if target > self._held:  # the footprint missed something: say so, and count what is held
            self.over_reservation += 1
            log.warning("model %s: the KV cache (%.2f MiB now) may hold %.2f MiB, more than the %.2f MiB "
                        "reserved for it", self.name, held_now / MiB, target / MiB, self._held / MiB)
            self.budget.reserve(target - self._held)
        self._show(min(held_now, target) if self.budget.sees_host_memory else 0)
        if target < self._held:
            self.budget.release(self._held - target)
            self._trim_due = True
        self._held = target
        with self._lock:
            self._kv_reserved = target
            self._kv_in_use = held_now
            self._admitted = ([s.tokens_bound for s in running + fills], _beside(running, fills), held_shape(cache))
        answers, self._answers = self._answers, []
        for answer in answers:
            answer()
        if self._trim_due and self._trim is not None:
            self._trim(0)
        self._trim_due = False

    def _show(self, visible: int) -> None:
        """Tell the budget how much of the reservation the cache has allocated (the probe shows
        it, so it is not subtracted twice): the probe is read first when that grows, after when
        it shrinks, so that in between it counts twice rather than not at all."""
        if visible > self._visible:
            self.budget.refresh()
            self.budget.set_visible(visible - self._visible)
        elif visible < self._visible:
            self.budget.set_visible(visible - self._visible)
            self.budget.refresh()
        self._visible = visible

    def _drop_cancelled_fills(self, filling: list[_Filling]) -> list[_Filling]:
        """Sequences cancelled while their prompt was being prefilled leave, their memory freed."""
        kept = []
        for fill in filling:
            if not fill.seq.cancelled:
                kept.append(fill)
                continue
            with self._lock:
                self._counters.cancelled += 1
            self._leave(fill.seq)
            fill.seq.finished = True
        return kept


def _beside(running: list[Sequence], filling: list[Sequence]) -> int:
    """The longest prompt that will be prefilled in a cache of its own beside a batch (with
    nothing running, the oldest prompt's cache becomes the batch): 0 if none."""
    return max((len(s.prompt_ids) for s in (filling if running else filling[1:])), default=0)
