"""RagService: questions answered from the local document index.

    question -> embedding (the embedding model, through the core scheduler: batched and
    length-bucketed with every other embedding request) -> cosine top-k over the index ->
    prompt assembly -> the generator service (continuous batching) -> answer + sources

Without a generator (`[rag] generator = ""`) the answer is the retrieved passages themselves
(extractive mode). model.toml (backend = "rag")::

    [rag]
    embedding_model = "minilm"     # a text-embedding model of the repository
    index_dir = ""                 # "": $STATE_DIRECTORY/index under systemd, else ./state/index;
                                   # a relative path is relative to this model's directory
    top_k = 3
    min_score = 0.0                # passages scoring below are left out
    generator = ""                 # name of a backend = "generator" model; "": extractive
    prompt_template = "...{context}...{question}..."

v2 interface: input `question` BYTES [rows]; outputs `answer` BYTES [rows] and `sources` BYTES
[rows] (a JSON list per row: rank, id, title, score, source). Request parameters: `top_k`
(retrieval depth) and, with a generator, max_new_tokens, temperature, top_p, seed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from ..config import ModelConfig, backend_settings
from ..errors import ConfigError, InvalidInput, Unavailable
from ..types import InferRequest, InferResponse, TensorSpec
from .index import Hit, Index, IndexWatcher, default_index_dir, load_index
from .prompt import DEFAULT_PASSAGE_TEMPLATE, DEFAULT_TEMPLATE, assemble, check_template, extractive_answer
from .service import (
    FINAL, InFlight, ServiceAccounting, ServiceStats, bytes_array, final_response, text_rows, token_responses,
    wait_idle,
)

log = logging.getLogger(__name__)

QUESTION = "question"
ANSWER = "answer"
SOURCES = "sources"
GENERATION_PARAMETERS = ("max_new_tokens", "temperature", "top_p", "seed", "ignore_stop")


@dataclass
class RagSettings:
    embedding_model: str = "minilm"
    index_dir: str = ""
    top_k: int = 3
    max_top_k: int = 20
    min_score: float = 0.0
    generator: str = ""
    prompt_template: str = DEFAULT_TEMPLATE
    passage_template: str = DEFAULT_PASSAGE_TEMPLATE
    max_question_chars: int = 2000
    max_rows: int = 8
    max_new_tokens: int = 0  # 0: the generator's own default


def rag_settings(config: ModelConfig) -> RagSettings:
    s = backend_settings(config, "rag", RagSettings)
    where = f"{config.directory / 'model.toml'}: [rag]"
    if not 1 <= s.top_k <= s.max_top_k:
        raise ConfigError(f"{where} top_k: expected 1..max_top_k ({s.max_top_k}), got {s.top_k}")
    if s.max_rows <= 0 or s.max_question_chars <= 0:
        raise ConfigError(f"{where} max_rows and max_question_chars must be positive")
    if not s.embedding_model:
        raise ConfigError(f"{where} embedding_model: name the text-embedding model")
    check_template(s.prompt_template, where)
    return s


def index_dir_for(config: ModelConfig, settings: RagSettings | None = None) -> Path:
    """The rag model's index directory ([rag] index_dir, else the default)."""
    s = settings or rag_settings(config)
    if not s.index_dir:
        return default_index_dir()
    path = Path(s.index_dir)
    return path if path.is_absolute() else config.directory / path


class RagService(ServiceAccounting):
    def __init__(self, config: ModelConfig, runtime):
        self.config = config
        self.name = config.name
        self.runtime = runtime
        self.settings = rag_settings(config)
        self.index_dir = index_dir_for(config, self.settings)
        self.inputs = [TensorSpec(QUESTION, "BYTES", (-1,))]
        self.outputs = [TensorSpec(ANSWER, "BYTES", (-1,)), TensorSpec(SOURCES, "BYTES", (-1,))]
        self.queue = InFlight()
        self.stats = ServiceStats()
        self._index: Index | None = None
        self._index_problem: str | None = None
        self._watcher = IndexWatcher(self.index_dir)
        self._reload_lock: asyncio.Lock | None = None
        self._draining = False
        self._embedding_dim = 0
        self._max_rows = self.settings.max_rows
        self.counters = {"extractive": 0, "generated": 0, "index_reloads": 0, "embed_ns": 0, "search_ns": 0,
                         "generate_ns": 0, "passages_returned": 0}

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
        self._reload_lock = asyncio.Lock()
        try:
            await self._current_index()
        except Unavailable as exc:
            log.warning("model %s: %s", self.name, exc)  # served once the index is built
        else:
            log.info("model %s: index %s: %d passages (version %s), %s mode", self.name, self.index_dir,
                     len(self._index or ()), (self._index.meta.get("version") if self._index else None),
                     f"generator {s.generator!r}" if s.generator else "extractive")

    async def drain(self, timeout: float) -> None:
        self._draining = True
        await wait_idle(self.queue, timeout)

    async def close(self) -> None:
        self._draining = True
        self._index = None

    # ------------------------------------------------------------------ the index

    async def _current_index(self) -> Index:
        """The index, reloaded (off the loop) when meta.json was replaced since the last look."""
        assert self._reload_lock is not None
        if self._watcher.changed():
            async with self._reload_lock:
                if self._watcher.changed():
                    signature = self._watcher.signature()
                    try:
                        index = await asyncio.get_running_loop().run_in_executor(None, load_index, self.index_dir)
                    except Unavailable as exc:
                        if self._index is None:
                            raise
                        log.warning("model %s: keeping the loaded index: %s", self.name, exc)
                    else:
                        self._watcher.mark(signature)
                        self._set_index(index)
        if self._index is None:
            raise Unavailable(f"model {self.name!r}: no document index in {self.index_dir}: build it with "
                              "`edge-batcher index add FILES...`")
        if self._index_problem:
            raise Unavailable(f"model {self.name!r}: {self._index_problem}")
        return self._index

    def _set_index(self, index: Index | None) -> None:
        previous = self._index
        self._index = index
        self._index_problem = None
        if index is None:
            return
        meta = index.meta
        if meta.get("embedding_model") != self.settings.embedding_model:
            self._index_problem = (f"the index in {self.index_dir} was built with embedding model "
                                   f"{meta.get('embedding_model')!r}, this model uses {self.settings.embedding_model!r}: "
                                   f"rebuild it with `edge-batcher index add --embedding-model {self.settings.embedding_model} ...`")
        elif self._embedding_dim and index.dim != self._embedding_dim:
            self._index_problem = f"the index has {index.dim}-d embeddings, the embedding model gives {self._embedding_dim}-d"
        if previous is not None:
            self.counters["index_reloads"] += 1
            log.info("model %s: reloaded index %s: %d passages (version %s)", self.name, self.index_dir, len(index),
                     meta.get("version"))

    # ------------------------------------------------------------------ the pipeline

    def _parameters(self, parameters: dict) -> tuple[int, dict]:
        top_k = parameters.get("top_k", self.settings.top_k)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= self.settings.max_top_k:
            raise InvalidInput(f"parameters.top_k (passages to retrieve) must be an integer in 1..{self.settings.max_top_k}, "
                               f"got {top_k!r}")
        generation = {k: parameters[k] for k in GENERATION_PARAMETERS if k in parameters}
        if self.settings.max_new_tokens and "max_new_tokens" not in generation:
            generation["max_new_tokens"] = self.settings.max_new_tokens
        return top_k, generation

    def _questions(self, request: InferRequest, max_rows: int) -> list[str]:
        if self._draining:
            raise Unavailable(f"model {self.name!r} is not accepting requests: the daemon is draining")
        questions = text_rows(request, self.name, self.inputs[0], self.outputs, max_rows)
        for i, q in enumerate(questions):
            if len(q) > self.settings.max_question_chars:
                raise InvalidInput(f"input {QUESTION!r}: question {i} is {len(q)} characters, more than the "
                                   f"{self.settings.max_question_chars} model {self.name!r} takes")
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
        engines = getattr(runner, "engines", None)
        return getattr(engines[0], "tokenizer", None) if engines else None

    async def _retrieve(self, questions: list[str], top_k: int, request: InferRequest) -> list[list[Hit]]:
        index = await self._current_index()
        t0 = time.perf_counter()
        response = await self.runtime.infer(InferRequest(
            model=self.settings.embedding_model, inputs={"text": bytes_array(questions)},
            priority=request.priority, timeout_s=request.timeout_s))
        t1 = time.perf_counter()
        vectors = next(iter(response.outputs.values()))
        hits = [[h for h in row if h.score >= self.settings.min_score] for row in index.search(vectors, top_k)]
        self.counters["embed_ns"] += int((t1 - t0) * 1e9)
        self.counters["search_ns"] += int((time.perf_counter() - t1) * 1e9)
        self.counters["passages_returned"] += sum(len(h) for h in hits)
        return hits

    def _generator(self):
        name = self.settings.generator
        gen = self.runtime.runners.get(name)
        if gen is None or not hasattr(gen, "generate"):
            raise Unavailable(f"model {self.name!r}: [rag] generator {name!r} is not a loaded generator model")
        return gen

    def _prompt(self, gen, question: str, hits: list[Hit], generation: dict) -> tuple[str, list[Hit]]:
        max_new = generation.get("max_new_tokens", gen.settings.max_new_tokens)
        if isinstance(max_new, bool) or not isinstance(max_new, int):
            raise InvalidInput(f"parameters.max_new_tokens must be an integer, got {max_new!r}")
        limit = gen.settings.max_context
        s = self.settings
        prompt, used = assemble(s.prompt_template, s.passage_template, question, hits,
                                lambda p: gen.count_tokens(p) + max_new <= limit)
        gen.check_fits_context(gen.count_tokens(prompt), max_new)  # even without passages: a clear error
        return prompt, used

    async def _answer(self, question: str, hits: list[Hit], generation: dict, request: InferRequest) -> tuple[str, list[Hit], dict]:
        if not self.settings.generator:
            self.counters["extractive"] += 1
            return extractive_answer(hits), hits, {"mode": "extractive"}
        gen = self._generator()
        prompt, used = self._prompt(gen, question, hits, generation)
        t0 = time.perf_counter()
        result = await gen.generate(prompt, generation, timeout_s=request.timeout_s, apply_template=False)
        self.counters["generate_ns"] += int((time.perf_counter() - t0) * 1e9)
        self.counters["generated"] += 1
        return result.text, used, {"mode": "generated", **result.parameters()}

    async def infer(self, request: InferRequest) -> InferResponse:
        started = time.monotonic()
        self.queue.count += 1
        try:
            questions = self._questions(request, self._max_rows)
            top_k, generation = self._parameters(request.parameters)
            hits = await self._retrieve(questions, top_k, request)
            answers = await asyncio.gather(*(self._answer(q, h, generation, request) for q, h in zip(questions, hits)))
        except BaseException as exc:
            self._failed(started, exc)
            raise
        finally:
            self.queue.count -= 1
        self._ok(started, len(questions))
        outputs = {ANSWER: bytes_array([a for a, _, _ in answers]),
                   SOURCES: bytes_array([json.dumps([h.to_json() for h in used]) for _, used, _ in answers])}
        if request.outputs is not None:
            outputs = {k: v for k, v in outputs.items() if k in request.outputs}
        return InferResponse(self.name, request.id, outputs, answers[0][2] if len(answers) == 1 else {})

    async def stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """One question: a first chunk with the sources, then the answer in pieces as it is
        generated, the last chunk with triton_final_response=True (extractive: one chunk)."""
        started = time.monotonic()
        self.queue.count += 1
        try:
            questions = self._questions(request, 1)
            top_k, generation = self._parameters(request.parameters)
            hits = (await self._retrieve(questions, top_k, request))[0]
            if not self.settings.generator:
                self.counters["extractive"] += 1
                yield final_response(self.name, request.id, {
                    ANSWER: bytes_array([extractive_answer(hits)]),
                    SOURCES: bytes_array([json.dumps([h.to_json() for h in hits])])}, mode="extractive")
            else:
                gen = self._generator()
                prompt, used = self._prompt(gen, questions[0], hits, generation)
                seq = gen.submit(prompt, generation, timeout_s=request.timeout_s, apply_template=False)
                yield InferResponse(self.name, request.id, {
                    ANSWER: bytes_array([""]), SOURCES: bytes_array([json.dumps([h.to_json() for h in used])])},
                    {FINAL: False})
                t0 = time.perf_counter()
                async with aclosing(gen.events(seq)) as events:  # leaving early cancels the generation
                    async for chunk in token_responses(self.name, request.id, ANSWER, events, mode="generated"):
                        if chunk.parameters[FINAL]:
                            self.counters["generated"] += 1
                            self.counters["generate_ns"] += int((time.perf_counter() - t0) * 1e9)
                        yield chunk
        except BaseException as exc:
            self._failed(started, exc)
            raise
        finally:
            self.queue.count -= 1
        self._ok(started, 1)

    def statistics(self) -> dict:
        out = self.stats.triton(self.name)
        c = self.counters
        index = self._index
        out.update({
            "mode": f"generator {self.settings.generator}" if self.settings.generator else "extractive",
            "answers": {"extractive": c["extractive"], "generated": c["generated"]},
            "passages_returned": c["passages_returned"],
            "stage_ns": {"embed": c["embed_ns"], "search": c["search_ns"], "generate": c["generate_ns"]},
            "index": {"dir": str(self.index_dir), "passages": len(index) if index is not None else 0,
                      "version": index.meta.get("version") if index is not None else None,
                      "embedding_model": index.meta.get("embedding_model") if index is not None else None,
                      "reloads": c["index_reloads"], "problem": self._index_problem},
            "in_flight": len(self.queue),
        })
        runner = self.runtime.runners.get(self.settings.embedding_model)
        engines = getattr(runner, "engines", None)
        if engines and hasattr(engines[0], "token_padding"):
            padding = engines[0].token_padding()
            padding["padding_ratio_rows"] = runner.statistics().get("padding_ratio", 0.0)
            out["embedding"] = padding
        return out
