"""GenerationService: a decoder LLM (backend = "generator") served with iteration-level
continuous batching. It checks prompts (tokenized off the event loop), refuses at once a
sequence whose KV cache could never fit the memory budget, queues the rest for the decode loop's
worker thread (decode_loop.py) and turns their events into v2 responses, whole or streamed; a
caller that goes away cancels its sequence. docs/rag.md describes the settings ([generator]) and
the scheduling.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import cast

from ..config import ModelConfig, backend_settings
from ..cpu_affinity import full_affinity
from ..errors import (
    ConfigError,
    DoesNotFit,
    EngineError,
    InvalidInput,
    OutOfMemory,
    Overloaded,
    Unavailable,
)
from ..memory.device import UNIFIED_PROBES, DeviceLoad, ModelDoesNotFit, runs_on_device
from ..memory.heap import malloc_trim
from ..scheduler.validate import timeout_within
from ..types import InferRequest, InferResponse, TensorSpec
from . import kv as kvmath
from .deadline import LocalEstimate
from .deadline import estimate as estimate_local
from .decode_loop import DecodeLoop
from .decoder import Decoder
from .prefill_memory import prefill_scratch
from .sampling import parse_params
from .sequence import GenerationResult, Sequence
from .service import InFlight, ServiceAccounting, ServiceStats, bytes_array, text_rows, token_responses
from .tokenize import TextTokenizer

log = logging.getLogger(__name__)

MiB = 1 << 20
TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"


@dataclass
class GeneratorSettings:
    """[generator] in model.toml (docs/rag.md)."""

    max_context: int = 2048
    max_new_tokens: int = 128
    max_new_tokens_limit: int = 1024
    max_running: int = 8
    prefill_chunk_tokens: int = 128  # a prompt is prefilled this many tokens at a time between decode steps; 0: whole
    prefill_memory_mb: float = -1.0  # what a prefill run holds beyond its cache and logits; -1: measured at load
    max_rows: int = 8  # texts per v2 infer request (each becomes a sequence)
    stop_tokens: list[str] = field(default_factory=list)
    prompt_template: str = "{prompt}"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    kv_heads: int = 0  # 0: read from the model's past_key_values inputs
    head_dim: int = 0


class GenerationService(ServiceAccounting):
    def __init__(self, config: ModelConfig, runtime):
        self.config = config
        self.name = config.name
        self.runtime = runtime
        self.settings: GeneratorSettings = backend_settings(config, "generator", GeneratorSettings)
        self._check_settings()
        self.tokenizer = TextTokenizer.from_model(config, default_max_length=self.settings.max_context)
        self.stop_ids = self._stop_ids()
        self.decoder = Decoder(config, self.settings.kv_heads, self.settings.head_dim, self.settings.max_context)
        self.inputs = [TensorSpec(TEXT_INPUT, "BYTES", (-1,))]
        self.outputs = [TensorSpec(TEXT_OUTPUT, "BYTES", (-1,))]
        self._loop = DecodeLoop(self.name, self.decoder, runtime.budget, self.settings.max_running,
                                self.settings.prefill_chunk_tokens)
        self.queue = self._loop.waiting  # the transports' view: sequences waiting for admission
        self._draining = False
        self.resident_bytes = 0
        self.prefill_scratch = 0  # bytes a prefill run holds beyond its cache and logits (measured at load)
        self._capacity_at_load = 0  # budget.capacity() once the decoder is loaded (submit)
        self.stats = ServiceStats()
        self._in_flight = InFlight()
        self._collected: dict[int, int] = {}  # decode steps per batch size already counted in /metrics

    def _check_settings(self) -> None:
        s, where = self.settings, f"{self.config.directory / 'model.toml'}: [generator]"
        for key in ("max_context", "max_new_tokens", "max_new_tokens_limit", "max_running", "max_rows"):
            if getattr(s, key) <= 0:
                raise ConfigError(f"{where} {key}: expected a positive integer, got {getattr(s, key)}")
        if s.prefill_chunk_tokens < 0:
            raise ConfigError(f"{where} prefill_chunk_tokens: expected 0 (whole prompts) or a positive integer, "
                              f"got {s.prefill_chunk_tokens}")
        if s.prefill_memory_mb < 0 and s.prefill_memory_mb != -1:
            raise ConfigError(f"{where} prefill_memory_mb: expected -1 (measured at load) or MiB >= 0, "
                              f"got {s.prefill_memory_mb}")
        if s.max_new_tokens > s.max_new_tokens_limit:
            raise ConfigError(f"{where} max_new_tokens {s.max_new_tokens} is above "
                              f"max_new_tokens_limit {s.max_new_tokens_limit}")
        if "{prompt}" not in s.prompt_template:
            raise ConfigError(f"{where} prompt_template must contain {{prompt}}, got {s.prompt_template!r}")

    def _stop_ids(self) -> frozenset[int]:
        ids = set()
        for token in self.settings.stop_tokens:
            tid = self.tokenizer.token_id(token)
            if tid is None:
                raise ConfigError(f"{self.config.directory / 'model.toml'}: [generator] stop_tokens: "
                                  f"{token!r} is not a token of {self.tokenizer.path}")
            ids.add(tid)
        return frozenset(ids)

    # ------------------------------------------------------------------ lifecycle

    def _load_decoder(self) -> int:
        """Load the decoder; what it took of the memory the budget plans with (its weights where
        no meter sees it: memory/device.py), measured by `resident_meter`. A load the budget
        cannot hold raises ModelDoesNotFit."""
        load = DeviceLoad(self.runtime.budget)
        with full_affinity():  # the session's native thread pool may use every CPU (cpu_affinity.py)
            with load.held(self.config):
                self.decoder.load()
            meter = load.meter(self.decoder.engine)
            loaded = load.load_bytes(meter) if meter is not None else self.decoder.weights_bytes
            try:  # before the load's growth is read: what the runs leave (an arena's growth) is the load's
                self.prefill_scratch = self._measure_prefill(max(0, load.available_before - loaded))
            except EngineError as exc:
                self.decoder.engine.close()
                what = (f"model {self.name!r}: prefilling a prompt of up to max_context {self.settings.max_context} "
                        f"tokens in chunks of {self.settings.prefill_chunk_tokens} at load, to measure a run's memory, "
                        f"failed ([generator] prefill_memory_mb = N sets it without measuring): {exc}")
                raise (ModelDoesNotFit(what) if isinstance(exc, OutOfMemory) else EngineError(what)) from exc
        if meter is None:
            return self.decoder.weights_bytes
        took = load.load_bytes(meter)
        if took > load.available_before:
            self.decoder.engine.close()
            raise ModelDoesNotFit(f"model {self.name!r}: loading its decoder took {took / MiB:.1f} MiB, more than the "
                                  f"{load.available_before / MiB:.1f} MiB the memory budget had for it")
        self.resident_meter = meter.name
        return took

    def _measure_prefill(self, available: int) -> int:
        """What a prefill run holds beyond its cache and logits (prefill_memory.py), reserved
        while prompts are prefilled: as set ([generator] prefill_memory_mb), or measured; 0 for
        a decoder on a discrete GPU, whose intermediates stay in its arena (counted in the load)
        and whose host memory no budget plans."""
        if self.settings.prefill_memory_mb >= 0:
            return int(self.settings.prefill_memory_mb * MiB)
        scratch = prefill_scratch(self.decoder, self.settings.prefill_chunk_tokens, available, self.name,
                                  malloc_trim(), self.runtime.budget.reservation)
        if runs_on_device(self.decoder.engine) and self.runtime.budget.probe.name not in UNIFIED_PROBES:
            log.info("model %s: on %s a prefill run's intermediates stay in the device's arena, counted in the load: "
                     "nothing reserved per run", self.name, self.decoder.engine.providers[0])
            return 0
        return scratch

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        resident = await loop.run_in_executor(None, self._load_decoder)  # loading a session blocks for seconds
        kv = self.decoder.kv
        assert kv is not None
        if self.decoder.vocab and self.decoder.vocab < self.tokenizer.vocab_size:
            log.warning("model %s: tokenizer has %d tokens, the model's vocabulary %d", self.name,
                        self.tokenizer.vocab_size, self.decoder.vocab)
        # The decoder's memory stays resident like an engine model's: counted in the budget now,
        # given back by the runtime (resident_bytes) when the model is unloaded. Its KV cache is
        # reserved per sequence (decode_loop.py).
        self.resident_bytes = resident
        budget = self.runtime.budget
        budget.resident += self.resident_bytes
        budget.refresh()
        self._capacity_at_load = budget.capacity()
        self.runtime.metrics.collectors.append(self._collect_metrics)
        self._loop.start(self.prefill_scratch)
        log.info("model %s: decoder with %s; a full-context sequence (%d tokens) needs %.1f MiB of KV; a prefill "
                 "run %.1f MiB beyond its cache and logits; budget available %.1f MiB", self.name, kv.describe(),
                 self.settings.max_context, kv.bytes_per_token * self.settings.max_context / MiB,
                 self.prefill_scratch / MiB, budget.available() / MiB)
        if self.settings.prefill_chunk_tokens == 0:
            log.warning("model %s: prefill_chunk_tokens = 0: prompts are prefilled whole; a long prompt's own "
                        "activations, which no memory plan counts, grow faster than its length (attention's with "
                        "its square: a 700-token prompt of SmolLM2-135M peaked 0.8-1.2 GB, docs/rag.md); chunks "
                        "of 128 bound them, and a chunk's are measured at load and reserved", self.name)

    async def drain(self, timeout: float) -> None:
        """Let what is queued and running finish, up to `timeout`; what is left then is stopped
        and answered Unavailable (a stream gets it as its last event) before the transports
        close, instead of being cut off with them."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while (len(self._in_flight) or self._loop.waiting or self._loop.running()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # once, at shutdown: sequences finish on the worker thread
        if self._loop.waiting or self._loop.running():
            log.warning("model %s: %d sequence(s) still generating and %d waiting after %.1f s of drain: "
                        "stopping them", self.name, self._loop.running(), self._loop.waiting_count(), timeout)
            why = (f"was stopped: its drain time ({timeout:g} s, [server] drain_timeout_s) ran out before the "
                   "sequence finished (the daemon is stopping, or the model is unloaded or reloaded)")
            await asyncio.get_running_loop().run_in_executor(None, self._loop.stop, 10.0, why)

    async def close(self) -> None:
        self._draining = True
        await asyncio.get_running_loop().run_in_executor(None, self._loop.stop, 10.0)
        try:
            self.runtime.metrics.collectors.remove(self._collect_metrics)
        except ValueError:
            pass
        self.decoder.close()

    # ------------------------------------------------------------------ submitting

    async def submit(self, prompt: str, parameters: dict | None = None, *, timeout_s: float | None = None,
                     apply_template: bool = True, defaults: dict | None = None) -> Sequence:
        """Tokenize, check and queue one prompt. Raises InvalidInput (empty, too long, bad
        parameters), DoesNotFit (its KV can never fit), Overloaded, Unavailable. A prompt of
        more than [tokenizer] max_chars characters is refused before it is tokenized; the
        tokenizing itself (about a microsecond per character) runs off the event loop."""
        self._check_serving()
        s = self.settings
        if not prompt.strip():
            raise InvalidInput(f"model {self.name!r}: the prompt is empty")
        limit = self.tokenizer.max_chars
        if len(prompt) > limit:
            raise InvalidInput(f"model {self.name!r}: the prompt is {len(prompt)} characters, more than the "
                               f"{limit} it reads ([tokenizer] max_chars): shorten the prompt")
        base = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}
        base.update(defaults or {})
        params = parse_params(parameters or {}, default_max_new_tokens=s.max_new_tokens,
                              max_new_tokens_limit=s.max_new_tokens_limit, defaults=base,
                              stop_token_ids=self.stop_ids)
        deadline = time.monotonic() + timeout_within(timeout_s, self.config.batching)
        if len(self._loop.waiting) >= self.config.batching.queue_capacity:  # before any work on the prompt
            raise Overloaded(f"model {self.name!r}: {len(self._loop.waiting)} sequences already wait for admission")
        text = s.prompt_template.replace("{prompt}", prompt) if apply_template else prompt
        ids = await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.encode, text)
        self._check_serving()  # it may have started draining meanwhile
        self.check_fits_context(len(ids), params.max_new_tokens)
        kv = self.decoder.kv
        assert kv is not None
        need = (self.decoder.footprint().sequence_bytes(len(ids), params.max_new_tokens)
                + self._loop.run_bytes(1, len(ids)))
        # A probe's free figure moves with whatever else holds memory for a moment (another batch's
        # allocations, an arena growing, other processes): refused as never fitting only against
        # the most the budget could give since the load; one that fits that is held back until
        # the memory is there, or its deadline.
        capacity = max(self.runtime.budget.capacity(), self._capacity_at_load)
        if kvmath.never_fits(need, capacity):
            self._loop.count_rejected()
            raise DoesNotFit(
                f"model {self.name!r}: {len(ids)} prompt + {params.max_new_tokens} new tokens need "
                f"{need / MiB:.2f} MiB of KV cache, logits and prefill run alone ({kv.describe()}, {self._layout()}; a "
                f"prefill run's own {self.prefill_scratch / MiB:.2f} MiB measured at load), more than the "
                f"memory budget can ever give ({capacity / MiB:.2f} MiB with nothing else running): lower "
                "max_new_tokens or shorten the prompt")
        seq = Sequence(ids, params, need, deadline, asyncio.get_running_loop(), self.tokenizer)
        self._loop.enqueue(seq)
        return seq

    def not_ready(self) -> str | None:
        try:
            self._check_serving()
        except (Unavailable, EngineError) as exc:
            return exc.message
        return None

    def _check_serving(self) -> None:
        if self._draining or not self._loop.started:
            raise Unavailable(f"model {self.name!r} is not accepting requests" +
                              (": the daemon is draining" if self._draining else ": not started"))
        if self._loop.broken:
            raise EngineError(
                f"model {self.name!r} cannot generate: its worker failed ({self._loop.broken}); see the log"
            )

    def check_fits_context(self, prompt_tokens: int, max_new_tokens: int) -> None:
        limit = self.settings.max_context
        if prompt_tokens + max_new_tokens > limit:
            raise InvalidInput(
                f"model {self.name!r}: the prompt is {prompt_tokens} tokens; "
                f"with max_new_tokens {max_new_tokens} that is "
                f"{prompt_tokens + max_new_tokens}, more than the context of {limit} tokens: shorten the prompt "
                "or ask for fewer new tokens")

    def fits_now(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        """Would a sequence this long be admitted at once: nothing waits, a decode slot is free,
        no other model has waited longer for memory (the budget's line: admission would hold it
        back), and what it would add to the batch's KV reservation fits in what the budget has
        free? (The rag service asks before choosing between this generator and a peer.)"""
        kv = self.decoder.kv
        if kv is None or self._draining or not self._loop.started:
            return False
        queued = self._loop.waiting_count()
        running = self._loop.running()
        budget = self.runtime.budget
        return (queued == 0 and running < self.settings.max_running and budget.first_in_line(self._loop.line_key)
                and self._loop.extra_bytes(prompt_tokens, max_new_tokens) <= budget.available())

    def _layout(self) -> str:
        if self.decoder.shared_kv:
            return "kept in place: whole 64-token columns"
        return "Optimum's layout: held twice while a step runs"

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def step_times(self) -> tuple[float, float] | None:
        """(seconds of prefill per prompt token, mean seconds of a decode step) measured so far,
        or None before both were measured."""
        g = self._loop.snapshot().counters
        if not g["prefill_tokens"] or not g["decode_steps"]:
            return None
        return g["prefill_ns"] / g["prefill_tokens"] / 1e9, g["decode_ns"] / g["decode_steps"] / 1e9

    def estimate(self, prompt_tokens: int, max_new_tokens: int) -> LocalEstimate | None:
        """How long such a generation would take if it started now (rag/deadline.py): the rag
        service routes by it."""
        return estimate_local(self.step_times(), max_new_tokens, prompt_tokens, self.settings.prefill_chunk_tokens,
                              self._loop.running())

    async def events(self, seq: Sequence) -> AsyncGenerator[tuple[str, object], None]:
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
                self.cancel(seq)

    def cancel(self, seq: Sequence) -> None:
        """The caller went away: the decode loop drops the sequence before its next step."""
        seq.cancelled = True
        self._loop.wake()

    async def generate(self, prompt: str, parameters: dict | None = None, **kwargs) -> GenerationResult:
        seq = await self.submit(prompt, parameters, **kwargs)
        async with aclosing(self.events(seq)) as events:
            async for kind, payload in events:
                if kind == "done":
                    return cast(GenerationResult, payload)  # Sequence.emit_done's
        raise EngineError(f"model {self.name!r}: generation ended without a result")  # not reached

    # ------------------------------------------------------------------ runner interface

    async def infer(self, request: InferRequest) -> InferResponse:
        started = time.monotonic()
        self._in_flight.count += 1
        try:
            texts = text_rows(request, self.name, self.inputs[0], self.outputs, self.settings.max_rows,
                              self.tokenizer.max_chars)
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
            texts = text_rows(request, self.name, self.inputs[0], self.outputs, 1, self.tokenizer.max_chars)
            seq = await self.submit(texts[0], request.parameters, timeout_s=request.timeout_s)
            async with aclosing(self.events(seq)) as events:  # leaving early cancels the sequence
                async for chunk in token_responses(self.name, request.id, TEXT_OUTPUT, events):
                    yield chunk
        except BaseException as exc:
            self._failed(started, exc)
            raise
        finally:
            self._in_flight.count -= 1
        self._ok(started, 1)

    @property
    def batches_started(self) -> int:
        return self._loop.runs_started()

    def statistics(self) -> dict:
        out = self.stats.triton(self.name) | {"queue_depth": len(self.queue), "instances": 1,
                                              "memory": {"resident_bytes": self.resident_bytes,
                                                         "measured_by": self.resident_meter or "estimate"}}
        kv = self.decoder.kv
        now = self._loop.snapshot()
        g, sizes = now.counters, now.decode_sizes
        out.update(
            running=now.running,
            waiting=len(self._loop.waiting),
            finish_reasons=now.finish_reasons,
            kv={"bytes_per_token": kv.bytes_per_token if kv else 0,
                "layout": "in_place" if self.decoder.shared_kv else "optimum",
                "reserved_bytes": now.kv_reserved,
                "cache_bytes": now.kv_in_use,
                "prefill_run_bytes": self.prefill_scratch,
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
        sizes = self._loop.decode_steps_by_size()
        m = self.runtime.metrics
        for size, count in sizes.items():
            delta = count - self._collected.get(size, 0)
            if delta:
                m.batches_total.inc(delta, model=self.name, size=str(size), reason="decode", target="local")
                self._collected[size] = count
        m.queue_depth.set(len(self._loop.waiting), model=self.name)
