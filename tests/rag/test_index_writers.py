"""Writers of one document index take turns (rag/index_update.py: one_writer): each reads the
index, adds or removes, and writes it back, and a second writer working meanwhile (another `index
add`, the daemon's API, a second rag model on the same index) would have written its change over
the first one's, which was lost without a word."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from edge_batcher.config import load_model_config
from edge_batcher.rag.embed import TextEmbeddingEngine
from edge_batcher.rag.index import load_index
from edge_batcher.rag.index_update import Document, add_documents, one_writer
from tests.support.models import ROOT

PUMP = Document("pump.md", "# Pump\n\n## Grease\n\nPump 7 takes 12 grams of grease every 400 hours.\n")
FAN = Document("fan.md", "# Fan\n\n## Belts\n\nThe fan's belts are tensioned to 45 N every quarter.\n")


@pytest.fixture(scope="module")
def engine(minilm_dir):
    engine = TextEmbeddingEngine(load_model_config(minilm_dir))
    engine.load()
    yield engine
    engine.close()


def test_two_writers_at_once_both_keep_their_documents(engine, tmp_path, monkeypatch):
    from edge_batcher.rag import index_update

    index_dir = tmp_path / "idx"
    told: list[str] = []
    write = index_update.write_index

    def slow_write(*args, **kwargs):  # a large index on an SD card: the other writer comes meanwhile
        time.sleep(0.5)
        return write(*args, **kwargs)

    monkeypatch.setattr(index_update, "write_index", slow_write)
    def add(document: Document) -> None:
        add_documents(index_dir, [document], engine.embed, embedding_model="minilm", dim=engine.dim, max_chars=600,
                      waiting=told.append)

    writers = [threading.Thread(target=add, args=(d,)) for d in (PUMP, FAN)]
    for w in writers:
        w.start()
        time.sleep(0.2)  # the first has read the index (none yet) and is writing
    for w in writers:
        w.join()
    index = load_index(index_dir)
    assert sorted(index.meta["sources"]) == ["fan.md", "pump.md"]
    assert sorted(p.source for p in index.passages) == ["fan.md", "pump.md"]
    assert index.meta["version"] == 2
    assert len(told) == 1 and "another writer of index" in told[0], told


def test_a_writer_embeds_before_its_turn(engine, tmp_path):
    """Embedding is the long part (minutes for a manual): a writer does it while another holds the
    index, and waits only to read, merge and write."""
    index_dir = tmp_path / "idx"
    embedded = threading.Event()

    def embed(texts):
        vectors = engine.embed(texts)
        embedded.set()
        return vectors

    with one_writer(index_dir):
        writer = threading.Thread(target=add_documents, args=(index_dir, [PUMP], embed),
                                  kwargs={"embedding_model": "minilm", "dim": engine.dim, "max_chars": 600})
        writer.start()
        assert embedded.wait(60)  # while the turn is someone else's
        time.sleep(0.2)
        assert writer.is_alive() and load_index(index_dir) is None  # its write waits for the turn
    writer.join(60)
    assert sorted(load_index(index_dir).meta["sources"]) == ["pump.md"]


def test_the_command_line_waits_for_the_daemon_s_write_and_says_so(engine, tmp_path, rag_repo):
    index_dir = tmp_path / "idx"
    pump, fan = (Document(str(tmp_path / d.source), d.text) for d in (PUMP, FAN))  # as `index add` names files
    add_documents(index_dir, [pump, fan], engine.embed, embedding_model="minilm", dim=engine.dim, max_chars=600)
    with one_writer(index_dir):  # another process at work on it (the daemon, an `index add`)
        remover = subprocess.Popen(
            [sys.executable, "-m", "edge_batcher.cli", "index", "remove", "pump.md", "--index", str(index_dir),
             "--model-repo", str(rag_repo)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={"PYTHONPATH": str(ROOT)})
        time.sleep(3)
        assert remover.poll() is None  # waiting its turn
    out, err = remover.communicate(timeout=60)
    assert remover.returncode == 0, err
    assert "another writer of index" in err and "waiting for it" in err
    assert "removed 1 passages" in out
    assert sorted(load_index(index_dir).meta["sources"]) == [fan.source]


def test_what_a_killed_writer_left_is_removed_by_the_next(engine, tmp_path):
    """A writer killed while it stages a file (kill -9, the power lost) leaves it in the index
    directory, the size of the index: the next writer, alone there, removes it."""
    index_dir = tmp_path / "idx"
    add_documents(index_dir, [PUMP], engine.embed, embedding_model="minilm", dim=engine.dim, max_chars=600)
    killed = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys; from pathlib import Path; from edge_batcher.rag import index\n"
        "def write(fh):\n"
        "    fh.write(b'x' * (1 << 20)); fh.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
        "index._stage(Path(sys.argv[1]), index.EMBEDDINGS, write)\n"), str(index_dir)],
        env={"PYTHONPATH": str(ROOT)}, capture_output=True)
    assert killed.returncode == -9, killed.stderr
    (left,) = [p for p in index_dir.iterdir() if p.name.startswith(".embeddings.npy.")]
    assert left.stat().st_size == 1 << 20
    (index_dir / ".keep").write_text("not the index's")
    add_documents(index_dir, [FAN], engine.embed, embedding_model="minilm", dim=engine.dim, max_chars=600)
    assert not left.exists() and (index_dir / ".keep").exists()
    assert sorted(load_index(index_dir).meta["sources"]) == ["fan.md", "pump.md"]
