"""`edge-batcher index add | remove | list | info`: build and inspect the RAG document index.

    edge-batcher index add docs/corpus/*.md          # split, embed, write (re-adding a file replaces it)
    edge-batcher index remove docs/old-manual.md
    edge-batcher index list
    edge-batcher index info

Where things are found: the model repository is --model-repo, else the daemon config's
[models] repository (--config), else ./engines. When the repository has a rag model
(--rag-model, default "rag"), its [rag] index_dir and embedding_model are used; --index and
--embedding-model override them. Embedding runs here, in this process, with the same ONNX
model the daemon uses; a running daemon picks the rebuilt index up at its next question.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import load_config, load_model_config
from ..errors import ConfigError, EdgeBatcherError
from ..progress import Progress
from .index import (
    DEFAULT_MAX_CHARS,
    Passage,
    SentenceVectors,
    default_index_dir,
    embed_passages,
    load_index,
    read_meta,
    split_file,
    write_index,
)

if TYPE_CHECKING:
    import numpy as np  # imported where used: the CLI starts without it

PROGRESS_STEPS = 20  # embedding runs ~20 texts a second on the 2-core VM: a line every 5 % of it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="index_command", metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--index", type=Path, help="index directory (default: the rag model's [rag] index_dir, "
                                                  "else $STATE_DIRECTORY/index, else ./state/index)")
        p.add_argument("--model-repo", type=Path, help="model repository (default: from --config, else ./engines)")
        p.add_argument("--config", help="daemon config file whose [models] repository to use")
        p.add_argument("--rag-model", default="rag", help="the rag model whose [rag] settings apply (default: rag)")

    p = sub.add_parser("add", help="split files into passages, embed them and add them to the index")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help=".md or .txt files")
    common(p)
    p.add_argument("--embedding-model",
                   help="embedding model name in the repository (default: [rag] embedding_model, else minilm)")
    p.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS,
                   help=f"longest passage in characters (default {DEFAULT_MAX_CHARS}; at most what the embedding "
                        "model reads, its [tokenizer] max_chars)")
    p.add_argument("--rebuild", action="store_true", help="start from an empty index instead of adding to it")

    p = sub.add_parser("remove", help="remove the passages of files from the index")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE")
    common(p)
    p.add_argument("--embedding-model", help=argparse.SUPPRESS)

    p = sub.add_parser("list", help="list the passages")
    common(p)
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("info", help="show the index metadata")
    common(p)


class _NotThere(Exception):
    """A file or index the command needs does not exist: a usage error (exit 2) that says
    so plainly, not a "configuration error"."""


def run(args: argparse.Namespace) -> int:
    command = args.index_command
    try:
        if command == "add":
            missing = [str(f) for f in args.files if not f.is_file()]
            if missing:
                raise _NotThere(f"no such file: {', '.join(missing)} (nothing was indexed)")
        index_dir, embedding_model, repo = _locate(args)
        if command == "add":
            return _add(args, index_dir, embedding_model, repo)
        if command == "remove":
            return _remove(args, index_dir)
        if command == "list":
            return _list(args, index_dir)
        return _info(index_dir)
    except ConfigError:
        raise  # the CLI prints it as a configuration error (exit 2)
    except _NotThere as exc:
        print(f"edge-batcher index {command}: {exc}", file=sys.stderr)
        return 2
    except EdgeBatcherError as exc:
        print(f"edge-batcher index: {exc}", file=sys.stderr)
        return 1


def _locate(args: argparse.Namespace) -> tuple[Path, str, Path]:
    repo = args.model_repo or Path(load_config(args.config).models.repository)
    index_dir, embedding_model = None, None
    rag_dir = repo / args.rag_model
    if (rag_dir / "model.toml").is_file():
        from .settings import index_dir_for, rag_settings

        config = load_model_config(rag_dir)
        settings = rag_settings(config)
        index_dir, embedding_model = index_dir_for(config, settings), settings.embedding_model
    index_dir = args.index or index_dir or default_index_dir()
    embedding_model = getattr(args, "embedding_model", None) or embedding_model or "minilm"
    return index_dir, embedding_model, repo


def _current(index_dir: Path) -> tuple[list[Passage], np.ndarray, dict, SentenceVectors | None]:
    import numpy as np

    index = load_index(index_dir)
    if index is None:
        return [], np.zeros((0, 0), dtype=np.float32), {}, None
    return list(index.passages), index.embeddings, index.meta, index.sentences


def _add(args, index_dir: Path, embedding_model: str, repo: Path) -> int:
    import numpy as np

    from .embed import TextEmbeddingEngine

    t0 = time.perf_counter()
    passages, embeddings, meta, sentences = (([], np.zeros((0, 0), np.float32), {}, None) if args.rebuild
                                             else _current(index_dir))
    if meta and meta.get("embedding_model") != embedding_model:
        raise ConfigError(f"index {index_dir} was built with embedding model {meta.get('embedding_model')!r}, not "
                          f"{embedding_model!r}: add --rebuild to re-embed everything with {embedding_model!r}")
    new: list[Passage] = []
    sources = dict(meta.get("sources", {}))
    for path in args.files:
        if not path.is_file():
            raise _NotThere(f"no such file: {path} (nothing was indexed)")
        parts = split_file(path, args.max_chars)
        if not parts:
            print(f"{path}: no text to index", file=sys.stderr)
        new.extend(parts)
        sources[str(path.resolve())] = {"passages": len(parts),
                                        "added": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    replaced_sources = {p.source for p in new}
    keep = [i for i, p in enumerate(passages) if p.source not in replaced_sources]
    replaced = len(passages) - len(keep)
    config_dir = repo / embedding_model
    if not (config_dir / "model.toml").is_file():
        raise ConfigError(f"embedding model {embedding_model!r} not found in {repo} (build it with "
                          "tools/build_embedding_model.py --out <repo>)")
    engine = TextEmbeddingEngine(load_model_config(config_dir))
    engine.load()
    assert engine.tokenizer is not None
    if args.max_chars > engine.tokenizer.max_chars:
        engine.close()
        raise ConfigError(f"--max-chars {args.max_chars} is longer than the {engine.tokenizer.max_chars} characters "
                          f"embedding model {embedding_model!r} reads ([tokenizer] max_chars)")
    # Embedding is the long part (about 20 texts a second on a 2-core CPU): say it starts.
    print(f"embedding {len(new)} passages from {len(args.files)} file(s) with {embedding_model} ...",
          file=sys.stderr, flush=True)
    try:
        vectors, new_sentences = embed_passages(new, partial(engine.embed, progress=_progress("new passages")))
        vectors = vectors.reshape(len(new), engine.dim)
        if sentences is None:  # an index written before sentence vectors: embed the kept passages' too
            sentences = embed_passages([passages[i] for i in keep],
                                       partial(engine.embed, progress=_progress("kept passages")))[1]
            keep_sentences = sentences
        else:
            keep_sentences = sentences.select(keep)
    finally:
        engine.close()
    kept = embeddings[keep] if len(keep) else np.zeros((0, engine.dim), np.float32)
    # Ids stay unique across files: a later file with a clashing id gets a suffix.
    used = {passages[i].id for i in keep}
    for p in new:
        base, n = p.id, 2
        while p.id in used:
            p.id = f"{base}~{n}"
            n += 1
        used.add(p.id)
    all_passages = [passages[i] for i in keep] + new
    all_embeddings = np.concatenate([kept.reshape(-1, engine.dim), vectors], axis=0)
    meta = write_index(index_dir, all_passages, all_embeddings, embedding_model=embedding_model, sources=sources,
                       sentences=keep_sentences.after(new_sentences, len(keep)))
    print(f"indexed {len(new)} passages from {len(args.files)} file(s)"
          + (f" (replacing {replaced})" if replaced else "")
          + f"; {index_dir} now holds {meta['count']} passages, version {meta['version']} "
          f"({embedding_model}, {meta['dim']}-d) in {time.perf_counter() - t0:.1f} s")
    return 0


def _progress(what: str) -> Callable[[int, int], None]:
    """A progress(done, total) callback for TextEmbeddingEngine.embed: a bar on a terminal, else
    at most PROGRESS_STEPS lines (one per 5 %), each with the time spent and left (progress.py)."""
    bar: Progress | None = None

    def report(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = Progress(f"index add: embedding {what}", PROGRESS_STEPS)
        reached = PROGRESS_STEPS * done // total
        if reached > bar.done:  # one line however many steps this chunk crossed (few texts: big chunks)
            bar.done = reached - 1
            bar.step(f"{done}/{total} texts")
        if done == total:
            bar.close()

    return report


def _remove(args, index_dir: Path) -> int:
    passages, embeddings, meta, sentences = _current(index_dir)
    if not meta:
        raise _NotThere(f"no index in {index_dir}: build one with `edge-batcher index add FILE...`")
    gone = {str(p.resolve()) for p in args.files}
    keep = [i for i, p in enumerate(passages) if p.source not in gone]
    sources = {k: v for k, v in meta.get("sources", {}).items() if k not in gone}
    new_meta = write_index(index_dir, [passages[i] for i in keep], embeddings[keep].reshape(len(keep), -1)
                           if keep else embeddings[:0], embedding_model=meta["embedding_model"], sources=sources,
                           sentences=sentences.select(keep) if sentences is not None else None)
    print(f"removed {len(passages) - len(keep)} passages; {index_dir} now holds {new_meta['count']}, "
          f"version {new_meta['version']}")
    return 0


def _list(args, index_dir: Path) -> int:
    index = load_index(index_dir)
    if index is None:
        raise _NotThere(f"no index in {index_dir}: build one with `edge-batcher index add FILE...`")
    if args.json:
        print(json.dumps([{"id": p.id, "title": p.title, "chars": len(p.text), "source": p.source}
                          for p in index.passages], indent=2))
        return 0
    for p in index.passages:
        print(f"{p.id}\t{len(p.text)} chars\t{p.title}")
    return 0


def _info(index_dir: Path) -> int:
    meta = read_meta(index_dir)
    if meta is None:
        raise _NotThere(f"no index in {index_dir}: build one with `edge-batcher index add FILE...`")
    meta = {"dir": str(index_dir), **meta}
    print(json.dumps(meta, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m edge_batcher.rag.index_cli add FILES...` (the same as `edge-batcher index ...`)."""
    parser = argparse.ArgumentParser(prog="edge-batcher index", description="build and inspect the RAG document index")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.index_command is None:
        parser.print_help()
        return 2
    try:
        return run(args)
    except ConfigError as exc:
        print(f"edge-batcher index: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
