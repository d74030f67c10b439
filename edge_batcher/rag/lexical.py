"""Lexical retrieval: Okapi BM25 over the passages, in pure Python and numpy.

Dense embeddings find paraphrases but blur exact terms (part numbers, "M6", "BPFO", "RSSI",
"ISO 10816"); BM25 finds exact terms but no paraphrases. The index keeps both and the RAG
service fuses the two rankings (fusion.py).

The analyzer is deliberately plain and language-generic: lowercase, split at anything that is
not a letter or digit, drop a short list of English function words, and strip a few
inflection suffixes ("bearings" -> "bearing", "tightening" -> "tighten") so that a question's
word form need not match the manual's. Its name goes into the stored file; an index written
with another analyzer is re-analysed when it is loaded.

Scoring (Lucene's BM25): for each query term t in passage d,
``idf(t) * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(d) / avg_len))`` with
``idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5))``. Stored per passage are its term counts (the
statistics follow from them), in ``lexical.json`` next to the embeddings.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np

ANALYZER = "words-lower-stop-suffix-v2"
DEFAULT_K1 = 1.2
DEFAULT_B = 0.75

_WORD = re.compile(r"[^\W_]+", re.UNICODE)
# English function words and question words: they carry no topic, and questions are full of them.
STOP_WORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being
below between both but by can could did do does doing down during each few for from further had has
have having he her here hers him his how i if in into is it its itself just me more most my no nor
not now of off on once only or other our out over own same she should so some such than that the
their them then there these they this those through to too under until up very was we were what
when where which while who whom why will with would you your yours shall may might must
get gets got need needs want wants thing things one's i'm it's dont don't cant can't whats
""".split())


def stem(word: str) -> str:
    """A light, rule-based suffix strip (no dictionary), plural first, then -ing/-ed, then a final
    e: "bearings" and "bearing" -> "bear"; "regrease", "regreased", "regreasing" -> "regreas"."""
    if len(word) > 4 and word.endswith("ies"):
        word = word[:-3] + "y"
    elif len(word) > 4 and word.endswith("es") and not word.endswith(("ses", "xes")):
        word = word[:-1]
    elif len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    if len(word) > 5 and word.endswith("ing"):
        word = _undouble(word[:-3])
    elif len(word) > 4 and word.endswith("ed"):
        word = _undouble(word[:-2])
    if len(word) > 4 and word.endswith("e"):
        word = word[:-1]
    return word


def _undouble(word: str) -> str:
    # "stopped" -> "stopp" -> "stop"; but not "fall" -> "fal"
    if len(word) > 3 and word[-1] == word[-2] and word[-1] not in "lsz":
        return word[:-1]
    return word


def analyze(text: str) -> list[str]:
    """The terms of a text, in order (repeats kept: they are the term frequencies)."""
    return [stem(w) for w in _WORD.findall(text.lower()) if w not in STOP_WORDS]


class Bm25:
    """BM25 over a fixed list of documents (term counts per document)."""

    def __init__(self, counts: list[dict[str, int]], k1: float = DEFAULT_K1, b: float = DEFAULT_B):
        self.counts = counts
        self.k1 = k1
        self.b = b
        n = len(counts)
        lengths = np.array([sum(c.values()) for c in counts], dtype=np.float64)
        avg = float(lengths.mean()) if n and lengths.mean() > 0 else 1.0
        self._norm = k1 * (1.0 - b + b * lengths / avg)  # per-document length normalisation
        postings: dict[str, tuple[list[int], list[int]]] = {}
        for doc, c in enumerate(counts):
            for term, tf in c.items():
                docs, tfs = postings.setdefault(term, ([], []))
                docs.append(doc)
                tfs.append(tf)
        self._postings = {t: (np.array(d, dtype=np.int64), np.array(f, dtype=np.float64))
                          for t, (d, f) in postings.items()}
        self._idf = {t: math.log(1.0 + (n - len(d) + 0.5) / (len(d) + 0.5)) for t, (d, _) in self._postings.items()}
        self._unknown_idf = math.log(1.0 + (n + 0.5) / 0.5)  # what a term in no passage would weigh

    @classmethod
    def from_texts(cls, texts: list[str], k1: float = DEFAULT_K1, b: float = DEFAULT_B) -> Bm25:
        return cls([dict(Counter(analyze(t))) for t in texts], k1, b)

    def __len__(self) -> int:
        return len(self.counts)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for `query` (0 where no query term occurs)."""
        out = np.zeros(len(self.counts), dtype=np.float64)
        for term, qtf in Counter(analyze(query)).items():
            posting = self._postings.get(term)
            if posting is None:
                continue
            docs, tf = posting
            out[docs] += qtf * self._idf[term] * tf * (self.k1 + 1.0) / (tf + self._norm[docs])
        return out

    def coverage(self, query: str) -> float:
        """The idf-weighted share of the query's distinct terms that occur in some passage, in
        [0, 1] (0 for a query with no terms). A term in no passage weighs as an idf at df = 0, more
        than any known term: a question whose content words the manual never uses scores low."""
        weights = [(self._idf.get(t, self._unknown_idf), t in self._idf) for t in set(analyze(query))]
        total = sum(w for w, _ in weights)
        return sum(w for w, known in weights if known) / total if total else 0.0

    def to_json(self) -> dict:
        return {"analyzer": ANALYZER, "k1": self.k1, "b": self.b, "counts": self.counts}

    @classmethod
    def from_json(cls, data: dict) -> Bm25:
        return cls([dict(c) for c in data["counts"]],
                   float(data.get("k1", DEFAULT_K1)), float(data.get("b", DEFAULT_B)))
