"""A question's misspelt words, corrected to the corpus's own words before retrieval.

Technicians type fast: "vibraton", "batery", "presure". The embedding model splits such a
word into pieces that mean little, and BM25 does not find it at all, so the question is
ranked by its other words. A word is corrected only when it is unknown twice over: not a
whole word of the embedding model's tokenizer (an English vocabulary of ~20k words for
MiniLM, so "puck" or "hose" stay as they are), nor a word of the corpus, nor an inflection of
either ("greased", "studs"). It then becomes the most frequent corpus word one
edit away (a letter deleted, inserted, replaced, or two swapped) that starts with the same
letter (first letters are rarely mistyped; this keeps "volts" from "bolts"), if there is one.
Words shorter than five letters are left alone (too many neighbours), and so are words longer
than any corpus word by more than one letter (no one edit reaches a corpus word; the edits of a
word of n letters are ~54 n strings of n letters, so a 2,000-letter "word" in a question cost
0.5 s and 230 MiB), and at most `MAX_CORRECTIONS` words of a question are looked at, so the
work per question is bounded (~1 ms at most, ~75 us for a question with one typo).
docs/rag.md, "Misspelt questions", has the figures.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from .passages import Passage

MIN_LENGTH = 5
MAX_CORRECTIONS = 8  # unknown words looked up per question: ~60-120 us each (the service runs it off the loop)
_WORD = re.compile(r"[A-Za-z]+")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Inflections: a word whose base is known is known ("volts" -> "volt", "greased" -> "grease").
_SUFFIXES = (("s", ""), ("es", ""), ("ed", ""), ("ed", "e"), ("d", ""), ("ing", ""), ("ing", "e"), ("ly", ""),
             ("y", "e"), ("er", ""), ("ers", ""), ("est", ""))


def bases(word: str) -> list[str]:
    """What `word` may be an inflection of (at least three letters left)."""
    return [word[:-len(suffix)] + add for suffix, add in _SUFFIXES
            if word.endswith(suffix) and len(word) - len(suffix) >= 3]


def _one_edit(word: str) -> set[str]:
    splits = [(word[:i], word[i:]) for i in range(len(word) + 1)]
    return ({a + b[1:] for a, b in splits if b}
            | {a + b[1] + b[0] + b[2:] for a, b in splits if len(b) > 1}
            | {a + c + b[1:] for a, b in splits if b for c in _LETTERS}
            | {a + c + b for a, b in splits for c in _LETTERS})


def tokenizer_words(vocabulary: Iterable[str]) -> frozenset[str]:
    """The whole words of a tokenizer's vocabulary, lowercased (WordPiece continuations "##x"
    left out; byte-level BPE's word-start marks "Ġ" and "▁" taken off)."""
    words = set()
    for token in vocabulary:
        token = token.lstrip("Ġ▁")
        if token.isascii() and token.isalpha():
            words.add(token.lower())
    return frozenset(words)


class Speller:
    def __init__(self, general: frozenset[str], corpus_texts: Iterable[str]):
        self.counts = Counter(w.lower() for text in corpus_texts for w in _WORD.findall(text))
        self._known = general | set(self.counts) | {b for w in self.counts for b in bases(w)}
        self._longest = max(map(len, self.counts), default=0) + 1  # one insertion past the longest

    @classmethod
    def for_index(cls, general: frozenset[str], passages: Iterable[Passage]) -> Speller:
        """The speller of an index: its passages as they are embedded (heading and text)."""
        return cls(general, (p.embed_text() for p in passages))

    def correct(self, question: str) -> str:
        """`question` with its misspelt words replaced; the same string when none is."""
        budget = [MAX_CORRECTIONS]

        def replace(match: re.Match) -> str:
            word = match.group(0)
            lowered = word.lower()
            if not MIN_LENGTH <= len(lowered) <= self._longest or lowered in self._known or not budget[0]:
                return word
            if any(base in self._known for base in bases(lowered)):
                return word
            budget[0] -= 1
            candidates = [c for c in _one_edit(lowered) if c[0] == lowered[0] and c in self.counts]
            return max(candidates, key=lambda c: (self.counts[c], c)) if candidates else word

        return _WORD.sub(replace, question)
