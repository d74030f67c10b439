"""Passages: text and markdown files split into the pieces the index embeds and searches.

Markdown is cut at headings (each passage's title is its heading path, e.g. "Manual > Bearing
faults"); a section's paragraphs are grouped into passages of at most max_chars characters (a
longer paragraph is cut at sentence ends, a longer sentence at spaces, and text without spaces
at max_chars itself: no passage is ever longer). Plain text is cut into paragraph groups the
same way; a heading is cut to max_chars too. The text that is embedded (and analysed for BM25)
is the passage's own heading plus the passage (`Passage.embed_text`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

DEFAULT_MAX_CHARS = 600  # ~130 tokens: about what a 128-token embedding model reads of a passage

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass
class Passage:
    id: str
    title: str
    text: str
    source: str = ""

    def embed_text(self) -> str:
        """What is embedded: the passage under its own heading (the document's title and the
        parent headings are the same for many passages and would only blur them)."""
        heading = self.title.rsplit(" > ", 1)[-1]
        return f"{heading}\n{self.text}" if heading else self.text


def slug(text: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s or "section"


def split_file(path: Path, max_chars: int = DEFAULT_MAX_CHARS) -> list[Passage]:
    """Passages of one .md/.markdown/.txt file (ids '<stem>#<heading-slug>', unique in the file)."""
    if max_chars < 1:
        raise ConfigError(f"the longest passage must be at least 1 character, got {max_chars}")
    suffix = path.suffix.lower()
    if suffix not in (".md", ".markdown", ".txt", ".text"):
        raise ConfigError(f"{path}: only text (.txt) and markdown (.md) files can be indexed")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it as UTF-8 text: {exc}") from None
    source = str(path.resolve())
    if suffix in (".md", ".markdown"):
        return split_markdown(text, path.stem, max_chars, source)
    return split_text(text, path.stem, max_chars, source)


def split_markdown(text: str, stem: str, max_chars: int = DEFAULT_MAX_CHARS, source: str = "") -> list[Passage]:
    sections: list[tuple[list[str], list[str]]] = []  # (heading path, paragraphs)
    path: list[str] = []
    paragraphs: list[str] = []
    lines: list[str] = []
    in_code = False

    def end_paragraph() -> None:
        if lines:
            paragraphs.append("\n".join(lines).strip())
            lines.clear()

    def end_section() -> None:
        end_paragraph()
        if any(paragraphs):
            sections.append((list(path), [p for p in paragraphs if p]))
        paragraphs.clear()

    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_code = not in_code
            lines.append(line)
            continue
        heading = None if in_code else _HEADING.match(line)
        if heading:
            end_section()
            level = len(heading.group(1))
            title = heading.group(2).strip()[:max_chars]
            path = path[: level - 1] + [""] * max(0, level - 1 - len(path)) + [title]
        elif not line.strip() and not in_code:
            end_paragraph()
        else:
            lines.append(line.rstrip())
    end_section()

    passages: list[Passage] = []
    used: set[str] = set()
    for heading_path, paras in sections:
        names = [h for h in heading_path if h]
        title = " > ".join(names) if names else stem
        base = f"{stem}#{slug(names[-1]) if names else 'preamble'}"
        for n, chunk in enumerate(_group(paras, max_chars)):
            pid = base if n == 0 else f"{base}/{n + 1}"
            pid = _unique(pid, used)
            passages.append(Passage(pid, title, chunk, source))
    return passages


def split_text(text: str, stem: str, max_chars: int = DEFAULT_MAX_CHARS, source: str = "") -> list[Passage]:
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    return [Passage(f"{stem}#p{n + 1}", stem, chunk, source) for n, chunk in enumerate(_group(paras, max_chars))]


def _group(paragraphs: list[str], max_chars: int) -> list[str]:
    """Consecutive paragraphs joined while they fit in max_chars; long ones cut at sentences,
    long sentences at spaces (_cut)."""
    pieces: list[str] = []
    for p in paragraphs:
        if len(p) <= max_chars:
            pieces.append(p)
        else:
            sentences = [piece for sentence in _SENTENCE_END.split(p) for piece in _cut(sentence, max_chars)]
            pieces.extend(_pack(sentences, " ", max_chars))
    return _pack(pieces, "\n\n", max_chars)


def _cut(text: str, max_chars: int) -> list[str]:
    """`text` in pieces of at most max_chars characters, each ending at the last whitespace
    before the limit when there is one in the piece's second half, else at the limit. Offsets
    into the text, never copies of its rest: a 2 MB line costs one pass."""
    pieces: list[str] = []
    start = 0
    while len(text) - start > max_chars:
        end = start + max_chars
        space = max(text.rfind(c, start + max_chars // 2, end + 1) for c in " \n\t")
        if space > start:
            pieces.append(text[start:space])
            start = space + 1
        else:
            pieces.append(text[start:end])
            start = end
    pieces.append(text[start:])
    return [piece.strip() for piece in pieces if piece.strip()]


def _pack(parts: list[str], separator: str, max_chars: int) -> list[str]:
    """Consecutive parts (each at most max_chars long) joined by separator while the result
    fits in max_chars."""
    packed: list[str] = []
    current = ""
    for part in parts:
        if current and len(current) + len(separator) + len(part) > max_chars:
            packed.append(current)
            current = part
        else:
            current = f"{current}{separator}{part}" if current else part
    if current:
        packed.append(current)
    return packed


def _unique(pid: str, used: set[str]) -> str:
    candidate, n = pid, 2
    while candidate in used:
        candidate = f"{pid}~{n}"
        n += 1
    used.add(candidate)
    return candidate
