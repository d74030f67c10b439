"""rag/spelling.py: a question's misspelt words become the corpus's words; known words, their
inflections, short words and words one edit from a corpus word of another first letter stay."""

from __future__ import annotations

from edge_batcher.rag.spelling import MAX_CORRECTIONS, Speller, tokenizer_words

CORPUS = ["Battery: replace the battery below 3.3 V.", "Stud mounting: tighten the stud to 5 N·m of torque.",
          "Bolts: check the base bolts.", "Vibration readings arrive every minute.", "Sensors on the gateway."]
GENERAL = frozenset({"how", "long", "does", "the", "last", "what", "puck", "volt", "hose", "for", "check"})


def test_misspelt_words_become_corpus_words():
    speller = Speller(GENERAL, CORPUS)
    assert speller.correct("how long does the batery last") == "how long does the battery last"  # deleted letter
    assert speller.correct("torqe for the stud") == "torque for the stud"
    assert speller.correct("Vibraton readings") == "vibration readings"  # lowercased: what the models read
    assert speller.correct("sesnors on the gatway") == "sensors on the gateway"  # swapped, deleted


def test_known_words_inflections_short_words_and_other_first_letters_stay():
    speller = Speller(GENERAL, CORPUS)
    for question in ("what puck", "check the hose",  # the tokenizer's words, though not the corpus's
                     "volts",  # an inflection of a known word, one edit from "bolts"
                     "tightened studs",  # inflections of corpus words
                     "stod",  # shorter than five letters
                     "wolts and vattery"):  # one edit from "bolts" and "battery", but another first letter
        assert speller.correct(question) == question


def test_the_work_per_question_is_bounded():
    speller = Speller(GENERAL, CORPUS)
    question = " ".join(["batery"] * (MAX_CORRECTIONS + 3))
    assert speller.correct(question).split().count("battery") == MAX_CORRECTIONS


def test_a_word_longer_than_any_corpus_word_is_not_looked_up(monkeypatch):
    """Its edits (~54 n strings of n letters) cannot reach a corpus word: a question of one
    2,000-letter word took 0.5 s and 230 MiB on a worker thread per question before."""
    from edge_batcher.rag import spelling

    speller = Speller(GENERAL, CORPUS)
    looked_up = []
    real = spelling._one_edit
    monkeypatch.setattr(spelling, "_one_edit", lambda word: looked_up.append(word) or real(word))
    longest = max(len(w) for w in speller.counts)  # "vibration": 9
    question = "x" * 2000 + " vibrationx " + "b" * (longest + 2) + " batery"
    assert speller.correct(question) == "x" * 2000 + " vibration " + "b" * (longest + 2) + " battery"
    assert looked_up == ["vibrationx", "batery"]  # one letter past the longest is still looked up


def test_tokenizer_words_takes_whole_words_only():
    vocab = ["[CLS]", "the", "##ing", "Ġbearing", "▁grease", "M6", "3", "é", "Hose"]
    assert tokenizer_words(vocab) == frozenset({"the", "bearing", "grease", "hose"})
