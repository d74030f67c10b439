"""GenerationService: a decoder LLM served with iteration-level continuous batching.

model.toml (backend = "generator")::

    model_file = "model.onnx"          # Optimum text-generation-with-past export (rag/decoder.py)
    [tokenizer]
    file = "tokenizer.json"
    add_special_tokens = false
    [generator]
    max_context = 2048                 # prompt + max_new_tokens must fit
    max_new_tokens = 128               # default per request
    max_new_tokens_limit = 1024        # most a request may ask for
    max_running = 8                    # sequences decoded together
    stop_tokens = ["<|im_end|>", "<|endoftext|>"]
    prompt_template = "{prompt}"       # wraps text sent to this model directly (not RAG prompts)

Scheduling (TensorRT-LLM's in-flight batching, Orca's iteration-level scheduling). One
dedicated worker thread owns the ONNX session and the running batch's KV cache and loops:

1. between two decode steps it admits waiting sequences in arrival order while their KV need
   (prompt + max_new_tokens tokens, rag/kv.py) fits the memory budget: each is reserved in
   `runtime.budget` and prefilled on its own, its first token chosen, and its cache joined to
   the running batch (rag/decoder.py). A sequence that does not fit waits (held back) until
   running sequences finish and release their reservation; one that could never fit is
   rejected at once with DoesNotFit.
2. one decode step runs every running sequence by one token; each chooses its next token
   (greedy or sampled, rag/sampling.py) and streams it to its caller;
3. a sequence that produced a stop token or max_new_tokens leaves the batch at once, its
   reservation released, its rows dropped from the cache.

The event loop only queues sequences and consumes their events (token pieces, then done or
error), which the worker hands over with loop.call_soon_threadsafe. A caller that goes away
(client disconnected) marks its sequence cancelled; the worker drops it before the next step.
Waiting for admission is bounded by the request's timeout (default [batching]
default_timeout_ms): past it the request fails with DeadlineExceeded. Once admitted a
sequence runs to its end.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from ..config import ModelConfig, backend_settings
from ..cpu_affinity import full_affinity
from ..errors import (
    ConfigError, DeadlineExceeded, DoesNotFit, EdgeBatcherError, EngineError, InvalidInput, Overloaded, Unavailable,
)  # fmt: skip
from ..types import InferRequest, InferResponse, TensorSpec
from . import kv as kvmath
from .decoder import BatchCache, Decoder, join, keep
from .sampling import SamplingParams, choose, parse_params
from .service import InFlight, ServiceAccounting, ServiceStats, bytes_array, text_rows, token_responses
from .tokenize import IncrementalDecoder, TextTokenizer

log = logging.getLogger(__name__)

MiB = 1 << 20
TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
# Held back with nothing of ours running: the memory we wait for belongs to other models'
# batches, whose release the budget does not announce; look again this often.
HELD_BACK_RECHECK_S = 0.02


@dataclass
class GeneratorSettings:
    max_context: int = 2048
    max_new_tokens: int = 128
    max_new_tokens_limit: int = 1024
    max_running: int = 8
    max_rows: int = 8  # texts per v2 infer request (each becomes a sequence)
    stop_tokens: list[str] = field(default_factory=list)
    prompt_template: str = "{prompt}"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    kv_heads: int = 0  # 0: read from the model's past_key_values inputs
    head_dim: int = 0


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
    """One prompt being generated: created on the loop, advanced by the worker thread."""

    _ids = itertools.count(1)

    def __init__(self, prompt_ids: list[int], params: SamplingParams, need: int, deadline: float,
                 loop: asyncio.AbstractEventLoop, tokenizer: TextTokenizer):
        self.id = next(self._ids)
        self.prompt_ids = prompt_ids
        self.params = params
        self.need = need
        self.deadline = deadline
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.text = IncrementalDecoder(tokenizer)
        self.rng = np.random.default_rng(params.seed)
        self.generated: list[int] = []
        self.next_token = -1
        self.reserved = 0
        self.held_back = False
        self.in_batch = False
        self.cancelled = False  # set by the loop when the caller went away; read by the worker
        self.finished = False
        self.arrival = time.monotonic()
        self.admitted_at = 0.0
        self.first_token_at = 0.0

    def emit(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class GenerationService(ServiceAccounting):
    def __init__(self, config: ModelConfig, runtime):
        self.config = config
        self.name = config.name
        self.runtime = runtime
        self.settings: GeneratorSettings = backend_settings(config, "generator", GeneratorSettings)
        self._check_settings()
        self.tokenizer = TextTokenizer.from_model(config, default_max_length=self.settings.max_context)
        self.stop_ids = self._stop_ids()
        self.decoder = Decoder(config, self.settings.kv_heads, self.settings.head_dim)
        self.inputs = [TensorSpec(TEXT_INPUT, "BYTES", (-1,))]
        self.outputs = [TensorSpec(TEXT_OUTPUT, "BYTES", (-1,))]
        self._waiting: deque[Sequence] = deque()
        self.queue = self._waiting  # the transports' view: sequences waiting for admission
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._broken: str | None = None  # why the worker thread died, if it did
        self.resident_bytes = 0
        self.stats = ServiceStats()
        self._in_flight = InFlight()
        self._gen_lock = threading.Lock()  # guards the worker-side counters below
        self._running_now = 0
        self._kv_reserved = 0
        self._kv_in_use = 0
        self.g = {"admitted": 0, "joined_mid_generation": 0, "held_back_for_memory": 0, "rejected_does_not_fit": 0,
                  "prefills": 0, "decode_steps": 0, "tokens_generated": 0, "max_running_seen": 0,
                  "prefill_ns": 0, "decode_ns": 0, "cancelled": 0, "expired": 0}
        self._finish_reasons: dict[str, int] = {}
        self._decode_sizes: dict[int, list[int]] = {}  # rows -> [steps, ns]
        self._collected: dict[int, int] = {}

    def _check_settings(self) -> None:
        s, where = self.settings, f"{self.config.directory / 'model.toml'}: [generator]"
        for key in ("max_context", "max_new_tokens", "max_new_tokens_limit", "max_running", "max_rows"):
            if getattr(s, key) <= 0:
                raise ConfigError(f"{where} {key}: expected a positive integer, got {getattr(s, key)}")
        if s.max_new_tokens > s.max_new_tokens_limit:
            raise ConfigError(f"{where} max_new_tokens {s.max_new_tokens} is above max_new_tokens_limit {s.max_new_tokens_limit}")
        if "{prompt}" not in s.prompt_template:
            raise ConfigError(f"{where} prompt_template must contain {{prompt}}, got {s.prompt_template!r}")

    def _stop_ids(self) -> frozenset[int]:
        ids = set()
        for token in self.settings.stop_tokens:
            tid = self.tokenizer.token_id(token)
            if tid is None:
                raise ConfigError(f"{self.config.directory / 'model.toml'}: [generator] stop_tokens: {token!r} is not a "
                                  f"token of {self.tokenizer.path}")
            ids.add(tid)
        return frozenset(ids)

    # ------------------------------------------------------------------ lifecycle

    def _load_decoder(self) -> None:
        with full_affinity():  # the session's native thread pool may use every CPU (cpu_affinity.py)
            self.decoder.load()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._load_decoder)  # loading a session blocks for seconds
        kv = self.decoder.kv
        assert kv is not None
        if self.decoder.vocab and self.decoder.vocab < self.tokenizer.vocab_size:
            log.warning("model %s: tokenizer has %d tokens, the model's vocabulary %d", self.name,
                        self.tokenizer.vocab_size, self.decoder.vocab)
        # The weights stay resident like an engine model's: counted in the budget now, given
        # back by the runtime (resident_bytes) when the model is unloaded.
        self.resident_bytes = self.decoder.weights_bytes
        budget = self.runtime.budget
        budget.resident += self.resident_bytes
        budget.refresh()
        self.runtime.metrics.collectors.append(self._collect_metrics)
        self._thread = threading.Thread(target=self._worker, name=f"generate-{self.name}", daemon=True)
        self._thread.start()
        log.info("model %s: decoder with %s; a full-context sequence (%d tokens) needs %.1f MiB of KV; "
                 "budget available %.1f MiB", self.name, kv.describe(), self.settings.max_context,
                 kv.bytes_per_token * self.settings.max_context / MiB, budget.available() / MiB)

    async def drain(self, timeout: float) -> None:
        self._draining = True
        deadline = time.monotonic() + timeout
        while (len(self._in_flight) or self._waiting or self._running_now) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # once, at shutdown: sequences finish on the worker thread

    async def close(self) -> None:
        self._draining = True
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        try:
            self.runtime.metrics.collectors.remove(self._collect_metrics)
        except ValueError:
            pass
        self.decoder.close()

    # ------------------------------------------------------------------ submitting

    def submit(self, prompt: str, parameters: dict | None = None, *, timeout_s: float | None = None,
               apply_template: bool = True, defaults: dict | None = None) -> Sequence:
        """Tokenize, check and queue one prompt. Raises InvalidInput (empty, too long, bad
        parameters), DoesNotFit (its KV can never fit), Overloaded, Unavailable."""
        if self._draining or self._thread is None:
            raise Unavailable(f"model {self.name!r} is not accepting requests" +
                              (": the daemon is draining" if self._draining else ": not started"))
        if self._broken:
            raise EngineError(f"model {self.name!r} cannot generate: its worker failed ({self._broken}); see the log")
        s = self.settings
        if not prompt.strip():
            raise InvalidInput(f"model {self.name!r}: the prompt is empty")
        text = s.prompt_template.replace("{prompt}", prompt) if apply_template else prompt
        ids = self.tokenizer.encode(text)
        base = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}
        base.update(defaults or {})
        params = parse_params(parameters or {}, default_max_new_tokens=s.max_new_tokens,
                              max_new_tokens_limit=s.max_new_tokens_limit, defaults=base,
                              stop_token_ids=self.stop_ids)
        self.check_fits_context(len(ids), params.max_new_tokens)
        kv = self.decoder.kv
        assert kv is not None
        need = kv.sequence_bytes(len(ids), params.max_new_tokens)
        budget = self.runtime.budget
        capacity = budget.available() + budget.reserved
        if kvmath.never_fits(need, capacity):
            with self._gen_lock:
                self.g["rejected_does_not_fit"] += 1
            raise DoesNotFit(
                f"model {self.name!r}: {len(ids)} prompt + {params.max_new_tokens} new tokens need "
                f"{need / MiB:.2f} MiB of KV cache ({kv.describe()}), more than the memory budget can ever give "
                f"({capacity / MiB:.2f} MiB with nothing else running): lower max_new_tokens or shorten the prompt")
        if len(self._waiting) >= self.config.batching.queue_capacity:
            raise Overloaded(f"model {self.name!r}: {len(self._waiting)} sequences already wait for admission")
        timeout = self.config.batching.default_timeout_ms / 1000.0 if timeout_s is None else timeout_s
        if timeout <= 0:
            raise DeadlineExceeded(f"request timeout {timeout * 1000:.1f} ms has already passed")
        timeout = min(timeout, self.config.batching.max_timeout_ms / 1000.0)
        seq = Sequence(ids, params, need, time.monotonic() + timeout, asyncio.get_running_loop(), self.tokenizer)
        with self._cond:
            self._waiting.append(seq)
            self._cond.notify()
        return seq

    def check_fits_context(self, prompt_tokens: int, max_new_tokens: int) -> None:
        limit = self.settings.max_context
        if prompt_tokens + max_new_tokens > limit:
            raise InvalidInput(
                f"model {self.name!r}: the prompt is {prompt_tokens} tokens; with max_new_tokens {max_new_tokens} that is "
                f"{prompt_tokens + max_new_tokens}, more than the context of {limit} tokens: shorten the prompt "
                "or ask for fewer new tokens")

    def fits_now(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        """Would a sequence this long be admitted at once: its KV need fits in what the budget has
        free after the sequences already waiting, and a decode slot is free? (The rag service asks
        before choosing between this generator and a peer.)"""
        kv = self.decoder.kv
        if kv is None or self._draining or self._thread is None:
            return False
        need = kv.sequence_bytes(prompt_tokens, max_new_tokens)
        with self._cond:
            waiting = sum(seq.need for seq in self._waiting)
            queued = len(self._waiting)
        with self._gen_lock:
            running = self._running_now
        return queued == 0 and running < self.settings.max_running and need + waiting <= self.runtime.budget.available()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    async def events(self, seq: Sequence) -> AsyncIterator[tuple[str, object]]:
        """The sequence's events: ("token", piece) ..., then ("done", GenerationResult).
        An ("error", exc) is raised. Leaving early cancels the sequence."""
        try:
            while True:
                kind, payload = await seq.events.get()
                if kind == "error":
                    raise payload
                yield kind, payload
                if kind == "done":
                    return
        finally:
            if not seq.finished:
                seq.cancelled = True
                with self._cond:
                    self._cond.notify()

    async def generate(self, prompt: str, parameters: dict | None = None, **kwargs) -> GenerationResult:
        seq = self.submit(prompt, parameters, **kwargs)
        async with aclosing(self.events(seq)) as events:
            async for kind, payload in events:
                if kind == "done":
                    return payload
        raise EngineError(f"model {self.name!r}: generation ended without a result")  # not reached

    # ------------------------------------------------------------------ runner interface

    async def infer(self, request: InferRequest) -> InferResponse:
        started = time.monotonic()
        self._in_flight.count += 1
        try:
            texts = text_rows(request, self.name, self.inputs[0], self.outputs, self.settings.max_rows)
            results = await asyncio.gather(*(self.generate(t, request.parameters, timeout_s=request.timeout_s)
                                             for t in texts))
        except BaseException as exc:
            self._failed(started, exc)
            raise
        finally:
            self._in_flight.count -= 1
        self._ok(started, len(texts))
        params = results[0].parameters() if len(results) == 1 else {
            "finish_reason": [r.finish_reason for r in results],
            "completion_tokens": [len(r.token_ids) for r in results]}
        return InferResponse(self.name, request.id, {TEXT_OUTPUT: bytes_array([r.text for r in results])}, params)

    async def stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """One text in; one InferResponse per piece of text out, the last with
        parameters triton_final_response=True and finish_reason."""
        started = time.monotonic()
        self._in_flight.count += 1
        try:
            texts = text_rows(request, self.name, self.inputs[0], self.outputs, 1)
            seq = self.submit(texts[0], request.parameters, timeout_s=request.timeout_s)
            async with aclosing(self.events(seq)) as events:  # leaving early cancels the sequence
                async for chunk in token_responses(self.name, request.id, TEXT_OUTPUT, events):
                    yield chunk
        except BaseException as exc:
            self._failed(started, exc)
            raise
        finally:
            self._in_flight.count -= 1
        self._ok(started, 1)

    def statistics(self) -> dict:
        out = self.stats.triton(self.name)
        kv = self.decoder.kv
        with self._gen_lock:
            g = dict(self.g)
            sizes = {k: list(v) for k, v in self._decode_sizes.items()}
            out.update(
                running=self._running_now,
                waiting=len(self._waiting),
                finish_reasons=dict(self._finish_reasons),
                kv={"bytes_per_token": kv.bytes_per_token if kv else 0,
                    "reserved_bytes": self._kv_reserved,
                    "cache_bytes": self._kv_in_use,
                    "budget_available_bytes": self.runtime.budget.available()},
            )
        out.update({k: v for k, v in g.items() if not k.endswith("_ns")})
        out["inference_stats"]["compute_infer"] = {"count": g["decode_steps"] + g["prefills"],
                                                   "ns": g["decode_ns"] + g["prefill_ns"]}
        out["prefill_ns"], out["decode_ns"] = g["prefill_ns"], g["decode_ns"]
        out["batch_stats"] = [{"batch_size": size, "compute_infer": {"count": c, "ns": ns}}
                              for size, (c, ns) in sorted(sizes.items())]
        return out

    def _collect_metrics(self) -> None:
        """At /metrics time: decode steps per batch size since the last scrape."""
        with self._gen_lock:
            sizes = {k: v[0] for k, v in self._decode_sizes.items()}
        m = self.runtime.metrics
        for size, count in sizes.items():
            delta = count - self._collected.get(size, 0)
            if delta:
                m.batches_total.inc(delta, model=self.name, size=str(size), reason="decode", target="local")
                self._collected[size] = count
        m.queue_depth.set(len(self._waiting), model=self.name)

    # ------------------------------------------------------------------ the worker thread

    def _worker(self) -> None:
        cache: BatchCache | None = None
        running: list[Sequence] = []
        try:
            while True:
                with self._cond:
                    while not self._waiting and not running and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        break
                    admitted = self._admit(len(running))
                    held_back = bool(self._waiting) and not admitted and not running
                for seq in admitted:
                    cache = self._prefill(seq, running, cache)
                cache, running = self._drop(cache, running, lambda s: s.cancelled, "cancelled")
                if running:
                    cache, running = self._step(cache, running)
                elif held_back:
                    with self._cond:
                        self._cond.wait(HELD_BACK_RECHECK_S)
                self._publish(running, cache)
        except BaseException as exc:  # a bug: fail everyone rather than hang them
            log.exception("model %s: generation worker failed", self.name)
            self._broken = f"{type(exc).__name__}: {exc}"
            error = EngineError(f"model {self.name!r}: generation worker failed: {exc}")
            for seq in running:
                self._finish_error(seq, error)
            running = []
        finally:
            stop = Unavailable(f"model {self.name!r} was unloaded")
            for seq in running:
                self._finish_error(seq, stop)
            with self._cond:
                while self._waiting:
                    self._waiting.popleft().emit("error", stop)
            self._publish([], None)

    def _admit(self, running: int) -> list[Sequence]:
        """Under self._cond: pop the waiting sequences that may join now (arrival order,
        guaranteed-no-evict). Cancelled and expired ones are answered and removed."""
        now = time.monotonic()
        admitted: list[Sequence] = []
        budget = self.runtime.budget
        while self._waiting and running + len(admitted) < self.settings.max_running:
            seq = self._waiting[0]
            if seq.cancelled:
                self._waiting.popleft()
                seq.finished = True
                continue
            if now >= seq.deadline:
                self._waiting.popleft()
                with self._gen_lock:
                    self.g["expired"] += 1
                seq.finished = True
                seq.emit("error", DeadlineExceeded(
                    f"model {self.name!r}: waited {now - seq.arrival:.1f} s for KV-cache memory "
                    f"({seq.need / MiB:.2f} MiB) without getting it"))
                continue
            if not budget.try_reserve(seq.need):
                if not seq.held_back:
                    seq.held_back = True
                    with self._gen_lock:
                        self.g["held_back_for_memory"] += 1
                break  # no overtaking: the head waits for memory, the rest wait behind it
            seq.reserved = seq.need
            with self._gen_lock:
                self._kv_reserved += seq.need
            self._waiting.popleft()
            admitted.append(seq)
        return admitted

    def _prefill(self, seq: Sequence, running: list[Sequence], cache: BatchCache | None) -> BatchCache | None:
        seq.admitted_at = time.monotonic()
        t0 = time.perf_counter()
        try:
            logits, own = self.decoder.prefill(seq.prompt_ids)
        except EdgeBatcherError as exc:
            self._finish_error(seq, exc)
            return cache
        with self._gen_lock:
            self.g["prefill_ns"] += int((time.perf_counter() - t0) * 1e9)
            self.g["prefills"] += 1
            self.g["admitted"] += 1
            if running:
                self.g["joined_mid_generation"] += 1
        seq.in_batch = True  # counted as running from its first token on
        with self._gen_lock:
            self._running_now += 1
            self.g["max_running_seen"] = max(self.g["max_running_seen"], self._running_now)
        if self._advance(seq, logits[-1]):
            return cache  # finished at its first token: never joins
        running.append(seq)
        return join(cache, own)

    def _step(self, cache: BatchCache, running: list[Sequence]) -> tuple[BatchCache | None, list[Sequence]]:
        rows = len(running)
        t0 = time.perf_counter()
        try:
            logits, cache = self.decoder.step(cache, np.array([s.next_token for s in running], dtype=np.int64))
        except EdgeBatcherError as exc:
            log.error("model %s: decode step of %d sequences failed: %s", self.name, rows, exc)
            for seq in running:
                self._finish_error(seq, exc)
            return None, []
        ns = int((time.perf_counter() - t0) * 1e9)
        with self._gen_lock:
            self.g["decode_steps"] += 1
            self.g["decode_ns"] += ns
            entry = self._decode_sizes.setdefault(rows, [0, 0])
            entry[0] += 1
            entry[1] += ns
        done = {id(seq) for row, seq in enumerate(running) if self._advance(seq, logits[row])}
        if not done:
            return cache, running
        return self._drop(cache, running, lambda s: id(s) in done, None)

    def _drop(self, cache, running, leaves, reason):
        """Remove finished (or cancelled) sequences from the batch at once."""
        rows = [i for i, s in enumerate(running) if not leaves(s)]
        if len(rows) == len(running):
            return cache, running
        for i, seq in enumerate(running):
            if i not in rows and reason == "cancelled":
                with self._gen_lock:
                    self.g["cancelled"] += 1
                self._release(seq)
                seq.finished = True
        return (keep(cache, rows) if cache is not None else None), [running[i] for i in rows]

    def _advance(self, seq: Sequence, logits: np.ndarray) -> bool:
        """Choose the sequence's next token, stream it; True when the sequence is finished."""
        token = choose(logits, seq.params, seq.rng)
        now = time.monotonic()
        if not seq.first_token_at:
            seq.first_token_at = now
        with self._gen_lock:
            self.g["tokens_generated"] += 1
        if token in seq.params.stop_token_ids and not seq.params.ignore_stop:
            self._finish(seq, "stop")
            return True
        seq.generated.append(token)
        piece = seq.text.add(token)
        if piece:
            seq.emit("token", piece)
        if len(seq.generated) >= seq.params.max_new_tokens:
            self._finish(seq, "length")
            return True
        seq.next_token = token
        return False

    def _finish(self, seq: Sequence, reason: str) -> None:
        rest = seq.text.flush()
        if rest:
            seq.emit("token", rest)
        self._release(seq)
        seq.finished = True
        with self._gen_lock:
            self._finish_reasons[reason] = self._finish_reasons.get(reason, 0) + 1
        seq.emit("done", GenerationResult(
            text=seq.text.emitted, token_ids=list(seq.generated), finish_reason=reason,
            prompt_tokens=len(seq.prompt_ids), queue_s=seq.admitted_at - seq.arrival,
            first_token_s=seq.first_token_at - seq.arrival))

    def _finish_error(self, seq: Sequence, error: EdgeBatcherError) -> None:
        self._release(seq)
        seq.finished = True
        seq.emit("error", error)

    def _release(self, seq: Sequence) -> None:
        """The sequence leaves: its KV reservation goes back to the budget (before its caller
        hears that it finished, so the statistics it may read next are already up to date)."""
        with self._gen_lock:
            if seq.in_batch:
                seq.in_batch = False
                self._running_now -= 1
            self._kv_reserved -= seq.reserved
        if seq.reserved:
            self.runtime.budget.release(seq.reserved)
            seq.reserved = 0

    def _publish(self, running: list[Sequence], cache: BatchCache | None) -> None:
        with self._gen_lock:
            self._kv_in_use = cache.nbytes if cache is not None else 0
