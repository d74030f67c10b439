"""Hybrid retrieval (passage cosine + best sentence cosine + BM25, min-max fusion) on the
enlarged question sets.

The technician questions (docs/corpus/questions-technician.json) were written before anything
was measured; the fusion was chosen on their dev split only, and its weights are all 1 (not
tuned). The held-out questions (questions-holdout.json) were written before the fusion changed
and evaluated once, at the end. The thresholds are the figures measured (docs/rag.md), less one
question of margin, so a regression in splitting, analysing, sentence scoring or fusing shows
up here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_batcher.config import load_model_config
from edge_batcher.rag import index_cli
from edge_batcher.rag.embed import TextEmbeddingEngine
from edge_batcher.rag.fusion import DEFAULT_FUSION, Fusion, fused_scores, ranks
from edge_batcher.rag.index import Index, embed_passages, load_index, read_meta, write_index
from edge_batcher.rag.lexical import Bm25, analyze
from edge_batcher.rag.passages import Passage, split_file
from tests.rag.conftest import CORPUS, _tool


@pytest.fixture(scope="module")
def evaluation(minilm_dir):
    tool = _tool("eval_retrieval")
    engine = TextEmbeddingEngine(load_model_config(minilm_dir))
    engine.load()
    index = tool.build_index(engine)
    questions = tool.load_questions()
    vectors = engine.embed([q["question"] for q in questions])
    yield tool, index, questions, vectors
    engine.close()


def test_the_technician_questions_cover_every_section_of_the_manual():
    data = json.loads((CORPUS / "questions-technician.json").read_text())
    questions = data["questions"]
    sections = {p.id for p in split_file(CORPUS / "vibration-sensor-manual.md")}
    assert len(questions) >= 40
    assert {q["passage"] for q in questions} == sections  # every passage is asked about, none that is not
    assert {q["split"] for q in questions} == {"dev", "test"}
    shipped = {q["question"] for q in json.loads((CORPUS / "questions.json").read_text())["questions"]}
    assert not shipped & {q["question"] for q in questions}, "the new questions must be new"
    holdout = json.loads((CORPUS / "questions-holdout.json").read_text())["questions"]
    assert len(holdout) >= 20 and {q["passage"] for q in holdout} <= sections
    assert len({q["passage"] for q in holdout}) == len(sections)  # every section once at least
    assert not (shipped | {q["question"] for q in questions}) & {q["question"] for q in holdout}


def _subset(tool, index, questions, vectors, keep, fusion):
    rows = [i for i, q in enumerate(questions) if keep(q)]
    return tool.evaluate(index, vectors[rows], [questions[i] for i in rows], fusion)


def test_hybrid_retrieval_on_all_questions(evaluation):
    tool, index, questions, vectors = evaluation
    results = {name: tool.evaluate(index, vectors, questions, fusion)
               for name, fusion in tool.rankings(DEFAULT_FUSION).items()}
    for name, r in results.items():
        print(f"{name}: top-1 {r['top1']}/{r['n']}, top-3 {r['top3']}/{r['n']}")
    hybrid, dense = results["hybrid (configured)"], results["dense (passage cosine)"]
    before = results["hybrid RRF, passage cosine (before)"]
    assert hybrid["n"] == 90
    # Measured: hybrid 81/90 top-1 (90%), 90/90 top-3; dense 73/90 and 86/90; the RRF hybrid it
    # replaced 77/90 and 88/90 (docs/rag.md).
    assert hybrid["top1"] >= 80, hybrid["misses"]
    assert hybrid["top3"] >= 89, hybrid["misses"]
    assert hybrid["top1"] > before["top1"] > dense["top1"] and hybrid["top3"] > dense["top3"]
    assert results["dense + best sentence"]["top1"] > dense["top1"]  # measured 79 against 73
    # The split not used to choose the fusion: measured 36/40 (90%), the RRF hybrid 30/40.
    test = _subset(tool, index, questions, vectors, lambda q: q["split"] == "test", DEFAULT_FUSION)
    assert test["top1"] >= 35 and test["top3"] >= 39, test["misses"]
    shipped = _subset(tool, index, questions, vectors, lambda q: q["file"] == "questions.json", DEFAULT_FUSION)
    assert shipped["top1"] == 10


def test_hybrid_retrieval_on_the_held_out_questions(minilm_dir):
    """The held-out set, evaluated once the fusion was fixed: 35/40 top-1 (88%), 38/40 top-3,
    where the RRF hybrid got 33/40 and dense 29/40 (docs/rag.md)."""
    tool = _tool("eval_retrieval")
    engine = TextEmbeddingEngine(load_model_config(minilm_dir))
    engine.load()
    try:
        index = tool.build_index(engine)
        questions = tool.load_questions(files=(tool.HOLDOUT_FILE,))
        vectors = engine.embed([q["question"] for q in questions])
    finally:
        engine.close()
    hybrid = tool.evaluate(index, vectors, questions, DEFAULT_FUSION)
    rrf = tool.rankings(DEFAULT_FUSION)["hybrid RRF, passage cosine (before)"]
    before = tool.evaluate(index, vectors, questions, rrf)
    assert hybrid["n"] == 40
    assert hybrid["top1"] >= 34 and hybrid["top3"] >= 37, hybrid["misses"]
    assert hybrid["top1"] > before["top1"]


def test_bm25_ranks_exact_terms_and_word_forms():
    docs = ["Tighten the M6 stud to 5 N·m.", "Bearings need regreasing every 2000 hours.",
            "The gateway serves up to 32 sensors."]
    bm25 = Bm25.from_texts(docs)
    assert analyze("Regreased bearings, stopped!") == analyze("regrease bearing stop") == ["regreas", "bear", "stop"]
    assert analyze("regreasing") == analyze("regrease") and analyze("batteries") == analyze("battery")
    assert int(np.argmax(bm25.scores("when should I regrease the bearing"))) == 1
    assert int(np.argmax(bm25.scores("m6 stud torque"))) == 0
    assert not bm25.scores("the and of").any()  # function words only: no lexical evidence at all
    again = Bm25.from_json(json.loads(json.dumps(bm25.to_json())))
    np.testing.assert_allclose(again.scores("sensors gateway"), bm25.scores("sensors gateway"))


def test_reciprocal_rank_fusion():
    dense = np.array([0.9, 0.8, 0.1])
    lexical = np.array([0.0, 5.0, 1.0])
    np.testing.assert_array_equal(ranks(dense), [1, 2, 3])
    fused = fused_scores(dense, lexical, Fusion("hybrid", 1.0, 1.0, 0.0, "rrf"))
    np.testing.assert_allclose(fused, [1.0, 1 / 2 + 1, 1 / 3 + 1 / 2])  # no shared term: no lexical share
    assert np.argmax(fused_scores(dense, lexical, Fusion("hybrid", 1.0, 0.01, 60.0, "rrf"))) == 0  # dense dominates
    assert list(np.argsort(-fused_scores(dense, lexical, Fusion("lexical")))) == [1, 2, 0]
    assert list(np.argsort(-fused_scores(dense, lexical, Fusion("dense")))) == [0, 1, 2]


def test_min_max_fusion_adds_normalised_scores():
    dense = np.array([0.9, 0.8, 0.4])
    sentence = np.array([0.5, 0.9, 0.3])
    lexical = np.array([0.0, 2.0, 4.0])
    fused = fused_scores(dense, lexical, Fusion(), sentence)
    # each signal to [0, 1] over the passages: dense [1, .8, 0], sentence [.333, 1, 0], lexical [0, .5, 1]
    np.testing.assert_allclose(fused, [1 + 1 / 3, 0.8 + 1 + 0.5, 1.0])
    np.testing.assert_allclose(fused_scores(dense, lexical, Fusion("dense"), sentence), [1 + 1 / 3, 1.8, 0.0])
    np.testing.assert_allclose(fused_scores(dense, np.zeros(3), Fusion(), None), [1.0, 0.8, 0.0])  # no spread: no share
    assert list(fused_scores(dense, lexical, Fusion("dense", sentence_weight=0.0), sentence)) == list(dense)


def test_a_passage_is_scored_by_its_best_sentence():
    """A passage answering in one sentence among unrelated ones: its whole-passage cosine is
    diluted, its best sentence's is not."""
    passages = [Passage("d#1", "Battery", "Replace below 3.3 V. The cap is blue. Store cells dry."),
                Passage("d#2", "Mounting", "Torque 5 N·m."), Passage("d#3", "Paint", "Paint it green.")]
    axes = {"Replace below 3.3 V.": [1, 0, 0, 0, 0], "The cap is blue.": [0, 1, 0, 0, 0],
            "Store cells dry.": [0, 0, 1, 0, 0], "Torque 5 N·m.": [0, 0, 0, 1, 0], "Paint it green.": [0, 0, 0, 0, 1]}

    def embed(texts):  # an honest stand-in for the embedding model: a unit vector per sentence
        rows = []
        for text in texts:
            v = np.zeros(5)
            for sentence, axis in axes.items():
                if sentence in text:
                    v += axis
            rows.append(v / np.linalg.norm(v))
        return np.array(rows, dtype=np.float32)

    vectors, sentences = embed_passages(passages, embed)
    assert list(sentences.passage) == [0, 0, 0, 1, 2]
    index = Index(passages, vectors, {}, sentences=sentences)
    query = np.array([[1.0, 0, 0, 0.7, 0]], dtype=np.float32)
    hits = index.search_fused(query, ["voltage"], 3, Fusion("dense"))[0]
    assert [h.passage.id for h in hits] == ["d#1", "d#2", "d#3"] and hits[0].sentence > hits[0].score
    assert index.search(query, 3)[0][0].passage.id == "d#2"  # by the passage cosine alone, the other wins
    kept = sentences.select([2, 1])
    assert list(kept.passage) == [0, 1] and kept.vectors.shape == (2, 5)
    joined = kept.after(sentences.select([0]), 2)
    assert list(joined.passage) == [0, 1, 2, 2, 2]


def _two_files(tmp_path, minilm_dir, first: str):
    """Two text files and the `edge-batcher index` arguments of a repository holding minilm."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "minilm").symlink_to(minilm_dir)
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(first + "\n")
    b.write_text("The forklift key hangs in the workshop office.\n")
    return a, b, ["--model-repo", str(repo), "--index", str(tmp_path / "idx")]


def test_lexical_statistics_are_stored_and_follow_index_add_and_remove(tmp_path, minilm_dir):
    a, b, common = _two_files(tmp_path, minilm_dir, "The spare sensors are kept in cabinet B4.")
    assert index_cli.main(["add", str(a), *common]) == 0
    assert index_cli.main(["add", str(b), *common]) == 0
    meta = read_meta(tmp_path / "idx")
    assert "lexical.json" in meta["sha256"] and meta["lexical"]["analyzer"]
    assert "sentences.npz" in meta["sha256"] and meta["sentences"] == 2
    index = load_index(tmp_path / "idx")
    assert len(index.lexical) == 2 and int(np.argmax(index.lexical.scores("forklift"))) == 1
    assert list(index.sentences.passage) == [0, 1]
    forklift_sentence = index.sentences.vectors[1].copy()
    assert index_cli.main(["remove", str(a), *common]) == 0
    index = load_index(tmp_path / "idx")
    assert len(index.lexical) == 1 and index.lexical.scores("forklift")[0] > 0
    assert list(index.sentences.passage) == [0]
    np.testing.assert_array_equal(index.sentences.vectors[0], forklift_sentence)
    hits = index.search_fused(np.ones((1, index.dim)), ["where is the forklift key"], 3, DEFAULT_FUSION)[0]
    assert hits[0].lexical > 0


def test_an_index_written_without_lexical_statistics_still_loads(tmp_path):
    passages = [Passage("d#1", "Battery", "Replace below 3.3 V."), Passage("d#2", "Mounting", "Torque 5 N·m.")]
    vectors = np.eye(2, 4, dtype=np.float32)
    write_index(tmp_path, passages, vectors, embedding_model="m")
    meta = json.loads((tmp_path / "meta.json").read_text())
    del meta["sha256"]["lexical.json"]  # as written by an edge-batcher before hybrid retrieval
    (tmp_path / "lexical.json").unlink()
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    index = load_index(tmp_path)
    hits = index.search_fused(vectors[1:2], ["torque"], 2, DEFAULT_FUSION)[0]
    assert [h.passage.id for h in hits] == ["d#2", "d#1"] and hits[0].lexical > 0 and hits[1].lexical == 0
    assert index.sentences is None and hits[0].sentence is None  # no sentence vectors: the passage cosine alone


def test_index_add_to_an_index_without_sentence_vectors_embeds_them(tmp_path, minilm_dir):
    a, b, common = _two_files(tmp_path, minilm_dir,
                              "The spare sensors are kept in cabinet B4. Ask the foreman for the key.")
    assert index_cli.main(["add", str(a), *common]) == 0
    old = load_index(tmp_path / "idx")
    write_index(tmp_path / "idx", old.passages, old.embeddings, embedding_model="minilm")  # as before sentences
    assert load_index(tmp_path / "idx").sentences is None and not (tmp_path / "idx" / "sentences.npz").exists()
    assert index_cli.main(["add", str(b), *common]) == 0
    index = load_index(tmp_path / "idx")
    assert list(index.sentences.passage) == [0, 0, 1]
