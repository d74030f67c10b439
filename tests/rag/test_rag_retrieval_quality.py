"""Hybrid retrieval (passage cosine + best sentence cosine + heading cosine + BM25 weighted by the
question's term coverage, min-max fusion) on every question set, against every single method.

Every set was written before anything was measured on it. The technician set's dev split and the
paraphrase set's dev split (docs/corpus/questions-paraphrase.json) were used to choose; their test
splits and questions-holdout.json were evaluated once; the coverage setting was then checked once
on questions-paraphrase-holdout.json. The heading weight was chosen on all five files, cross-validated
between them (docs/rag.md); five blind sets were written after that, by sessions that saw only
the manual, and evaluated once each (the second on 2026-11-27, when the close-call margin was
checked on it too; the fourth once the spelling correction was chosen; the fifth on 2026-11-28,
settings unchanged); a further blind set is
evaluated with `tools/eval_retrieval.py --test --questions FILE`. The thresholds are the figures measured, less
one question of margin, so a regression in splitting, analysing, sentence or heading scoring or
fusing shows up here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from edge_batcher.config import load_model_config
from edge_batcher.rag import index_cli
from edge_batcher.rag.embed import TextEmbeddingEngine
from edge_batcher.rag.fusion import COVERAGE_ONLY, DEFAULT_FUSION, Fusion, fused_scores, ranks
from edge_batcher.rag.index import Index, embed_passages, heading_texts, lead, load_index, read_meta, write_index
from edge_batcher.rag.lexical import Bm25, analyze
from edge_batcher.rag.passages import Passage, split_file
from tests.rag.conftest import CORPUS, _tool

SINGLE = ("dense (passage cosine)", "dense + best sentence", "lexical (BM25)")
SHIPPED = "shipped default (as configured)"
OLD = "hybrid, equal weights (old default)"
ROUND_2 = "round 2: 1 x coverage^0.5 (default before the heading)"
WITHOUT_SPELLING = "shipped default without spelling correction"


@pytest.fixture(scope="module")
def evaluation(minilm_dir):
    tool = _tool("eval_retrieval")
    engine = TextEmbeddingEngine(load_model_config(minilm_dir))
    engine.load()
    index = tool.build_index(engine)
    questions = tool.load_questions()
    vectors = engine.embed([q["question"] for q in questions])
    # The shipped default corrects misspelt words and embeds the corrected questions again, as the daemon does.
    speller = tool.speller_for(index, engine)
    yield tool, index, questions, vectors, (speller, engine.embed)
    engine.close()


def test_the_question_sets_cover_every_section_of_the_manual():
    sections = {p.id for p in split_file(CORPUS / "vibration-sensor-manual.md")}
    sets = {name: json.loads((CORPUS / name).read_text())["questions"] for name in
            ("questions.json", "questions-technician.json", "questions-holdout.json",
             "questions-paraphrase.json", "questions-paraphrase-holdout.json", "questions-paraphrase-blind.json",
             "questions-paraphrase-blind2.json", "questions-paraphrase-blind3.json",
             "questions-paraphrase-blind4.json", "questions-paraphrase-blind5.json")}
    for name, questions in sets.items():
        assert {q["passage"] for q in questions} <= sections, name
    for name in ("questions-technician.json", "questions-holdout.json", "questions-paraphrase.json",
                 "questions-paraphrase-holdout.json", "questions-paraphrase-blind.json",
                 "questions-paraphrase-blind2.json", "questions-paraphrase-blind3.json",
                 "questions-paraphrase-blind4.json", "questions-paraphrase-blind5.json"):
        assert {q["passage"] for q in sets[name]} == sections, name  # every passage asked about
    assert {q["split"] for q in sets["questions-technician.json"]} == {"dev", "test"}
    paraphrase = sets["questions-paraphrase.json"]
    assert len(paraphrase) >= 30 and {q["split"] for q in paraphrase} == {"dev", "test"}
    assert 2 * sum(q["split"] == "test" for q in paraphrase) >= len(paraphrase)  # at least half held out
    texts = [q["question"].lower() for questions in sets.values() for q in questions]
    assert len(set(texts)) == len(texts), "every question is new"


def _table(tool, index, questions, vectors, spelling) -> dict[str, dict[str, tuple[int, int, int]]]:
    """ranking -> question file -> (top-1, top-3, n)."""
    out: dict[str, dict[str, tuple[int, int, int]]] = {}
    files = sorted({q["file"] for q in questions})
    for name, rank in tool.rankings(DEFAULT_FUSION, *spelling).items():
        out[name] = {}
        for file in files:
            idx = [i for i, q in enumerate(questions) if q["file"] == file]
            top1, top3 = tool.top_hits(rank(index, vectors[idx], [questions[i]["question"] for i in idx]),
                                       [questions[i] for i in idx])
            out[name][file] = (top1, top3, len(idx))
            print(f"{name} / {file}: top-1 {top1}/{len(idx)}, top-3 {top3}")
    return out


def test_every_ranking_on_every_question_set(evaluation):
    tool, index, questions, vectors, spelling = evaluation
    table = _table(tool, index, questions, vectors, spelling)
    shipped = table[SHIPPED]
    # Measured (docs/rag.md): (top-1, top-3) of the shipped default per set.
    measured = {"questions.json": (10, 10), "questions-technician.json": (75, 79),
                "questions-paraphrase.json": (28, 33), "questions-holdout.json": (37, 38),
                "questions-paraphrase-holdout.json": (29, 31), "questions-paraphrase-blind.json": (34, 38),
                "questions-paraphrase-blind2.json": (28, 35), "questions-paraphrase-blind3.json": (35, 36),
                "questions-paraphrase-blind4.json": (38, 39), "questions-paraphrase-blind5.json": (28, 36)}
    for file, (top1, top3) in measured.items():
        got = shipped[file]
        assert got[0] >= top1 - 1 and got[1] >= top3 - 1, (file, got)
        # Correcting misspelt words never costs a question (it gains one on three files).
        assert got[0] >= table[WITHOUT_SPELLING][file][0], (file, got, table[WITHOUT_SPELLING][file])
    assert shipped["questions.json"][0] == 10  # the shipped ten stay first
    for file in measured:
        # The rule of issue 29: never below the best single method, and never below the old default.
        best_single = max(table[name][file][0] for name in SINGLE)
        assert shipped[file][0] >= best_single, (file, shipped[file], {n: table[n][file] for n in SINGLE})
        assert shipped[file][0] >= table[OLD][file][0], (file, shipped[file], table[OLD][file])
        # The heading signal's gain was chosen on the seen files; the second blind set, written after,
        # has round 2 one question above it (29 vs 28): not a rule there, a measurement (docs/rag.md).
        if file != "questions-paraphrase-blind2.json":
            assert shipped[file][0] >= table[ROUND_2][file][0], (file, shipped[file], table[ROUND_2][file])
    # Where the question's words are not the manual's, it gains over the old default (25 -> 28, 25 -> 29)
    # and over the default before the heading signal (25 -> 28, 28 -> 29).
    for file in ("questions-paraphrase.json", "questions-paraphrase-holdout.json"):
        assert shipped[file][0] > table[OLD][file][0]
        assert shipped[file][0] > table[ROUND_2][file][0]


def test_extractive_answers_quote_the_passage_ranked_first(evaluation):
    """Issue 29: the answer's text begins with a sentence of the passage ranked first. Measured on
    the 400 questions (docs/rag.md, "Extractive answers"): the passage it quotes first is the right
    one for 342, as often as retrieval ranks it first; quoting any of the three retrieved, 316 (on
    the first 360: 314 and 288)."""
    import dataclasses

    from edge_batcher.rag.settings import RagSettings

    tool, index, questions, vectors, (speller, embed) = evaluation
    shipped = RagSettings(min_score=0.2)  # engines/rag/model.toml's
    assert shipped.answer_passages == 1
    right = {}
    for label, settings in (("first", shipped), ("any", dataclasses.replace(shipped, answer_passages=3))):
        answer = tool.spelling_corrected(tool.answered(DEFAULT_FUSION, settings), speller, embed)
        ranked = answer(index, vectors, [q["question"] for q in questions])
        right[label] = [ids[:1] == [q["passage"]] for ids, q in zip(ranked, questions)]
    for file in sorted({q["file"] for q in questions}):
        mine = [i for i, q in enumerate(questions) if q["file"] == file]
        assert sum(right["first"][i] for i in mine) >= sum(right["any"][i] for i in mine), file
    print(f"answers quoting the right passage first: {sum(right['first'])} (any of three: {sum(right['any'])})")
    assert sum(right["first"]) >= 340 and sum(right["first"]) >= sum(right["any"]) + 20


def test_close_calls_are_marked_ambiguous(evaluation):
    """The first source's lead over the second predicts a wrong first passage: first passages marked
    ambiguous (a lead below 0.1) are wrong five times as often as the others, and most wrong first
    passages are marked. Measured on the 400 questions (docs/rag.md): 43 wrong of 115 flagged, 19 of
    285 others; 43 of the 62 wrong first passages flagged (on the first 360: 34 of 97, 15 of 263; on
    the first 320: 32 of 93, 15 of 227; on the first 280, at the old margin, 0.05: 15 wrong of 46 and
    26 of 234: 15 of 41 flagged)."""
    tool, index, questions, vectors, _ = evaluation
    rows = index.search_fused(vectors, [q["question"] for q in questions], 3, DEFAULT_FUSION)
    flagged = [row[0].passage.id == q["passage"] for q, row in zip(questions, rows) if row[0].ambiguous]
    clear = [row[0].passage.id == q["passage"] for q, row in zip(questions, rows) if not row[0].ambiguous]
    assert all(row[0].margin is not None and row[1].margin is None for row in rows)
    print(f"ambiguous: {flagged.count(False)} wrong of {len(flagged)}; others: {clear.count(False)} wrong "
          f"of {len(clear)}")
    wrong_flagged = flagged.count(False) / len(flagged)
    wrong_clear = clear.count(False) / len(clear)
    assert wrong_flagged >= 0.3 and wrong_clear <= 0.075 and wrong_flagged > 4 * wrong_clear
    assert flagged.count(False) >= 27 and len(flagged) <= 0.35 * len(questions)  # most wrong ones, a third at most


def test_the_lexical_weight_follows_the_questions_term_coverage():
    bm25 = Bm25.from_texts(["Tighten the M6 stud to 5 N·m.", "Regrease the bearings every 2000 hours."])
    assert bm25.coverage("m6 stud torque") < 1.0 < bm25.coverage("m6 stud") + 1e-9
    assert bm25.coverage("wobbly kiln") == 0.0 == bm25.coverage("the and of")
    assert 0.0 < bm25.coverage("regrease the wobbly kiln") < bm25.coverage("regrease the bearings") == 1.0
    dense, lexical = np.array([0.9, 0.5]), np.array([0.0, 3.0])
    query_aware = Fusion(coverage_exponent=0.5)
    np.testing.assert_allclose(fused_scores(dense, lexical, query_aware, coverage=1.0), [1.0, 1.0])  # full weight
    np.testing.assert_allclose(fused_scores(dense, lexical, query_aware, coverage=0.25), [1.0, 0.5])  # 1 x 0.25^0.5
    np.testing.assert_allclose(fused_scores(dense, lexical, query_aware, coverage=0.0), [1.0, 0.0])  # no share
    np.testing.assert_allclose(fused_scores(dense, lexical, Fusion(), coverage=0.25), [1.0, 1.0])  # fixed weight
    assert lead(np.array([2.0, 1.9, 0.0]), np.array([0, 1, 2])) == pytest.approx(0.05)
    assert lead(np.array([2.0]), np.array([0])) == 1.0


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
            rows.append(v / max(np.linalg.norm(v), 1e-12))  # a heading alone: no sentence, zero
        return np.array(rows, dtype=np.float32)

    vectors, sentences, headings = embed_passages(passages, embed)
    assert headings.shape == vectors.shape and not headings.any()
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
    np.testing.assert_array_equal(hits[0].sentence_vectors, [forklift_sentence])  # for extractive answers


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
    assert hits[0].sentence_vectors is None  # extractive answers embed the sentences


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


def test_the_query_aware_settings_are_read_and_checked(tmp_path):
    from edge_batcher.config import load_model_config
    from edge_batcher.errors import ConfigError
    from edge_batcher.rag.settings import fusion_from, rag_settings

    def settings(extra: str):
        (tmp_path / "model.toml").write_text(f'backend = "rag"\n[rag]\nembedding_model = "minilm"\n{extra}\n')
        return rag_settings(load_model_config(tmp_path))

    assert fusion_from(settings("")) == DEFAULT_FUSION
    fusion = fusion_from(settings("coverage_exponent = 0.0\nambiguous_margin = 0.2"))
    assert fusion.coverage_exponent == 0.0 and fusion.ambiguous_margin == 0.2
    for bad in ("coverage_exponent = -1", "ambiguous_margin = 1.5"):
        with pytest.raises(ConfigError, match="coverage_exponent must be >= 0 and ambiguous_margin in"):
            settings(bad)
    assert settings("").answer_passages == 1 and settings("answer_passages = 3").answer_passages == 3
    with pytest.raises(ConfigError, match="answer_sentences and answer_passages must be >= 1"):
        settings("answer_passages = 0")


# --------------------------------------------------------------------------- the heading signal (issue 29)


def test_the_heading_signal_is_one_more_normalised_cosine():
    dense = np.array([0.9, 0.8, 0.4])
    heading = np.array([0.3, 0.7, 0.1])  # min-max over the passages: [1/3, 1, 0]
    lexical = np.zeros(3)
    with_heading = Fusion(heading_weight=0.25)
    np.testing.assert_allclose(fused_scores(dense, lexical, with_heading, heading=heading),
                               [1.0 + 0.25 / 3, 0.8 + 0.25, 0.0])
    np.testing.assert_allclose(fused_scores(dense, lexical, with_heading, heading=None), [1.0, 0.8, 0.0])  # none stored
    np.testing.assert_allclose(fused_scores(dense, lexical, Fusion(), heading=heading), [1.0, 0.8, 0.0])  # weight 0
    assert DEFAULT_FUSION == Fusion(coverage_exponent=0.5, heading_weight=0.25)
    assert COVERAGE_ONLY.heading_weight == 0.0


def test_passages_of_one_heading_share_its_vector_and_one_without_keeps_its_own():
    passages = [Passage("m#a", "Manual > Battery", "Replace it."),
                Passage("m#a/2", "Manual > Battery", "Store it dry."),
                Passage("t#p1", "", "Plain text."), Passage("m#b", "Manual > Mounting", "Torque 5 N·m.")]
    assert heading_texts(passages) == (["Battery", "Mounting"], [0, 0, -1, 1])
    embedded: list[str] = []

    def embed(texts):
        embedded.extend(texts)
        return np.eye(len(texts), 16, dtype=np.float32)

    vectors, sentences, headings = embed_passages(passages, embed)
    assert embedded[-2:] == ["Battery", "Mounting"] and embedded.count("Battery") == 1  # once, in the same call
    np.testing.assert_array_equal(headings[0], headings[1])
    np.testing.assert_array_equal(headings[2], vectors[2])  # no heading: the passage's own vector
    assert not np.array_equal(headings[3], vectors[3])


def test_the_heading_tells_what_a_fault_looks_like_from_how_to_fix_it(evaluation):
    """Imbalance and Correcting imbalance share most of their words; the question asks about the
    cause, and only the headings alone differ in that."""
    tool, index, questions, vectors, _ = evaluation
    question = "what usually makes a fan wheel go out of balance?"  # questions-paraphrase-holdout.json
    n = next(i for i, q in enumerate(questions) if q["question"] == question)
    before = index.search_fused(vectors[n:n + 1], [question], 3, COVERAGE_ONLY)[0]
    after = index.search_fused(vectors[n:n + 1], [question], 3, DEFAULT_FUSION)[0]
    assert before[0].passage.id == "vibration-sensor-manual#correcting-imbalance" and before[0].heading is not None
    assert after[0].passage.id == "vibration-sensor-manual#imbalance"
    assert after[0].heading > next(h.heading for h in after if h.passage.id.endswith("#correcting-imbalance"))
    assert "heading" in after[0].to_json()


def _markdown(tmp_path, name: str, heading: str, text: str):
    path = tmp_path / name
    path.write_text(f"# {name}\n\n## {heading}\n\n{text}\n")
    return path


def test_heading_vectors_are_stored_and_follow_index_add_and_remove(tmp_path, minilm_dir):
    _, _, common = _two_files(tmp_path, minilm_dir, "unused")
    a = _markdown(tmp_path, "spares.md", "Spare parts", "The spare sensors are kept in cabinet B4.")
    b = _markdown(tmp_path, "keys.md", "Keys", "The forklift key hangs in the workshop office.")
    assert index_cli.main(["add", str(a), str(b), *common]) == 0
    meta = read_meta(tmp_path / "idx")
    assert "headings.npy" in meta["sha256"] and meta["headings"] == 2
    index = load_index(tmp_path / "idx")
    engine = TextEmbeddingEngine(load_model_config(minilm_dir))
    engine.load()
    try:
        expected = engine.embed(["Keys"])[0]
    finally:
        engine.close()
    row = [p.source for p in index.passages].index(str(b.resolve()))
    np.testing.assert_allclose(index.headings[row], expected, atol=1e-5)  # the heading alone, as a question is
    assert index_cli.main(["remove", str(a), *common]) == 0
    index = load_index(tmp_path / "idx")
    assert index.headings.shape == (1, index.dim)
    np.testing.assert_allclose(index.headings[0], expected, atol=1e-5)


def test_an_index_without_heading_vectors_loads_and_index_add_embeds_only_the_missing_headings(tmp_path, minilm_dir):
    from edge_batcher.rag.index_update import Document, add_documents

    index_dir = tmp_path / "idx"
    engine = TextEmbeddingEngine(load_model_config(minilm_dir))
    engine.load()
    embedded: list[str] = []

    def embed(texts):
        embedded.extend(texts)
        return engine.embed(texts)

    try:
        first = Document("spares.md", "# Store\n\n## Spare parts\n\nThe spare sensors are kept in cabinet B4. Ask the "
                                      "foreman for the key.\n")
        add_documents(index_dir, [first], embed, embedding_model="minilm", dim=engine.dim, max_chars=600)
        old = load_index(index_dir)
        write_index(index_dir, old.passages, old.embeddings, embedding_model="minilm",
                    sentences=old.sentences)  # as written before heading vectors
        assert not (index_dir / "headings.npy").exists()
        loaded = load_index(index_dir)
        assert loaded.headings is None
        hits = loaded.search_fused(old.embeddings[:1], ["spare sensors"], 1, DEFAULT_FUSION)[0]
        assert hits[0].heading is None and hits[0].sentence is not None  # ranked without the heading signal
        embedded.clear()
        second = Document("keys.md", "# Store\n\n## Keys\n\nThe forklift key hangs in the workshop office.\n")
        add_documents(index_dir, [second], embed, embedding_model="minilm", dim=engine.dim, max_chars=600)
    finally:
        engine.close()
    # the new passage, its sentence and heading; of the kept passage only its heading
    assert sorted(embedded) == sorted(["Keys\nThe forklift key hangs in the workshop office.",
                                       "Keys: The forklift key hangs in the workshop office.", "Keys", "Spare parts"])
    index = load_index(index_dir)
    assert index.headings.shape == (2, index.dim)
    np.testing.assert_array_equal(index.embeddings[0], old.embeddings[0])
    np.testing.assert_array_equal(index.sentences.vectors[:2], old.sentences.vectors)


def test_the_heading_weight_is_read_and_checked(tmp_path):
    from edge_batcher.config import load_model_config
    from edge_batcher.errors import ConfigError
    from edge_batcher.rag.settings import fusion_from, rag_settings

    (tmp_path / "model.toml").write_text('backend = "rag"\n[rag]\nembedding_model = "minilm"\nheading_weight = 0.0\n')
    assert fusion_from(rag_settings(load_model_config(tmp_path))) == COVERAGE_ONLY
    (tmp_path / "model.toml").write_text('backend = "rag"\n[rag]\nembedding_model = "minilm"\nheading_weight = -0.1\n')
    with pytest.raises(ConfigError, match="heading_weight"):
        rag_settings(load_model_config(tmp_path))
