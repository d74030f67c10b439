"""Sentences of a passage, as the embedding model sees them.

A passage is split into sentences (list items count as sentences; code blocks stay whole), and
each is embedded with its passage's heading in front ("Battery: Replace the battery when ..."),
so that "It can slip" still knows it is about magnet mounts. The index stores these sentence
vectors to score a passage by its best sentence (fusion.py); extractive answers rank the same
sentences against the question (extract.py), reading the stored vectors back by position: a
change to the split needs the indexes rebuilt (a new index.FORMAT).
"""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
_BULLET = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")


def split_sentences(text: str) -> list[str]:
    """The sentences of a passage's text, in order."""
    out: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        lines = paragraph.splitlines()
        items = lines if any(_BULLET.match(line) for line in lines) else [" ".join(lines)]
        for item in items:
            item = _BULLET.sub("", item).strip()
            parts = [item] if item.startswith(("```", "~~~")) else _SENTENCE_END.split(item)
            out.extend(part.strip() for part in parts if part.strip())
    return out


def heading(title: str) -> str:
    """A passage's own heading: the last part of its heading path."""
    return title.rsplit(" > ", 1)[-1]


def embed_text(title: str, sentence: str) -> str:
    """What is embedded for a sentence of the passage titled `title`."""
    h = heading(title)
    return f"{h}: {sentence}" if h else sentence
