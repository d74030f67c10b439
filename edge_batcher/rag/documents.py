"""A rag model's documents managed by the running daemon: added and removed over the API
(`POST /v2/models/{rag}/index`, transports/http_index.py; `edge-batcher index add --url`), so that
the service writes its own index, as its own user, with the embedding model it serves.

The texts are split as `edge-batcher index add` splits files (index_update.py) and embedded by
the embedding model's first engine instance on its own thread, a chunk at a time: the batches it
serves meanwhile go between the chunks, so questions keep being answered while a manual is
indexed. One change at a time; the rag model loads the new index before the call returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Any

import numpy as np

from ..errors import InvalidInput, StorageError, Unavailable
from ..scheduler.runner import ModelRunner
from .index import read_meta
from .index_update import Document, add_documents, remove_documents
from .passages import DEFAULT_MAX_CHARS

log = logging.getLogger(__name__)

EMBED_CHUNK = 32  # texts per turn on the embedding model's thread: served batches run between turns


class Documents:
    def __init__(self, service: Any):
        self.service = service  # rag/pipeline.py's RagService
        self._lock = asyncio.Lock()

    async def add(self, documents: list[Document], rebuild: bool = False) -> dict[str, Any]:
        runner = self._embedder()
        engine: Any = runner.engines[0]  # a TextEmbeddingEngine (rag/embed.py)
        max_chars = min(DEFAULT_MAX_CHARS, engine.tokenizer.max_chars)
        t0 = time.perf_counter()
        async with self._lock:
            try:
                summary = await asyncio.get_running_loop().run_in_executor(None, partial(
                    add_documents, self.service.index_dir, documents, partial(_embed_in_turns, runner),
                    embedding_model=self.service.settings.embedding_model, dim=engine.dim, max_chars=max_chars,
                    rebuild=rebuild))
            except StorageError as exc:  # the device's state, not a bug: said in the log, no traceback
                log.warning("model %s: %d document(s) not added: %s", self.service.name, len(documents), exc)
                raise
        await self.service.reload_index()
        log.info("model %s: %d passages from %d document(s) added through the API (replacing %d) in %.1f s; "
                 "the index holds %d, version %d", self.service.name, summary["added"], len(documents),
                 summary["replaced"], time.perf_counter() - t0, summary["count"], summary["version"])
        return summary

    async def remove(self, sources: list[str]) -> dict[str, Any]:
        async with self._lock:
            try:
                summary = await asyncio.get_running_loop().run_in_executor(
                    None, remove_documents, self.service.index_dir, set(sources))
            except StorageError as exc:
                log.warning("model %s: %d source(s) not removed: %s", self.service.name, len(sources), exc)
                raise
        if summary is None:
            raise InvalidInput(f"model {self.service.name!r} has no document index yet: add documents first")
        await self.service.reload_index()
        log.info("model %s: %d passages of %d source(s) removed through the API", self.service.name,
                 summary["removed"], len(sources))
        return summary

    def info(self) -> dict[str, Any]:
        meta = read_meta(self.service.index_dir) or {}
        return {"dir": str(self.service.index_dir), "count": meta.get("count", 0), "version": meta.get("version", 0),
                "embedding_model": meta.get("embedding_model", self.service.settings.embedding_model),
                "sources": meta.get("sources", {}), "updated": meta.get("updated")}

    def _embedder(self) -> ModelRunner:
        name = self.service.settings.embedding_model
        runner = self.service.runtime.runners.get(name)
        if not isinstance(runner, ModelRunner) or not hasattr(runner.engines[0], "embed"):
            raise Unavailable(f"model {self.service.name!r}: its embedding model {name!r} is not loaded here")
        return runner


def _embed_in_turns(runner: ModelRunner, texts: list[str]) -> np.ndarray:
    """Blocking, on an executor thread: the texts' vectors from the embedding model's first
    instance, EMBED_CHUNK at a time on its own thread (the batches it serves go between)."""
    engine: Any = runner.engines[0]
    parts = [runner.on_instance(0, engine.embed, texts[i:i + EMBED_CHUNK]) for i in range(0, len(texts), EMBED_CHUNK)]
    return np.concatenate(parts) if parts else np.zeros((0, engine.dim), np.float32)
