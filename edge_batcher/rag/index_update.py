"""Adding documents to a document index and removing them: one implementation for the CLI, which
embeds with a model of its own (index_cli.py), and for the running daemon, which embeds with the
model it serves and writes its own index (pipeline.py, `POST /v2/models/{rag}/index`).

A document is a source name and its text, split like a file of that name (markdown for .md and
.markdown, plain text otherwise); adding a source again replaces its passages. `embed(texts)`
returns the texts' vectors; it is called for the new passages, their sentences and headings (and
for the kept passages' sentences and headings of an index written before sentence or heading
vectors). Blocking: files and
embedding; the daemon runs it off the event loop. Writers take turns (one_writer): each reads
the index, adds or removes, and writes it back, so two at once would lose one's change; new
passages are embedded before the turn.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from .index import (
    SentenceVectors,
    embed_headings,
    embed_passages,
    load_index,
    not_written,
    read_meta,
    remove_leftovers,
    write_index,
)
from .passages import Passage, split_markdown, split_text

log = logging.getLogger(__name__)

MiB = 1 << 20
Embed = Callable[[list[str]], np.ndarray]
MARKDOWN_SUFFIXES = (".md", ".markdown")


@dataclass(frozen=True)
class Document:
    source: str  # where it came from: a file's resolved path, or the name an API client gave
    text: str


def split_document(document: Document, max_chars: int) -> list[Passage]:
    """Passages of one document, split as a file of its source's name would be."""
    if max_chars < 1:
        raise ConfigError(f"the longest passage must be at least 1 character, got {max_chars}")
    stem = Path(document.source).stem or "document"
    if Path(document.source).suffix.lower() in MARKDOWN_SUFFIXES:
        return split_markdown(document.text, stem, max_chars, document.source)
    return split_text(document.text, stem, max_chars, document.source)


@contextmanager
def one_writer(index_dir: Path, waiting: Callable[[str], None] | None = None) -> Iterator[None]:
    """The index directory to this writer alone, from reading the index to writing it: another
    writer (an `index add`, the daemon's API, a second rag model on the same index) reading it
    meanwhile would write its own change over this one, which would be lost. An advisory lock
    (flock) on the directory itself: nothing to clean up, released when a writer dies.
    `waiting(why)` is told when another writer holds it; this one then waits its turn."""
    try:
        index_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(index_dir, os.O_RDONLY)
    except OSError as exc:
        raise not_written(index_dir, exc) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            why = f"another writer of index {index_dir} is at work (an `index add`, or the daemon): waiting for it"
            (waiting or log.info)(why)
            fcntl.flock(fd, fcntl.LOCK_EX)
        freed = remove_leftovers(index_dir)
        if freed:
            log.info("index %s: removed %.1f MiB of files a writer that stopped midway left", index_dir, freed / MiB)
        yield
    finally:
        os.close(fd)  # the lock goes with it


def add_documents(index_dir: Path, documents: list[Document], embed: Embed, *, embedding_model: str, dim: int,
                  max_chars: int, rebuild: bool = False, waiting: Callable[[str], None] | None = None
                  ) -> dict[str, Any]:
    """Split, embed and add `documents` (replacing earlier versions of the same sources); write the
    index. The new passages are embedded first (the long part: minutes for a manual), then, in
    the writers' turn (one_writer), the index is read, merged with them and written, so another
    writer waits for a write, not for an embedding. Returns {"added", "replaced", "count",
    "version", "empty"}: "empty" names documents with no text to index."""
    if not rebuild:  # before minutes of embedding for an index that cannot take them
        _check_model(read_meta(index_dir) or {}, index_dir, embedding_model)
    new: list[Passage] = []
    empty = []
    counts: dict[str, int] = {}  # passages per source (a source given twice: both copies')
    for document in documents:
        parts = split_document(document, max_chars)
        if not parts:
            empty.append(document.source)
        new.extend(parts)
        counts[document.source] = counts.get(document.source, 0) + len(parts)
    vectors, new_sentences, new_headings = embed_passages(new, embed)
    vectors = vectors.reshape(len(new), dim)
    new_headings = new_headings.reshape(len(new), dim)
    with one_writer(index_dir, waiting):
        passages, embeddings, meta, sentences, headings = _current(index_dir, rebuild)
        _check_model(meta, index_dir, embedding_model)
        sources = dict(meta.get("sources", {}))
        added = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        sources.update({source: {"passages": n, "added": added} for source, n in counts.items()})
        keep = [i for i, p in enumerate(passages) if p.source not in counts]
        kept = embeddings[keep].reshape(-1, dim) if len(keep) else np.zeros((0, dim), np.float32)
        kept_passages = [passages[i] for i in keep]
        again = None
        if sentences is None:  # an index written before sentence vectors: embed the kept passages' too
            _, keep_sentences, again = embed_passages(kept_passages, embed)
        else:
            keep_sentences = sentences.select(keep)
        if headings is not None:
            keep_headings = headings[keep].reshape(-1, dim)
        elif again is not None:
            keep_headings = again.reshape(len(keep), dim)
        else:  # written before heading vectors: only the kept passages' headings are missing
            keep_headings = embed_headings(kept_passages, kept, embed).reshape(len(keep), dim)
        used = {p.id for p in kept_passages}  # ids stay unique: a later clashing id gets a suffix
        for p in new:
            base, n = p.id, 2
            while p.id in used:
                p.id = f"{base}~{n}"
                n += 1
            used.add(p.id)
        written = write_index(index_dir, kept_passages + new, np.concatenate([kept, vectors], axis=0),
                              embedding_model=embedding_model, sources=sources,
                              sentences=keep_sentences.after(new_sentences, len(keep)),
                              headings=np.concatenate([keep_headings, new_headings], axis=0))
    return {"added": len(new), "replaced": len(passages) - len(keep), "count": written["count"],
            "version": written["version"], "empty": empty}


def _check_model(meta: dict, index_dir: Path, embedding_model: str) -> None:
    if meta and meta.get("embedding_model") != embedding_model:
        raise ConfigError(f"index {index_dir} was built with embedding model {meta.get('embedding_model')!r}, not "
                          f"{embedding_model!r}: rebuild it to re-embed everything with {embedding_model!r}")


def remove_documents(index_dir: Path, sources: set[str], waiting: Callable[[str], None] | None = None
                     ) -> dict[str, Any] | None:
    """Remove the passages of `sources`; write the index, one writer at a time. None when there
    is no index."""
    if not index_dir.is_dir():
        return None
    with one_writer(index_dir, waiting):
        return _remove(index_dir, sources)


def _remove(index_dir: Path, sources: set[str]) -> dict[str, Any] | None:
    passages, embeddings, meta, sentences, headings = _current(index_dir, rebuild=False)
    if not meta:
        return None
    keep = [i for i, p in enumerate(passages) if p.source not in sources]
    kept_sources = {k: v for k, v in meta.get("sources", {}).items() if k not in sources}
    written = write_index(index_dir, [passages[i] for i in keep], embeddings[keep].reshape(len(keep), -1)
                          if keep else embeddings[:0], embedding_model=meta["embedding_model"], sources=kept_sources,
                          sentences=sentences.select(keep) if sentences is not None else None,
                          headings=headings[keep] if headings is not None else None)
    return {"removed": len(passages) - len(keep), "count": written["count"], "version": written["version"],
            "unknown": sorted(sources - set(meta.get("sources", {})))}


def _current(index_dir: Path, rebuild: bool) -> tuple[list[Passage], np.ndarray, dict, SentenceVectors | None,
                                                     np.ndarray | None]:
    index = None if rebuild else load_index(index_dir)
    if index is None:
        return [], np.zeros((0, 0), dtype=np.float32), {}, None, None
    return list(index.passages), index.embeddings, index.meta, index.sentences, index.headings
