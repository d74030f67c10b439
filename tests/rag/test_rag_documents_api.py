"""Documents added to and removed from a running daemon's index through its socket (issue 32): the
daemon embeds with the model it serves and writes its own index, as the installed service must."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np

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


def test_documents_are_added_and_removed_through_the_daemon(start_daemon, rag_repo, tmp_path):
    repo = tmp_path / "engines"
    shutil.copytree(rag_repo / "minilm", repo / "minilm")
    shutil.copytree(rag_repo / "index", tmp_path / "index")
    (repo / "rag").mkdir()
    (repo / "rag" / "model.toml").write_text(
        (rag_repo / "rag" / "model.toml").read_text().replace(str(rag_repo / "index"), str(tmp_path / "index")))
    d = start_daemon("", repo=repo)
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
