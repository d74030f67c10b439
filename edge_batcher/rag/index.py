"""The document index: passages (split from text and markdown files by passages.py), their
embeddings on disk, and cosine top-k search with numpy.

On disk, in the index directory::

    embeddings.npy    float32 [passages, dim], each row L2-normalised (cosine = dot product)
    passages.jsonl    one JSON object per line: {"id", "title", "text", "source"}
    lexical.json      the BM25 statistics: each passage's term counts (lexical.py)
    sentences.npz     "vectors" float32 [sentences, dim] (normalised) and "passage" int64 [sentences]:
                      every sentence of every passage, embedded under its heading (sentences.py)
    headings.npy      float32 [passages, dim], unit rows: each passage's own heading embedded alone
                      (a passage without a heading: its passage vector)
    meta.json         {"format", "version", "embedding_model", "dim", "count", "sources", "updated",
                       "lexical": {"analyzer"}, "sentences": count, "headings": count,
                       "sha256": {"embeddings.npy": ..., "passages.jsonl": ..., "lexical.json": ...,
                                  "sentences.npz": ..., "headings.npy": ...}}

Writing is atomic per file (written next to the target, fsynced, os.replace) and meta.json is
replaced last. A reader checks the hashes in meta.json against the data files, so it never
serves embeddings of one build with passages of another. Before the replacements each data file
is also hard-linked as `NAME.prev` (removed once the new meta.json is in place): a reader that
lands between them, or a daemon started after a crash or power loss there, finds the files the
old meta.json vouches for under that name and serves the previous build whole, instead of
finding the index torn for good.

The RAG service notices a rebuilt index by the (inode, size, mtime) of meta.json, one stat()
per query, and reloads it off the event loop.

Search ranks by the passage cosine, the best sentence's cosine and the heading's (dense), by
BM25 (lexical) or by all of them fused (fusion.py). An index written before lexical.json existed
gets its BM25 statistics computed when it is loaded; one written before sentences.npz or
headings.npy ranks without those signals until the next `index add`, which embeds what is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..durable import fsync_dir
from ..errors import StorageError, Unavailable
from .fusion import Fusion, fused_scores
from .lexical import ANALYZER, Bm25
from .passages import Passage
from .sentences import embed_text, heading, split_sentences

FORMAT = 1
EMBEDDINGS = "embeddings.npy"
PASSAGES = "passages.jsonl"
LEXICAL = "lexical.json"
SENTENCES = "sentences.npz"
HEADINGS = "headings.npy"
META = "meta.json"
DATA_FILES = (EMBEDDINGS, PASSAGES, LEXICAL, SENTENCES, HEADINGS)
PREVIOUS = ".prev"  # the previous build's file while a write replaces them (see the module docstring)


def default_index_dir(environ: dict[str, str] | None = None) -> Path:
    """$STATE_DIRECTORY/index under systemd (StateDirectory=), else ./state/index."""
    env = os.environ if environ is None else environ
    state = env.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(state) / "index" if state else Path("state") / "index"


@dataclass
class SentenceVectors:
    """The embedding of every sentence of the passages, and which passage each belongs to."""

    vectors: np.ndarray  # float32 [sentences, dim], unit rows
    passage: np.ndarray  # int64 [sentences]: index into the passages

    def select(self, keep: list[int]) -> SentenceVectors:
        """The sentences of passages `keep` (in that order), renumbered to their new positions."""
        keep_array = np.asarray(keep, dtype=np.int64)
        size = max(int(np.max(self.passage, initial=-1)), int(np.max(keep_array, initial=-1))) + 1
        position = np.full(size, -1, dtype=np.int64)
        position[keep_array] = np.arange(len(keep_array))
        new = position[self.passage]
        mask = new >= 0
        order = np.argsort(new[mask], kind="stable")
        return SentenceVectors(self.vectors[mask][order], new[mask][order])

    def after(self, other: SentenceVectors, offset: int) -> SentenceVectors:
        """These sentences followed by `other`'s, whose passages start at `offset`."""
        parts = [(s.vectors, s.passage + shift) for s, shift in ((self, 0), (other, offset)) if len(s.passage)]
        if not parts:
            return SentenceVectors(np.zeros((0, 0), np.float32), np.zeros(0, np.int64))
        return SentenceVectors(np.concatenate([v for v, _ in parts]).astype(np.float32),
                               np.concatenate([p for _, p in parts]).astype(np.int64))


def sentence_texts(passages: list[Passage]) -> tuple[list[int], list[str]]:
    """(passage index, text to embed) of every sentence of the passages."""
    owners, texts = [], []
    for i, p in enumerate(passages):
        for sentence in split_sentences(p.text):
            owners.append(i)
            texts.append(embed_text(p.title, sentence))
    return owners, texts


def heading_texts(passages: list[Passage]) -> tuple[list[str], list[int]]:
    """The distinct headings of the passages, and for each passage the position of its heading
    among them (-1: the passage has none)."""
    distinct: dict[str, int] = {}
    where = []
    for p in passages:
        h = heading(p.title).strip()
        where.append(distinct.setdefault(h, len(distinct)) if h else -1)
    return list(distinct), where


def embed_passages(passages: list[Passage], embed) -> tuple[np.ndarray, SentenceVectors, np.ndarray]:
    """The passages' embeddings, their sentences' and their headings' (headings_of()), with
    `embed` (texts -> unit rows), in one call of `embed`."""
    owners, texts = sentence_texts(passages)
    headings, where = heading_texts(passages)
    if not passages:
        empty = np.zeros((0, 0), np.float32)
        return empty, SentenceVectors(empty, np.zeros(0, np.int64)), empty
    vectors = np.asarray(embed([p.embed_text() for p in passages] + texts + headings), dtype=np.float32)
    n, m = len(passages), len(passages) + len(texts)
    sentences = SentenceVectors(vectors[n:m], np.asarray(owners, dtype=np.int64))
    return vectors[:n], sentences, headings_of(vectors[:n], vectors[m:], where)


def embed_headings(passages: list[Passage], passage_vectors: np.ndarray, embed) -> np.ndarray:
    """The passages' heading vectors alone (for an index written before them)."""
    headings, where = heading_texts(passages)
    vectors = np.asarray(embed(headings), dtype=np.float32) if headings else np.zeros((0, 0), np.float32)
    return headings_of(passage_vectors, vectors, where)


def headings_of(passage_vectors: np.ndarray, heading_vectors: np.ndarray, where: list[int]) -> np.ndarray:
    """[passages, dim]: each passage's heading vector (heading_texts()), its own vector where it has no heading."""
    out = np.array(passage_vectors, dtype=np.float32, copy=True)
    for i, h in enumerate(where):
        if h >= 0:
            out[i] = heading_vectors[h]
    return out


# --------------------------------------------------------------------------- the index


@dataclass
class Hit:
    passage: Passage
    score: float  # cosine similarity of the passage to the question (what [rag] min_score compares)
    rank: int
    lexical: float | None = None  # BM25 score, when the lexical ranking took part
    fused: float | None = None  # the fused score it was ranked by (fusion.py)
    sentence: float | None = None  # cosine of its best sentence, when the index has sentence vectors
    heading: float | None = None  # cosine of its heading alone, when the index has heading vectors
    margin: float | None = None  # first hit only: its lead over the second in fused score (lead())
    ambiguous: bool | None = None  # first hit only: margin below the fusion's ambiguous_margin
    # The index's vectors of the passage's sentences, in split order (None: the index has none):
    # extractive answers rank these instead of embedding the sentences again.
    sentence_vectors: np.ndarray | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        out = {"rank": self.rank, "id": self.passage.id, "title": self.passage.title,
               "score": round(self.score, 4), "source": Path(self.passage.source).name if self.passage.source else ""}
        if self.lexical is not None:
            out["bm25"] = round(self.lexical, 4)
        if self.sentence is not None:
            out["sentence"] = round(self.sentence, 4)
        if self.heading is not None:
            out["heading"] = round(self.heading, 4)
        if self.fused is not None:
            out["fused"] = round(self.fused, 6)
        if self.margin is not None:
            out["margin"] = round(self.margin, 4)
        if self.ambiguous is not None:
            out["ambiguous"] = self.ambiguous
        return out


class Index:
    """Passages, their unit-length embeddings, their sentences' and headings', and their BM25
    statistics, in memory."""

    def __init__(self, passages: list[Passage], embeddings: np.ndarray, meta: dict, lexical: Bm25 | None = None,
                 sentences: SentenceVectors | None = None, headings: np.ndarray | None = None):
        if embeddings.ndim != 2 or len(passages) != embeddings.shape[0]:
            raise ValueError(f"{len(passages)} passages but embeddings of shape {list(embeddings.shape)}")
        self.passages = passages
        self.embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
        self.meta = meta
        self.lexical = lexical if lexical is not None else Bm25.from_texts([p.embed_text() for p in passages])
        if len(self.lexical) != len(passages):
            raise ValueError(f"{len(passages)} passages but BM25 statistics of {len(self.lexical)}")
        if sentences is not None and len(sentences.passage) and (
                sentences.vectors.shape != (len(sentences.passage), self.dim)
                or int(sentences.passage.max()) >= len(passages) or int(sentences.passage.min()) < 0):
            raise ValueError(f"sentence vectors of shape {list(sentences.vectors.shape)} do not fit "
                             f"{len(passages)} passages of dimension {self.dim}")
        self.sentences = sentences
        # passage i's sentence rows, in stored (split) order: _sentence_order[bounds[i]:bounds[i + 1]]
        self._sentence_order: np.ndarray | None = None
        self._sentence_bounds: np.ndarray | None = None
        if sentences is not None and len(sentences.passage):
            self._sentence_order = np.argsort(sentences.passage, kind="stable")
            self._sentence_bounds = np.searchsorted(sentences.passage[self._sentence_order],
                                                    np.arange(len(passages) + 1))
        if headings is not None:
            headings = np.ascontiguousarray(headings, dtype=np.float32)
            if headings.shape != self.embeddings.shape:
                raise ValueError(f"heading vectors of shape {list(headings.shape)} do not fit "
                                 f"{len(passages)} passages of dimension {self.dim}")
        self.headings = headings

    @property
    def dim(self) -> int:
        return int(self.embeddings.shape[1])

    def __len__(self) -> int:
        return len(self.passages)

    def sentence_vectors_of(self, passage: int) -> np.ndarray | None:
        """The vectors of passage `passage`'s sentences, in split order; None without sentence vectors."""
        sentences, order, bounds = self.sentences, self._sentence_order, self._sentence_bounds
        if sentences is None or order is None or bounds is None:
            return None
        return sentences.vectors[order[bounds[passage]:bounds[passage + 1]]]

    def search(self, queries: np.ndarray, k: int) -> list[list[Hit]]:
        """Cosine top-k for each query row (queries need not be normalised). Best first."""
        queries = np.asarray(queries, dtype=np.float32).reshape(-1, self.dim)
        norms = np.linalg.norm(queries, axis=1, keepdims=True)
        queries = queries / np.maximum(norms, 1e-12)
        k = min(k, len(self.passages))
        if k <= 0:
            return [[] for _ in range(len(queries))]
        scores = queries @ self.embeddings.T  # [queries, passages]
        out = []
        for row in scores:
            top = np.argpartition(-row, k - 1)[:k] if k < len(row) else np.arange(len(row))
            top = top[np.argsort(-row[top], kind="stable")]
            out.append([Hit(self.passages[i], float(row[i]), r + 1, sentence_vectors=self.sentence_vectors_of(i))
                        for r, i in enumerate(top)])
        return out

    def best_sentence(self, dense_rows: np.ndarray, queries: np.ndarray) -> np.ndarray | None:
        """[queries, passages]: the cosine of each passage's best sentence (its passage cosine
        where it has none); None without sentence vectors."""
        if self.sentences is None:
            return None
        best = np.full(dense_rows.shape, -np.inf, dtype=np.float32)
        for row, query in zip(best, queries):
            np.maximum.at(row, self.sentences.passage, self.sentences.vectors @ query)
        return np.where(np.isfinite(best), best, dense_rows)

    def search_fused(self, queries: np.ndarray, texts: list[str], k: int, fusion: Fusion) -> list[list[Hit]]:
        """Top-k for each question by `fusion` of its passage cosines, best-sentence cosines (query
        vectors) and BM25 scores (question texts). Best first. Every passage and sentence is
        scored: O(passages + sentences) per question."""
        if fusion.mode == "dense" and (self.sentences is None or fusion.sentence_weight <= 0) and (
                self.headings is None or fusion.heading_weight <= 0):
            return self.search(queries, k)
        queries = np.asarray(queries, dtype=np.float32).reshape(-1, self.dim)
        if len(texts) != len(queries):
            raise ValueError(f"{len(texts)} question texts for {len(queries)} query vectors")
        queries = queries / np.maximum(np.linalg.norm(queries, axis=1, keepdims=True), 1e-12)
        k = min(k, len(self.passages))
        dense_rows = queries @ self.embeddings.T
        sentence_rows = self.best_sentence(dense_rows, queries) if fusion.mode != "lexical" else None
        heading_rows = queries @ self.headings.T if self.headings is not None and fusion.mode != "lexical" else None
        out = []
        for n, (dense, text) in enumerate(zip(dense_rows, texts)):
            lexical = self.lexical.scores(text)
            sentence = sentence_rows[n] if sentence_rows is not None else None
            heading_row = heading_rows[n] if heading_rows is not None else None
            coverage = self.lexical.coverage(text) if fusion.coverage_exponent > 0 else 1.0
            fused = fused_scores(dense, lexical, fusion, sentence, coverage, heading_row)
            order = np.argsort(-fused, kind="stable")
            row = [Hit(self.passages[i], float(dense[i]), r + 1, float(lexical[i]),
                       float(fused[i]) if fusion.mode != "lexical" else None,
                       float(sentence[i]) if sentence is not None else None,
                       heading=float(heading_row[i]) if heading_row is not None else None,
                       sentence_vectors=self.sentence_vectors_of(i))
                   for r, i in enumerate(order[:k])]
            if row and fusion.mode != "lexical":
                row[0].margin = lead(fused, order)
                row[0].ambiguous = row[0].margin < fusion.ambiguous_margin
            out.append(row)
        return out


def on_topic(hits: list[Hit], min_score: float) -> list[Hit]:
    """The hits, or none when not one of them reaches min_score in passage cosine: the question
    is about nothing in the index. The fused order is kept as it is: a passage ranked first for
    one sentence that answers, or for the question's words, stays first though its whole
    passage's vector is further from the question than min_score."""
    return hits if any(h.score >= min_score for h in hits) else []


def lead(fused: np.ndarray, order: np.ndarray) -> float:
    """How far the first passage is ahead of the second, as a share of the first's fused score
    (1: alone; near 0: a toss-up between the two)."""
    if len(order) < 2 or fused[order[0]] <= 0:
        return 1.0
    return float((fused[order[0]] - fused[order[1]]) / fused[order[0]])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_meta(directory: Path) -> dict | None:
    try:
        return json.loads((directory / META).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise Unavailable(f"index {directory}: {META} cannot be read: {exc}") from None


def load_index(directory: Path) -> Index | None:
    """The index in `directory`, or None when none was built there. Raises Unavailable when the
    files do not belong together (a rebuild is being swapped in right now, or files were damaged)."""
    meta = read_meta(directory)
    if meta is None:
        return None
    if meta.get("format") != FORMAT:
        raise Unavailable(
            f"index {directory}: format {meta.get('format')!r}, this edge-batcher reads {FORMAT}; rebuild it"
        )
    hashes = meta.get("sha256", {})
    lexical = None
    try:
        files: dict[str, Path] = {}
        for name in (EMBEDDINGS, PASSAGES, LEXICAL, SENTENCES, HEADINGS):
            if name in (LEXICAL, SENTENCES, HEADINGS) and name not in hashes:
                continue  # written before that file existed: computed below, or done without
            files[name] = _vouched_for(directory, name, hashes.get(name))
        embeddings = np.load(files[EMBEDDINGS], allow_pickle=False)
        with open(files[PASSAGES], encoding="utf-8") as fh:
            passages = [Passage(**json.loads(line)) for line in fh if line.strip()]
        if LEXICAL in files:
            stored = json.loads(files[LEXICAL].read_text(encoding="utf-8"))
            if stored.get("analyzer") == ANALYZER:  # else: re-analysed by Index with today's analyzer
                lexical = Bm25.from_json(stored)
        sentences = None
        if SENTENCES in files:
            with np.load(files[SENTENCES], allow_pickle=False) as stored:
                sentences = SentenceVectors(stored["vectors"].astype(np.float32), stored["passage"].astype(np.int64))
        headings = np.load(files[HEADINGS], allow_pickle=False) if HEADINGS in files else None
    except FileNotFoundError as exc:
        raise Unavailable(f"index {directory}: {exc.filename} is missing; rebuild the index") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise Unavailable(
            f"index {directory}: {LEXICAL}, {SENTENCES} or {HEADINGS} cannot be read: {exc}; rebuild it "
            f"(edge-batcher index add --rebuild)"
        ) from None
    try:
        return Index(passages, embeddings, meta, lexical, sentences, headings)
    except ValueError as exc:
        raise Unavailable(f"index {directory}: {exc}") from None


def _vouched_for(directory: Path, name: str, digest: str | None) -> Path:
    """The file `name` whose content meta.json vouches for: the current one, or the previous
    build's (`NAME.prev`) while a write is between its replacements or was cut off there."""
    path = directory / name
    previous = directory / (name + PREVIOUS)
    try:
        if _sha256(path) == digest:
            return path
    except FileNotFoundError:
        if not previous.exists():
            raise
    if previous.exists() and _sha256(previous) == digest:
        return previous
    raise Unavailable(f"index {directory}: {name} does not match {META} (a rebuild in progress?)")


def write_index(directory: Path, passages: list[Passage], embeddings: np.ndarray, *, embedding_model: str,
                sources: dict[str, dict] | None = None, sentences: SentenceVectors | None = None,
                headings: np.ndarray | None = None) -> dict:
    """Replace the index in `directory` (created if needed); returns the new meta. Without
    `sentences` (`headings`) no sentence (heading) vectors are written, and search does without them.
    A file system that fails the write (full, read-only) raises StorageError (StorageFull), the
    index as it was: every file is staged before any is replaced."""
    try:
        return _write_index(directory, passages, embeddings, embedding_model=embedding_model, sources=sources,
                            sentences=sentences, headings=headings)
    except OSError as exc:
        raise not_written(directory, exc) from exc


def not_written(directory: Path, exc: OSError) -> StorageError:
    """The error for an index its file system would not let be written: StorageFull (507) for
    want of room, else StorageError."""
    return StorageError.of(f"could not write the index in {directory}", exc, "the index is as it was")


def _write_index(directory: Path, passages: list[Passage], embeddings: np.ndarray, *, embedding_model: str,
                 sources: dict[str, dict] | None, sentences: SentenceVectors | None,
                 headings: np.ndarray | None) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    embeddings = np.ascontiguousarray(embeddings, dtype=np.float32)
    if embeddings.shape[0] != len(passages):
        raise ValueError(f"{len(passages)} passages but {embeddings.shape[0]} embeddings")
    previous = read_meta(directory) or {}
    lexical = Bm25.from_texts([p.embed_text() for p in passages])
    staged: dict[str, Path] = {}
    try:
        staged[EMBEDDINGS] = _stage(directory, EMBEDDINGS, lambda fh: np.save(fh, embeddings, allow_pickle=False))
        staged[PASSAGES] = _stage(directory, PASSAGES, lambda fh: fh.write(
            "".join(json.dumps(asdict(p), ensure_ascii=False) + "\n" for p in passages).encode("utf-8")))
        staged[LEXICAL] = _stage(directory, LEXICAL, lambda fh: fh.write(
            json.dumps(lexical.to_json(), ensure_ascii=False).encode("utf-8")))
        if sentences is not None:
            staged[SENTENCES] = _stage(directory, SENTENCES, lambda fh: np.savez(
                fh, vectors=np.asarray(sentences.vectors, dtype=np.float32),
                passage=np.asarray(sentences.passage, dtype=np.int64)))
        if headings is not None:
            heading_rows = np.ascontiguousarray(headings, dtype=np.float32)
            if heading_rows.shape[0] != len(passages):
                raise ValueError(f"{len(passages)} passages but {heading_rows.shape[0]} heading vectors")
            staged[HEADINGS] = _stage(directory, HEADINGS, lambda fh: np.save(fh, heading_rows, allow_pickle=False))
        meta = {
            "format": FORMAT,
            "version": int(previous.get("version", 0)) + 1,
            "embedding_model": embedding_model,
            "dim": int(embeddings.shape[1]) if embeddings.ndim == 2 else 0,
            "count": len(passages),
            "sources": sources or {},
            "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "lexical": {"analyzer": ANALYZER, "k1": lexical.k1, "b": lexical.b},
            "sentences": len(sentences.passage) if sentences is not None else 0,
            "headings": len(headings) if headings is not None else 0,
            "sha256": {name: _sha256(path) for name, path in staged.items()},
        }
        staged[META] = _stage(directory, META, lambda fh: fh.write(json.dumps(meta, indent=2).encode()))
        _keep_previous(directory, previous.get("sha256", {}))
        for name in (EMBEDDINGS, PASSAGES, LEXICAL, SENTENCES, HEADINGS, META):  # meta last: it vouches for the others
            if name in staged:
                os.replace(staged.pop(name), directory / name)
        fsync_dir(directory)  # the new meta.json is in place for good before the old build goes
        for name in DATA_FILES:
            (directory / (name + PREVIOUS)).unlink(missing_ok=True)
        for name, given in ((SENTENCES, sentences), (HEADINGS, headings)):
            if given is None:
                (directory / name).unlink(missing_ok=True)  # stale: the new meta.json does not vouch for it
    finally:
        for path in staged.values():
            path.unlink(missing_ok=True)
    fsync_dir(directory)
    return meta


def _keep_previous(directory: Path, hashes: dict) -> None:
    """Make each NAME.prev the file the current meta.json (`hashes`) vouches for, hard-linked,
    so that it stays findable until the new meta.json is in place. After a write cut off between
    its replacements that is the .prev left then, not the current file (a newer build's)."""
    for name in DATA_FILES:
        current, previous = directory / name, directory / (name + PREVIOUS)
        digest = hashes.get(name)
        if previous.exists() and digest is not None and _sha256(previous) == digest:
            continue  # already the one vouched for
        if not current.exists():
            previous.unlink(missing_ok=True)
            continue
        link = directory / f".{name}{PREVIOUS}.{os.getpid()}"
        link.unlink(missing_ok=True)
        try:
            os.link(current, link)
        except OSError:  # a file system without hard links: a copy does the same, slower
            shutil.copyfile(current, link)
        os.replace(link, previous)
    fsync_dir(directory)


def remove_leftovers(directory: Path) -> int:
    """Remove what a writer that stopped midway (killed, the power lost) left in `directory`: its
    staged files (`.NAME.XXXXXXXX`) and links (`.NAME.prev.PID`), which nothing else would ever
    remove, and which take the room of a whole index on a small device. Only while no other
    writer is at work (index_update.one_writer). Returns the bytes freed."""
    freed = 0
    for path in directory.glob(".*"):
        if any(path.name.startswith(f".{name}.") for name in (*DATA_FILES, META)) and path.is_file():
            try:
                size = path.stat().st_size
                path.unlink()
            except OSError:  # gone already, or a read-only file system: the write says so next
                continue
            freed += size
    return freed


def _stage(directory: Path, name: str, write) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    # mkstemp's 0600 would keep the index from the service's user when root writes it (issue 32:
    # "meta.json cannot be read: Permission denied", then 503 for every question): the mode an
    # ordinary file gets under the umask instead.
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fd, 0o666 & ~_UMASK)
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:  # a full disk: what was written of it must not keep the room
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def _current_umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it: put it back at once
    os.umask(mask)
    return mask


_UMASK = _current_umask()  # read once, at import: before any thread could create files meanwhile



class IndexWatcher:
    """Tells whether meta.json was replaced since the last look (one stat() call)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._seen: tuple | None = None

    def signature(self) -> tuple | None:
        try:
            st = os.stat(self.directory / META)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def changed(self) -> bool:
        return self.signature() != self._seen

    def mark(self, signature: tuple | None) -> None:
        self._seen = signature
