"""RagService: questions answered from the local document index (backend = "rag").

A question is embedded by the embedding model through the core scheduler (batched with every
other embedding request), the index ranks its passages (passage cosine, best sentence's cosine and
BM25, fused: fusion.py), and the answer comes from the local generator when its KV cache fits now
and the deadline allows, else from a generation peer ([rag.peer], peer.py), else extractively (the
best sentences, extract.py); `route` in the response says which. Settings: rag/settings.py;
model.toml keys, the v2 interface and the figures: docs/rag.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing

from ..config import ModelConfig
from ..errors import ConfigError, DeadlineExceeded, InvalidInput, Unavailable
from ..offload.client import PeerError
from ..scheduler.runner import ModelRunner
from ..scheduler.validate import timeout_within
from ..types import InferRequest, InferResponse, TensorSpec
from .deadline import extractive_reserve, start_within, too_slow
from .documents import Documents
from .extract import NO_PASSAGE, answer_text, choose, quoted_sentences, stored_vectors
from .index import Hit, Index, IndexWatcher, load_index, on_topic
from .peer import ChatPeer
from .prompt import assemble, render
from .service import (
    FINAL,
    InFlight,
    ServiceAccounting,
    ServiceStats,
    bytes_array,
    final_response,
    text_rows,
    token_responses,
    wait_idle,
)
from .settings import fusion_from, index_dir_for, rag_settings
from .spelling import Speller, tokenizer_words

log = logging.getLogger(__name__)

QUESTION = "question"
ANSWER = "answer"
SOURCES = "sources"
GENERATION_PARAMETERS = ("max_new_tokens", "temperature", "top_p", "seed", "ignore_stop")


class RagService(ServiceAccounting):
    def __init__(self, config: ModelConfig, runtime):
        self.config = config
        self.name = config.name
        self.runtime = runtime
        self.settings = rag_settings(config)
        self.index_dir = index_dir_for(config, self.settings)
        self.fusion = fusion_from(self.settings)
        self.peer = (ChatPeer(self.settings.peer, f"{config.directory / 'model.toml'}: [rag.peer]")
                     if self.settings.peer is not None else None)
        self.inputs = [TensorSpec(QUESTION, "BYTES", (-1,))]
        self.outputs = [TensorSpec(ANSWER, "BYTES", (-1,)), TensorSpec(SOURCES, "BYTES", (-1,))]
        self.queue = InFlight()
        self.stats = ServiceStats()
        self._index: Index | None = None
        # Corrects misspelt words of questions (spelling.py): the embedding tokenizer's words,
        # read at start; the speller itself is built with each index, from its passages.
        self._general_words: frozenset[str] | None = None
        self._speller: Speller | None = None
        self._index_problem: str | None = None
        self._watcher = IndexWatcher(self.index_dir)
        self._reload_lock: asyncio.Lock | None = None
        self._draining = False
        self._embedding_dim = 0
        self._max_rows = self.settings.max_rows
        self.counters = {"extractive": 0, "generated": 0, "index_reloads": 0, "embed_ns": 0, "search_ns": 0,
                         "generate_ns": 0, "extract_ns": 0, "passages_returned": 0,
                         "sentences_embedded": 0, "sentences_from_index": 0, "questions_corrected": 0}
        self.routes = {"local": 0, "peer": 0, "extractive": 0}
        self.documents = Documents(self)  # added and removed over the API (documents.py)
        self.fallbacks: dict[str, int] = {}  # why a generated answer was not possible -> count

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self.settings
        embedder = self.runtime.runners.get(s.embedding_model)
        where = f"{self.config.directory / 'model.toml'}: [rag] embedding_model"
        if embedder is None:
            raise ConfigError(f"{where}: model {s.embedding_model!r} is not loaded (build it with "
                              "tools/build_embedding_model.py, and list it in [models] load if you use that)")
        if [spec.datatype for spec in embedder.inputs] != ["BYTES"] or len(embedder.outputs) != 1:
            raise ConfigError(f"{where}: {s.embedding_model!r} is not a text-embedding model (one BYTES input, one "
                              "output); use backend edge_batcher.rag.embed:TextEmbeddingEngine")
        self._embedding_dim = embedder.outputs[0].shape[-1]
        self._max_rows = min(s.max_rows, embedder.config.batching.max_batch_size)
        self._embed_rows = embedder.config.batching.max_batch_size
        tokenizer = self._embedding_tokenizer()
        if s.correct_spelling and tokenizer is not None:
            self._general_words = await asyncio.get_running_loop().run_in_executor(
                None, tokenizer_words, tokenizer.vocabulary())
        if self.peer is not None:
            await self.peer.start()
        self._reload_lock = asyncio.Lock()
        try:
            await self._current_index()
        except Unavailable as exc:
            log.warning("model %s: %s", self.name, exc)  # served once the index is built
        else:
            log.info("model %s: index %s: %d passages (version %s), %s mode", self.name, self.index_dir,
                     len(self._index or ()), (self._index.meta.get("version") if self._index else None),
                     self._mode())

    def not_ready(self) -> str | None:
        """No index loaded (none built, or unreadable by the daemon's user) or one that does not
        match the embedding model: every question would be answered 503."""
        if self._draining:
            return "draining"
        if self._index is None:
            return f"no document index loaded from {self.index_dir} (build it with `edge-batcher index add FILES...`)"
        return self._index_problem

    async def drain(self, timeout: float) -> None:
        self._draining = True
        await wait_idle(self.queue, timeout)

    async def close(self) -> None:
        self._draining = True
        self._index = None
        if self.peer is not None:
            await self.peer.close()

    # ------------------------------------------------------------------ the index

    async def reload_index(self) -> None:
        """Load the index now if its files changed (after documents were added or removed);
        a problem with it shows in not_ready() and in the answers."""
        try:
            await self._current_index()
        except Unavailable:
            pass

    async def _current_index(self) -> Index:
        """The index, reloaded (off the loop) when meta.json was replaced since the last look."""
        assert self._reload_lock is not None
        if self._watcher.changed():
            async with self._reload_lock:
                if self._watcher.changed():
                    signature = self._watcher.signature()
                    try:
                        index, speller = await asyncio.get_running_loop().run_in_executor(None, self._load_index)
                    except Unavailable as exc:
                        if self._index is None:
                            raise
                        log.warning("model %s: keeping the loaded index: %s", self.name, exc)
                    else:
                        self._watcher.mark(signature)
                        self._set_index(index)
                        self._speller = speller
        if self._index is None:
            raise Unavailable(f"model {self.name!r}: no document index in {self.index_dir}: build it with "
                              "`edge-batcher index add FILES...`")
        if self._index_problem:
            raise Unavailable(f"model {self.name!r}: {self._index_problem}")
        return self._index

    def _load_index(self) -> tuple[Index | None, Speller | None]:
        """The index (None: none built yet), and the speller of its words (on a worker thread:
        both read the whole corpus)."""
        index = load_index(self.index_dir)
        general = self._general_words
        if index is None or general is None:
            return index, None
        return index, Speller.for_index(general, index.passages)

    def _set_index(self, index: Index | None) -> None:
        previous = self._index
        self._index = index
        self._index_problem = None
        if index is None:
            return
        meta = index.meta
        if meta.get("embedding_model") != self.settings.embedding_model:
            self._index_problem = (
                f"the index in {self.index_dir} was built with embedding model {meta.get('embedding_model')!r}, "
                f"this model uses {self.settings.embedding_model!r}: rebuild it with `edge-batcher index add "
                f"--embedding-model {self.settings.embedding_model} ...`")
        elif self._embedding_dim and index.dim != self._embedding_dim:
            self._index_problem = (f"the index has {index.dim}-d embeddings, "
                                   f"the embedding model gives {self._embedding_dim}-d")
        if previous is not None:
            self.counters["index_reloads"] += 1
            log.info("model %s: reloaded index %s: %d passages (version %s)", self.name, self.index_dir, len(index),
                     meta.get("version"))

    # ------------------------------------------------------------------ the pipeline

    def _parameters(self, parameters: dict) -> tuple[int, dict]:
        top_k = parameters.get("top_k", self.settings.top_k)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= self.settings.max_top_k:
            raise InvalidInput(f"parameters.top_k (passages to retrieve) must be an integer in "
                               f"1..{self.settings.max_top_k}, got {top_k!r}")
        generation = {k: parameters[k] for k in GENERATION_PARAMETERS if k in parameters}
        if self.settings.max_new_tokens and "max_new_tokens" not in generation:
            generation["max_new_tokens"] = self.settings.max_new_tokens
        return top_k, generation

    def _questions(self, request: InferRequest, max_rows: int) -> list[str]:
        if self._draining:
            raise Unavailable(f"model {self.name!r} is not accepting requests: the daemon is draining")
        questions = text_rows(request, self.name, self.inputs[0], self.outputs, max_rows,
                              self.settings.max_question_chars)
        tokenizer = self._embedding_tokenizer()
        if tokenizer is not None:
            for i, n in enumerate(len(ids) for ids in tokenizer.encode_batch(questions)):
                if n > tokenizer.max_length:
                    raise InvalidInput(f"input {QUESTION!r}: question {i} is {n} tokens, more than the "
                                       f"{tokenizer.max_length} the embedding model {self.settings.embedding_model!r} "
                                       "reads: ask a shorter question")
        return questions

    def _embedding_tokenizer(self):
        runner = self.runtime.runners.get(self.settings.embedding_model)
        return runner.engines[0].tokenizer if isinstance(runner, ModelRunner) else None

    async def _embed(self, texts: list[str], request: InferRequest, deadline: float):
        """Embeddings of texts through the core scheduler (batched with every other request),
        in requests of at most the embedding model's batch size, within what is left of the
        rag request's time."""
        import numpy as np

        step = self._embed_rows or len(texts)
        left = self._left(deadline, "the embedding model's answer")
        responses = await asyncio.gather(*(self.runtime.infer(InferRequest(
            model=self.settings.embedding_model, inputs={"text": bytes_array(texts[i:i + step])},
            priority=request.priority, timeout_s=left)) for i in range(0, len(texts), step)))
        return np.concatenate([next(iter(r.outputs.values())) for r in responses])

    async def _retrieve(self, questions: list[str], top_k: int, request: InferRequest, deadline: float):
        """The hits of each question (best first) and the questions' embeddings."""
        index = await self._current_index()
        t0 = time.perf_counter()
        speller = self._speller
        if speller is not None:  # up to ~1 ms a question (MAX_CORRECTIONS unknown words): not on the loop
            corrected = await asyncio.get_running_loop().run_in_executor(
                None, lambda: [speller.correct(q) for q in questions])
            self.counters["questions_corrected"] += sum(a != b for a, b in zip(questions, corrected))
            questions = corrected
        vectors = await self._embed(questions, request, deadline)
        t1 = time.perf_counter()
        ranked = index.search_fused(vectors, questions, top_k, self.fusion)
        hits = [on_topic(row, self.settings.min_score) for row in ranked]
        self.counters["embed_ns"] += int((t1 - t0) * 1e9)
        self.counters["search_ns"] += int((time.perf_counter() - t1) * 1e9)
        self.counters["passages_returned"] += sum(len(h) for h in hits)
        return hits, vectors

    def _generator(self):
        name = self.settings.generator
        gen = self.runtime.runners.get(name)
        if gen is None or not hasattr(gen, "generate"):
            raise Unavailable(f"model {self.name!r}: [rag] generator {name!r} is not a loaded generator model")
        return gen

    def _prompt(self, gen, question: str, hits: list[Hit], max_new: int) -> tuple[str, list[Hit], int]:
        """The prompt with as many passages as fit the generator, those passages and its tokens.
        Blocking (tokenizes the prompt once per passage left out): run off the event loop."""
        limit = gen.settings.max_context
        s = self.settings
        prompt, used = assemble(s.prompt_template, s.passage_template, question, hits,
                                lambda p: len(p) <= gen.tokenizer.max_chars and gen.count_tokens(p) + max_new <= limit)
        tokens = gen.count_tokens(prompt)
        gen.check_fits_context(tokens, max_new)  # even without passages: a clear error
        return prompt, used, tokens

    async def _extract(self, vector, hits: list[Hit], request: InferRequest, deadline: float) -> str:
        """The extractive answer: the best one or two sentences of the first `answer_passages`
        hits (extract.py); the close-call line still names the first two."""
        if not hits:
            return NO_PASSAGE
        quoted, candidates = quoted_sentences(hits, self.settings.answer_passages)
        if not candidates:
            return ""
        t0 = time.perf_counter()
        vectors = stored_vectors(quoted, candidates)
        if vectors is None:
            vectors = await self._embed([c.embed_text(quoted) for c in candidates], request, deadline)
            self.counters["sentences_embedded"] += len(candidates)
        else:
            self.counters["sentences_from_index"] += len(candidates)
        chosen = choose(vector, candidates, vectors, max_sentences=self.settings.answer_sentences,
                        margin=self.settings.sentence_margin)
        self.counters["extract_ns"] += int((time.perf_counter() - t0) * 1e9)
        return answer_text(chosen, hits)

    def _deadline(self, request: InferRequest, started: float) -> float:
        """The request's deadline on the time.monotonic() clock: its timeout up to the model's
        max_timeout_ms, else the model's default_timeout_ms, from its arrival. Every stage it
        goes through (the embedding model, the generator, the peer) gets what is left of it."""
        return started + timeout_within(request.timeout_s, self.config.batching)

    def _left(self, deadline: float, stage: str) -> float:
        """Seconds left before `deadline` for `stage`, or DeadlineExceeded."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"model {self.name!r}: the request's deadline passed before {stage}")
        return left

    async def _start_generation(self, question: str, hits: list[Hit], generation: dict, deadline: float):
        """Decide where this answer is generated, and start it there: (route, passages used,
        generation events or None for an extractive answer, why the earlier choices were passed
        over or None).

        The local generator when it would finish before the deadline (deadline.py) and its KV
        cache fits the memory budget now (or when it is the only generator), else the peer when
        it is usable and answers, else extractive. A local sequence that could not start in time
        to end before the deadline (deadline.start_within) is answered extractively too."""
        s = self.settings
        reasons: list[str] = []
        fallback = None  # what an extractive answer is counted as in the stats' fallbacks
        if s.generator:
            gen = self._generator()
            max_new = generation.get("max_new_tokens", gen.settings.max_new_tokens)
            if isinstance(max_new, bool) or not isinstance(max_new, int):
                raise InvalidInput(f"parameters.max_new_tokens must be an integer, got {max_new!r}")
            prompt, used, tokens = await asyncio.get_running_loop().run_in_executor(
                None, self._prompt, gen, question, hits, max_new)
            local = gen.estimate(tokens, max_new)
            # One reading of the clock for the whole decision: passed here is a 504 whatever the
            # estimate says, as it is on the way to the peer.
            left = self._left(deadline, "generation")
            late = too_slow(s.generator, local, left - extractive_reserve(left))
            if late is None and (self.peer is None or gen.fits_now(tokens, max_new)):
                wait = start_within(left, local)
                try:  # judged before anything is sent on, as the peer is
                    seq = await gen.submit(prompt, generation, apply_template=False, timeout_s=wait)
                    events = gen.events(seq)
                    first = await events.__anext__()
                except DeadlineExceeded as exc:
                    # It could not start in time to end before the deadline (a place, its KV
                    # memory): answered extractively in the time kept back, too little for the peer.
                    return self._extractive(hits, f"local generator {s.generator!r}: {exc}", "deadline")
                return "local", used, _prepended(first, events), None
            reasons.append(late or f"local generator {s.generator!r}: no room in the KV memory budget now")
            fallback = "deadline" if late else "local"
        if self.peer is not None:
            if self.peer.usable():
                events = self.peer.stream(render(s.prompt_template, s.passage_template, question, hits),
                                          generation, self._left(deadline, "generation on the peer"))
                try:
                    first = await events.__anext__()  # the peer is judged before anything is sent on
                except PeerError as exc:
                    await events.aclose()
                    reasons.append(exc.message)
                else:
                    return "peer", hits, _prepended(first, events), "; ".join(reasons) or None
            else:
                reasons.append(f"generation peer {self.peer.name}: " + (
                    "unhealthy" if self.peer.healthy is False else f"circuit breaker {self.peer.breaker.state}"))
            fallback = "peer"
        return self._extractive(hits, "; ".join(reasons) or None, fallback)

    def _extractive(self, hits: list[Hit], reason: str | None, fallback: str | None):
        """The extractive route, counted in the stats' fallbacks as the last choice that failed."""
        if fallback:
            self.fallbacks[fallback] = self.fallbacks.get(fallback, 0) + 1
            log.debug("model %s: answering extractively: %s", self.name, reason)
        return "extractive", hits, None, reason

    def _routed(self, route: str, reason: str | None) -> dict:
        self.routes[route] += 1
        return {"route": route, **({"route_reason": reason} if reason else {})}

    async def _answer(self, question: str, vector, hits: list[Hit], generation: dict,
                      request: InferRequest, deadline: float) -> tuple[str, list[Hit], dict]:
        route, used, events, reason = await self._start_generation(question, hits, generation, deadline)
        if events is None:
            answer = await self._extract(vector, hits, request, deadline)
            self.counters["extractive"] += 1
            return answer, hits, {"mode": "extractive", **self._routed(route, reason)}
        t0 = time.perf_counter()
        result = None
        async with aclosing(events):  # leaving early cancels the generation
            async for kind, payload in events:
                if kind == "done":
                    result = payload
        if result is None:
            raise PeerError(f"model {self.name!r}: generation ended without a result")
        self.counters["generate_ns"] += int((time.perf_counter() - t0) * 1e9)
        self.counters["generated"] += 1
        return result.text, used, {"mode": "generated", **self._routed(route, reason), **result.parameters()}

    async def infer(self, request: InferRequest) -> InferResponse:
        started = time.monotonic()
        self.queue.count += 1
        try:
            deadline = self._deadline(request, started)
            questions = self._questions(request, self._max_rows)
            top_k, generation = self._parameters(request.parameters)
            hits, vectors = await self._retrieve(questions, top_k, request, deadline)
            answers = await asyncio.gather(*(self._answer(q, v, h, generation, request, deadline)
                                             for q, v, h in zip(questions, vectors, hits)))
        except BaseException as exc:
            self._failed(started, exc)
            raise
        finally:
            self.queue.count -= 1
        self._ok(started, len(questions))
        outputs = {ANSWER: bytes_array([a for a, _, _ in answers]),
                   SOURCES: bytes_array([_sources(used) for _, used, _ in answers])}
        if request.outputs is not None:
            outputs = {k: v for k, v in outputs.items() if k in request.outputs}
        return InferResponse(self.name, request.id, outputs, answers[0][2] if len(answers) == 1 else {})

    async def stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """One question: a first chunk with the sources, then the answer in pieces as it is
        generated (here or on the peer), the last chunk with triton_final_response=True
        (extractive: one chunk)."""
        started = time.monotonic()
        self.queue.count += 1
        try:
            deadline = self._deadline(request, started)
            questions = self._questions(request, 1)
            top_k, generation = self._parameters(request.parameters)
            hits, vectors = await self._retrieve(questions, top_k, request, deadline)
            hits = hits[0]
            route, used, events, reason = await self._start_generation(questions[0], hits, generation, deadline)
            if events is None:
                answer = await self._extract(vectors[0], hits, request, deadline)
                self.counters["extractive"] += 1
                yield final_response(self.name, request.id, {
                    ANSWER: bytes_array([answer]), SOURCES: bytes_array([_sources(hits)])},
                    mode="extractive", **self._routed(route, reason))
            else:
                routed = self._routed(route, reason)
                t0 = time.perf_counter()
                async with aclosing(events):  # leaving early cancels the generation
                    yield InferResponse(self.name, request.id, {
                        ANSWER: bytes_array([""]), SOURCES: bytes_array([_sources(used)])}, {FINAL: False, **routed})
                    async for chunk in token_responses(self.name, request.id, ANSWER, events,
                                                       mode="generated", **routed):
                        if chunk.parameters[FINAL]:
                            self.counters["generated"] += 1
                            self.counters["generate_ns"] += int((time.perf_counter() - t0) * 1e9)
                        yield chunk
        except BaseException as exc:  # a peer failing after its first token is a PeerError (502)
            self._failed(started, exc)
            raise
        finally:
            self.queue.count -= 1
        self._ok(started, 1)

    def statistics(self) -> dict:
        out = self.stats.triton(self.name) | {"queue_depth": len(self.queue), "instances": 1,
                                              "memory": {"resident_bytes": self.resident_bytes,
                                                         "measured_by": None}}
        c = self.counters
        index = self._index
        out.update({
            "mode": self._mode(),
            "answers": {"extractive": c["extractive"], "generated": c["generated"]},
            "routes": dict(self.routes),
            "fallbacks": dict(self.fallbacks),
            "retrieval": {"mode": self.fusion.mode, "fusion": self.fusion.method,
                          "dense_weight": self.fusion.dense_weight, "sentence_weight": self.fusion.sentence_weight,
                          "lexical_weight": self.fusion.lexical_weight, "rrf_k": self.fusion.rrf_k,
                          "coverage_exponent": self.fusion.coverage_exponent,
                          "heading_weight": self.fusion.heading_weight,
                          "sentence_vectors": bool(index is not None and index.sentences is not None),
                          "heading_vectors": bool(index is not None and index.headings is not None),
                          "correct_spelling": self._speller is not None,
                          "questions_corrected": c["questions_corrected"]},
            "passages_returned": c["passages_returned"],
            # extractive answers' sentences: their vectors read from the index, or embedded (an index without them)
            "sentences_from_index": c["sentences_from_index"],
            "sentences_embedded": c["sentences_embedded"],
            "stage_ns": {"embed": c["embed_ns"], "search": c["search_ns"], "generate": c["generate_ns"],
                         "extract": c["extract_ns"]},
            "index": {"dir": str(self.index_dir), "passages": len(index) if index is not None else 0,
                      "version": index.meta.get("version") if index is not None else None,
                      "embedding_model": index.meta.get("embedding_model") if index is not None else None,
                      "reloads": c["index_reloads"], "problem": self._index_problem},
            "in_flight": len(self.queue),
        })
        if self.peer is not None:
            out["peer"] = self.peer.status()
        runner = self.runtime.runners.get(self.settings.embedding_model)
        if isinstance(runner, ModelRunner) and runner.engines[0].token_padding is not None:
            padding = runner.engines[0].token_padding()
            padding["padding_ratio_rows"] = runner.statistics().get("padding_ratio", 0.0)
            out["embedding"] = padding
        return out

    def _mode(self) -> str:
        parts = ([f"generator {self.settings.generator}"] if self.settings.generator else []) + \
                ([f"peer {self.peer.name}"] if self.peer is not None else [])
        return " + ".join(parts) if parts else "extractive"


def _sources(hits: list[Hit]) -> str:
    """The `sources` output of one answer: each passage's rank, id, title, scores and full text."""
    return json.dumps([{**h.to_json(), "text": h.passage.text} for h in hits], ensure_ascii=False)


async def _prepended(first, events: AsyncGenerator) -> AsyncIterator:
    """`first`, then the rest of `events` (closed when this is)."""
    async with aclosing(events):
        yield first
        async for event in events:
            yield event
