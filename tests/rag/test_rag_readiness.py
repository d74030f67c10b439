"""Readiness names a model that cannot serve: a rag model without a readable index answered
every question 503 while /v2/health/ready said ready (issue 32)."""

from __future__ import annotations

import shutil

import pytest

from tests.support import rawhttp


def test_a_rag_model_without_its_index_is_listed_as_not_ready(start_daemon, rag_repo, tmp_path):
    repo = tmp_path / "engines"
    shutil.copytree(rag_repo / "minilm", repo / "minilm")
    (repo / "rag").mkdir()
    toml = (rag_repo / "rag" / "model.toml").read_text()
    missing = tmp_path / "no-index"
    (repo / "rag" / "model.toml").write_text(toml.replace(str(rag_repo / "index"), str(missing)))
    d = start_daemon("", repo=repo)
    status, ready = rawhttp.request(d.socket, "GET", "/v2/health/ready")
    assert status == 200 and ready["ready"] is True  # minilm serves
    assert "no document index loaded from" in ready["not_ready"]["rag"] and "index add" in ready["not_ready"]["rag"]
    status, body = rawhttp.request(d.socket, "GET", "/v2/models/rag/ready")
    assert status == 503 and body["ready"] is False and str(missing) in body["reason"]
    status, body = rawhttp.request(d.socket, "GET", "/v2/models/minilm/ready")
    assert status == 200 and body == {"ready": True}
    # The index built while the daemon runs: the next question loads it, and readiness follows.
    from edge_batcher.rag import index_cli

    manual = tmp_path.parent / "manual.md"
    manual.write_text("# Battery\n\nThe sensor battery lasts five years at one reading a minute.\n")
    assert index_cli.main(["add", str(manual), "--model-repo", str(repo), "--index", str(missing)]) == 0
    with d.client() as client:
        import numpy as np

        out = client.infer("rag", {"question": np.array([b"How long does the battery last?"], dtype=object)})
        assert out["answer"].size
    status, body = rawhttp.request(d.socket, "GET", "/v2/models/rag/ready")
    assert status == 200, body
    assert "not_ready" not in rawhttp.request(d.socket, "GET", "/v2/health/ready")[1]


def test_the_embedding_model_of_a_loaded_rag_model_cannot_be_unloaded(start_daemon, rag_repo):
    from edge_batcher.client import ClientError

    d = start_daemon('[models]\nload = ["minilm", "rag"]\n', repo=rag_repo)
    with d.client() as client:
        with pytest.raises(ClientError) as info:
            client.unload_model("minilm")
        assert info.value.status == 400 and "model 'minilm' is used by rag: unload it first" in info.value.message
        client.unload_model("rag")
        client.unload_model("minilm")  # nothing uses it now
        assert [m["name"] for m in client.repository_index()] == []
