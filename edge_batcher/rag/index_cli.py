"""`edge-batcher index add | remove | list | info`: build and inspect the RAG document index.

    edge-batcher index add docs/corpus/*.md          # split, embed, write (re-adding a file replaces it)
    edge-batcher index remove docs/old-manual.md
    edge-batcher index list
    edge-batcher index info

With --url the daemon does it (POST /v2/models/{rag}/index): it embeds with the model it serves
and writes its own index as its own user, the way to add documents to the installed service.
Without, where things are found: the model repository is --model-repo, else the daemon config's
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

from ..config import load_config, load_model_config
from ..errors import ConfigError, EdgeBatcherError
from ..progress import Progress
from .index import default_index_dir, load_index, read_meta
from .index_update import Document, add_documents, remove_documents
from .passages import DEFAULT_MAX_CHARS

PROGRESS_STEPS = 20  # embedding runs ~20 texts a second on the 2-core VM: a line every 5 % of it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="index_command", metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--index", type=Path, help="index directory (default: the rag model's [rag] index_dir, "
                                                  "else $STATE_DIRECTORY/index, else ./state/index)")
        p.add_argument("--model-repo", type=Path, help="model repository (default: from --config, else ./engines)")
        p.add_argument("--config", help="daemon config file whose [models] repository to use")
        p.add_argument("--rag-model", default="rag", help="the rag model whose [rag] settings apply (default: rag)")
        p.add_argument("--url", help="a running daemon (unix:///path.sock or http://host:port): it embeds and writes "
                                     "its own index, as its own user (the installed service's way)")
        p.add_argument("--token", help="bearer token for a TCP --url")

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
        if getattr(args, "url", None):
            return _through_the_daemon(args)
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


DAEMON_TIMEOUT_S = 3600.0  # a manual of thousands of passages takes minutes to embed on a small CPU


def _through_the_daemon(args: argparse.Namespace) -> int:
    """index add | remove | info | list against a running daemon (POST /v2/models/{rag}/index):
    the files are read here and sent; the daemon splits, embeds and writes its own index."""
    from ..client import Client, ClientError

    command = args.index_command
    with Client(args.url, token=args.token, timeout=DAEMON_TIMEOUT_S) as client:
        try:
            if command == "add":
                documents = [(str(path.resolve()), _read_text(path)) for path in args.files]
                print(f"sending {len(documents)} file(s) to {args.url}; it embeds them ...", file=sys.stderr,
                      flush=True)
                s = client.index_add(args.rag_model, documents, rebuild=args.rebuild)
                for source in s["empty"]:
                    print(f"{source}: no text to index", file=sys.stderr)
                print(f"indexed {s['added']} passages from {len(documents)} file(s)"
                      + (f" (replacing {s['replaced']})" if s["replaced"] else "")
                      + f"; model {args.rag_model}'s index now holds {s['count']} passages, version {s['version']}")
            elif command == "remove":
                s = client.index_remove(args.rag_model, [str(p.resolve()) for p in args.files])
                print(f"removed {s['removed']} passages; model {args.rag_model}'s index now holds {s['count']}, "
                      f"version {s['version']}")
            else:  # info, list: what the daemon's index holds
                print(json.dumps(client.index_info(args.rag_model), indent=2))
        except ClientError as exc:
            prefix = f"{exc.status}: " if exc.status else ""
            raise EdgeBatcherError(f"{prefix}{exc.message}") from None
    return 0


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


def _add(args, index_dir: Path, embedding_model: str, repo: Path) -> int:
    from .embed import TextEmbeddingEngine

    t0 = time.perf_counter()
    documents = []
    for path in args.files:
        try:
            documents.append(Document(str(path.resolve()), _read_text(path)))
        except OSError as exc:
            raise _NotThere(f"{path}: cannot read it: {exc.strerror or exc} (nothing was indexed)") from None
    meta = {} if args.rebuild else (read_meta(index_dir) or {})
    if meta and meta.get("embedding_model") != embedding_model:  # before loading a model for nothing
        raise ConfigError(f"index {index_dir} was built with embedding model {meta.get('embedding_model')!r}, not "
                          f"{embedding_model!r}: add --rebuild to re-embed everything with {embedding_model!r}")
    config_dir = repo / embedding_model
    if not (config_dir / "model.toml").is_file():
        raise ConfigError(f"embedding model {embedding_model!r} not found in {repo} (build it with "
                          "tools/build_embedding_model.py --out <repo>)")
    engine = TextEmbeddingEngine(load_model_config(config_dir))
    engine.load()
    assert engine.tokenizer is not None
    try:
        if args.max_chars > engine.tokenizer.max_chars:
            raise ConfigError(f"--max-chars {args.max_chars} is longer than the {engine.tokenizer.max_chars} "
                              f"characters embedding model {embedding_model!r} reads ([tokenizer] max_chars)")
        # Embedding is the long part (about 20 texts a second on a 2-core CPU): say it starts.
        print(f"embedding {len(args.files)} file(s) with {embedding_model} ...", file=sys.stderr, flush=True)
        summary = add_documents(index_dir, documents, partial(engine.embed, progress=_progress("new passages")),
                                embedding_model=embedding_model, dim=engine.dim, max_chars=args.max_chars,
                                rebuild=args.rebuild, waiting=_say)
    finally:
        engine.close()
    for source in summary["empty"]:
        print(f"{source}: no text to index", file=sys.stderr)
    print(f"indexed {summary['added']} passages from {len(args.files)} file(s)"
          + (f" (replacing {summary['replaced']})" if summary["replaced"] else "")
          + f"; {index_dir} now holds {summary['count']} passages, version {summary['version']} "
          f"({embedding_model}, {engine.dim}-d) in {time.perf_counter() - t0:.1f} s")
    return 0


def _read_text(path: Path) -> str:
    """A file to index: .md or .txt, UTF-8."""
    if path.suffix.lower() not in (".md", ".markdown", ".txt", ".text"):
        raise ConfigError(f"{path}: only text (.txt) and markdown (.md) files can be indexed")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: cannot read it as UTF-8 text: {exc}") from None


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


def _say(line: str) -> None:
    print(f"edge-batcher index: {line}", file=sys.stderr, flush=True)


def _remove(args, index_dir: Path) -> int:
    summary = remove_documents(index_dir, {str(p.resolve()) for p in args.files}, waiting=_say)
    if summary is None:
        raise _NotThere(f"no index in {index_dir}: build one with `edge-batcher index add FILE...`")
    print(f"removed {summary['removed']} passages; {index_dir} now holds {summary['count']}, "
          f"version {summary['version']}")
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
