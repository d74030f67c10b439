"""Embeddings and retrieval with the real all-MiniLM-L6-v2 and the shipped corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edge_batcher.config import load_model_config
from edge_batcher.errors import Unavailable
from edge_batcher.rag import index_cli
from edge_batcher.rag.embed import TextEmbeddingEngine
from edge_batcher.rag.index import Index, IndexWatcher, load_index, read_meta, write_index
from edge_batcher.rag.passages import Passage, split_file, split_markdown
from tests.support.models import ROOT

CORPUS = ROOT / "docs" / "corpus"


@pytest.fixture(scope="module")
def embedder(minilm_dir):
    engine = TextEmbeddingEngine(load_model_config(minilm_dir))
    engine.load()
    yield engine
    engine.close()


def test_shipped_questions_put_the_right_passage_first(embedder):
    passages = split_file(CORPUS / "vibration-sensor-manual.md")
    assert 25 <= len(passages) <= 40
    index = Index(passages, embedder.embed([p.embed_text() for p in passages]), {})
    questions = json.loads((CORPUS / "questions.json").read_text())["questions"]
    assert len(questions) == 10
    ids = {p.id for p in passages}
    assert all(q["passage"] in ids for q in questions), "questions.json names passages the corpus does not have"
    hits = index.search(embedder.embed([q["question"] for q in questions]), 3)
    first = [h[0].passage.id for h in hits]
    right = sum(f == q["passage"] for f, q in zip(first, questions))
    misses = [(q["question"], f) for f, q in zip(first, questions) if f != q["passage"]]
    print(f"retrieval: right passage first for {right}/10 shipped questions; misses: {misses}")
    assert right >= 9, misses


def test_embeddings_do_not_depend_on_padding_or_batch_neighbours(embedder):
    texts = ["Replace the battery below 3.3 V.", "Bearing faults ring the structure's resonance at 800 to 1000 Hz "
             "and repeat at the defect frequency, several times per revolution of the shaft."]
    alone = np.concatenate([embedder.embed([t]) for t in texts])
    rows = embedder.tokenizer.encode_batch(texts, truncate=True)
    ids, mask = embedder.tokenizer.pad(rows, length=128)  # the largest bucket
    padded = embedder.infer({"input_ids": ids, "attention_mask": mask})["embedding"]
    np.testing.assert_allclose(padded, alone, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(alone, axis=1), 1.0, atol=1e-5)
    assert embedder.token_padding()["token_padding_ratio"] > 0.5  # counted: most of those 256 slots were padding


def test_long_texts_are_truncated_to_max_length(embedder):
    long = "vibration " * 400
    prepared, seq_len = embedder.prepare({"text": np.array([long.encode()], dtype=object)})
    assert seq_len == embedder.tokenizer.max_length == 128
    assert prepared["input_ids"].shape == (1, 128)


def test_markdown_is_split_at_headings_with_stable_ids():
    text = ("# Manual\n\nIntro line.\n\n## Mounting\n\nFirst paragraph.\n\nSecond paragraph.\n\n"
            "### Torque\n\n" + "Tighten it well. " * 60 + "\n\n## Mounting\n\nAgain.\n\n```\n# not a heading\n```\n")
    passages = split_markdown(text, "m", max_chars=300)
    ids = [p.id for p in passages]
    assert ids[0] == "m#manual" and passages[0].text == "Intro line."
    assert ids[1] == "m#mounting" and passages[1].text == "First paragraph.\n\nSecond paragraph."
    torque = [p for p in passages if p.id.startswith("m#torque")]
    assert len(torque) > 1 and all(len(p.text) <= 300 for p in torque)
    assert torque[0].title == "Manual > Mounting > Torque" and torque[1].id == "m#torque/2"
    assert ids[-1] == "m#mounting~2" and "# not a heading" in passages[-1].text
    assert len(set(ids)) == len(ids)


def test_index_files_are_readable_by_the_service_user_whoever_writes_them(tmp_path):
    """`index add` as root wrote 0600 files (mkstemp's mode) that the service user could not read:
    the rag model then answered 503 after a restart (issue 32). Now the mode the umask gives."""
    import os

    passages = [Passage("d#0", "T", "text")]
    write_index(tmp_path, passages, np.ones((1, 8), np.float32), embedding_model="m")
    mask = os.umask(0)
    os.umask(mask)
    for f in tmp_path.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, (f.name, oct(f.stat().st_mode))


def test_index_files_belong_together_or_are_refused(tmp_path):
    passages = [Passage(f"d#{i}", f"T{i}", f"text {i}") for i in range(5)]
    vectors = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    watcher = IndexWatcher(tmp_path)
    assert load_index(tmp_path) is None and watcher.changed() is False  # nothing yet, nothing seen
    meta = write_index(tmp_path, passages, vectors, embedding_model="m")
    assert watcher.changed() and meta["version"] == 1 and meta["count"] == 5
    watcher.mark(watcher.signature())
    index = load_index(tmp_path)
    top = index.search(vectors[3:4] * 2.0, 2)[0]
    assert top[0].passage.id == "d#3" and top[0].score == pytest.approx(1.0, abs=1e-5) and top[0].rank == 1
    assert top[1].score <= top[0].score and len(index.search(vectors[:1], 50)[0]) == 5

    meta2 = write_index(tmp_path, passages[:2], vectors[:2], embedding_model="m")
    assert meta2["version"] == 2 and watcher.changed()
    # A reader that lands between the data files' replacement and meta.json's sees a mismatch.
    (tmp_path / "passages.jsonl").write_text((tmp_path / "passages.jsonl").read_text() + "\n")
    with pytest.raises(Unavailable, match="does not match"):
        load_index(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "embeddings.npy", "lexical.json", "meta.json", "passages.jsonl"]


def test_index_cli_add_replace_list_remove(tmp_path, minilm_dir, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "minilm").symlink_to(minilm_dir)
    notes = tmp_path / "notes.txt"
    notes.write_text("The spare sensors are kept in cabinet B4 in the workshop.\n\nCall extension 2231 for the key.\n")
    index = tmp_path / "idx"
    common = ["--model-repo", str(repo), "--index", str(index)]
    assert index_cli.main(["add", str(notes), *common]) == 0
    assert read_meta(index)["count"] == 1 and read_meta(index)["embedding_model"] == "minilm"
    notes.write_text(notes.read_text() + "\n" + "More text about the cabinet. " * 40 + "\n")
    assert index_cli.main(["add", str(notes), *common]) == 0  # re-adding replaces the file's passages
    meta = read_meta(index)
    expected = [p.id for p in split_file(notes)]
    assert meta["version"] == 2 and meta["count"] == len(expected) == 3
    capsys.readouterr()
    assert index_cli.main(["list", "--json", *common]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [p["id"] for p in listed] == expected == ["notes#p1", "notes#p2", "notes#p3"]
    assert index_cli.main(["remove", str(notes), *common]) == 0
    assert read_meta(index)["count"] == 0
    assert index_cli.main(["add", str(tmp_path / "missing.md"), *common]) == 2
    assert "no such file" in capsys.readouterr().err
    assert index_cli.main(["add", str(notes), "--embedding-model", "other", *common]) == 2
    assert "built with embedding model 'minilm'" in capsys.readouterr().err


@pytest.mark.parametrize("replaced_before_the_cut", [0, 1, 2, 3])  # 3: all but meta.json
def test_a_write_cut_off_between_its_replacements_leaves_the_previous_build_whole(tmp_path, monkeypatch,
                                                                                 replaced_before_the_cut):
    """A crash or power loss while `index add` swaps the files in: some data files are the new
    build's, meta.json still the old one's. The index was then refused for good (a mismatch, "a
    rebuild in progress?") until rebuilt by hand; now the old build is served whole from the files
    kept as NAME.prev, and the next write completes normally and leaves no .prev behind."""
    import os

    from edge_batcher.rag import index as index_module

    rng = np.random.default_rng(1)
    passages = [Passage(f"d#{i}", f"T{i}", f"text {i}") for i in range(6)]
    vectors = rng.normal(size=(6, 8)).astype(np.float32)
    old = write_index(tmp_path, passages[:3], vectors[:3], embedding_model="m")
    replace, done = os.replace, []

    def cut_off(src, dst):
        if Path(dst).parent == tmp_path and not Path(dst).name.endswith(".prev"):
            if len(done) == replaced_before_the_cut:
                raise SystemExit("power lost")  # the process dies here: nothing after runs
            done.append(dst)
        replace(src, dst)

    monkeypatch.setattr(index_module.os, "replace", cut_off)
    with pytest.raises(SystemExit):
        write_index(tmp_path, passages, vectors, embedding_model="m")
    monkeypatch.setattr(index_module.os, "replace", replace)
    for stray in tmp_path.glob(".*"):  # the staged files a dead process leaves (mkstemp names)
        stray.unlink()
    index = load_index(tmp_path)
    assert index.meta["version"] == old["version"] and [p.id for p in index.passages] == ["d#0", "d#1", "d#2"]
    assert index.search(vectors[1:2], 1)[0][0].passage.id == "d#1"

    again = write_index(tmp_path, passages[:5], vectors[:5], embedding_model="m")
    index = load_index(tmp_path)
    assert again["version"] == old["version"] + 1 and len(index.passages) == 5
    assert not list(tmp_path.glob("*.prev"))
