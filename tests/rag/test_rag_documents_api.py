"""Documents added to and removed from a running daemon's index through its socket (issue 32): the
daemon embeds with the model it serves and writes its own index, as the installed service must."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_batcher.client import ClientError
from tests.support.models import ROOT

NOTES = """# Pump 7 commissioning

## Grease schedule

Pump 7's bearings take 12 grams of lithium grease every 400 operating hours; log each greasing
in the plant's maintenance book under asset P-7.
"""


def index(d, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_batcher.cli", "index", *args, "--url", d.url],
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT)})


def repository_with_index_in(rag_repo: Path, tmp_path: Path, index: Path) -> Path:
    """minilm and a rag model whose index, a copy of the shipped manual's, is `index`."""
    repo = tmp_path / "engines"
    shutil.copytree(rag_repo / "minilm", repo / "minilm")
    shutil.copytree(rag_repo / "index", index)
    (repo / "rag").mkdir()
    (repo / "rag" / "model.toml").write_text(
        (rag_repo / "rag" / "model.toml").read_text().replace(str(rag_repo / "index"), str(index)))
    return repo


def test_documents_are_added_and_removed_through_the_daemon(start_daemon, rag_repo, tmp_path):
    d = start_daemon("", repo=repository_with_index_in(rag_repo, tmp_path, tmp_path / "index"))
    question = {"question": np.array([b"How much grease do the bearings of pump 7 take?"], dtype=object)}
    notes = tmp_path / "pump7.md"
    notes.write_text(NOTES)

    added = index(d, "add", str(notes))
    assert added.returncode == 0, added.stderr
    assert "indexed 1 passages from 1 file(s); model rag's index now holds 36 passages" in added.stdout
    with d.client() as client:
        out = client.infer("rag", question)
        assert json.loads(out["sources"][0])[0]["id"] == "pump7#grease-schedule"  # the daemon loaded what it wrote
        assert b"12 grams" in out["answer"][0]
    info = json.loads(index(d, "info").stdout)
    assert str(notes) in info["sources"] and info["count"] == 36

    removed = index(d, "remove", str(notes))
    assert removed.returncode == 0 and "removed 1 passages" in removed.stdout, removed.stderr
    with d.client() as client:
        assert "pump7#" not in client.infer("rag", question)["sources"][0].decode()
        try:
            client.index_add("minilm", [("x.md", "text")])
        except ClientError as exc:
            assert exc.status == 400 and "has no document index: only rag models do" in exc.message
        else:
            raise AssertionError("an embedding model took documents")
    bad = index(d, "add", str(tmp_path / "none.md"))
    assert bad.returncode == 2 and "no such file" in bad.stderr


def test_a_full_disk_fails_the_add_and_keeps_the_index(start_daemon, rag_repo, tmp_path, small_disk):
    """An index directory whose file system fills while documents are added: the add is answered
    507 naming the directory and the error, the index serves what it held, and no staged file is
    left taking the little room there is (before: 500 "internal error" and a traceback)."""
    repo = repository_with_index_in(rag_repo, tmp_path, small_disk / "index")
    before = sorted(p.name for p in (small_disk / "index").iterdir())
    d = start_daemon("", repo=repo)
    # passages enough that their vectors and text do not fit in what is left
    text = "\n\n".join(f"## Section {i}\n\n" + f"Pump {i} takes {i} grams of grease every {i * 10} hours. " * 8
                       for i in range(400))
    with d.client() as client:
        count = client.index_info("rag")["count"]
        with pytest.raises(ClientError) as failed:
            client.index_add("rag", [("big.md", text)])
        assert failed.value.status == 507, failed.value.message
        assert "No space left on device" in failed.value.message and str(small_disk / "index") in failed.value.message
        assert "the index is as it was" in failed.value.message
        assert client.index_info("rag")["count"] == count
        out = client.infer("rag", {"question": np.array([b"How do I replace the battery?"], dtype=object)})
        assert out["answer"][0]
    assert sorted(p.name for p in (small_disk / "index").iterdir()) == before
    log = d.log_text()
    assert "Traceback" not in log and "no space left" in log.lower(), log[-2000:]


def test_a_full_disk_fails_the_command_line_add_with_a_message(rag_repo, tmp_path, small_disk):
    """`edge-batcher index add` without a daemon, its index on a file system that fills: exit 1
    and one line naming the directory and the error (before: a traceback), the index unchanged."""
    shutil.copytree(rag_repo / "index", small_disk / "index")
    before = {p.name: p.read_bytes() for p in (small_disk / "index").iterdir()}
    notes = tmp_path / "big.md"
    notes.write_text("\n\n".join(f"## Section {i}\n\n" + f"Pump {i} takes {i} grams of grease. " * 8
                                 for i in range(60)))
    done = subprocess.run([sys.executable, "-m", "edge_batcher.cli", "index", "add", str(notes), "--index",
                           str(small_disk / "index"), "--model-repo", str(rag_repo)],
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert f"could not write the index in {small_disk / 'index'}: No space left on device" in done.stderr
    assert {p.name: p.read_bytes() for p in (small_disk / "index").iterdir()} == before
