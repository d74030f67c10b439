"""Text <-> token ids with the Hugging Face `tokenizers` library, from a local tokenizer.json.

A model's `[tokenizer]` table in model.toml names the file (relative to the model directory)
and the longest sequence the model takes. No network, no `transformers`: tokenizer.json is
the whole tokenizer (normaliser, pre-tokenizer, vocabulary, post-processor adding [CLS]/[SEP]).

    [tokenizer]
    file = "tokenizer.json"
    max_length = 128      # longer texts are truncated (embeddings) or rejected (prompts)
    max_chars = 0         # 0: 16 x max_length; longer texts are cut (embeddings) or rejected (prompts)
    add_special_tokens = true

Tokenizing costs about a microsecond per character whatever max_length is (the library
truncates only after tokenizing everything), so no text longer than max_chars characters is
ever tokenized: embedding texts are cut to it, prompts and questions beyond it are refused. 16
characters per token is three times what English text takes (docs/rag.md). Padding set in
tokenizer.json is switched off: batches are padded by the scheduler to their length bucket, and
the attention mask keeps the padding out of the result.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ModelConfig, backend_settings
from ..errors import ConfigError, InvalidInput


@dataclass
class TokenizerSettings:
    file: str = "tokenizer.json"
    max_length: int = 512
    max_chars: int = 0  # 0: CHARS_PER_TOKEN_BOUND x max_length
    add_special_tokens: bool = True


# The characters a tokenizer reads per token of max_length, unless [tokenizer] max_chars says
# otherwise: English prose takes 4 to 5 per token, whitespace-heavy markdown rarely 8.
CHARS_PER_TOKEN_BOUND = 16
UTF8_MAX_BYTES = 4  # the longest UTF-8 encoding of one character


class TextTokenizer:
    """A tokenizers.Tokenizer with the settings of one model. Thread-safe (the Rust tokenizer is)."""

    def __init__(self, path: Path, *, max_length: int = 512, max_chars: int = 0, add_special_tokens: bool = True):
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # an optional dependency: pip install 'edge-batcher[rag]'
            raise ConfigError(
                f"the tokenizers package is not installed ({exc}); pip install 'edge-batcher[rag]'"
            ) from exc
        if not path.is_file():
            raise ConfigError(f"tokenizer file {path} not found")
        if max_length <= 0:
            raise ConfigError(f"tokenizer {path}: max_length must be positive, got {max_length}")
        if max_chars < 0:
            raise ConfigError(f"tokenizer {path}: max_chars must be positive (or 0: the default), got {max_chars}")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception with its message
            raise ConfigError(f"tokenizer {path} cannot be loaded: {exc}") from exc
        self._tok.no_padding()
        self._tok.no_truncation()  # truncation is decided per call (embeddings truncate, prompts must fit)
        # A second instance that truncates, so no call ever changes a tokenizer's settings while
        # another thread encodes with it.
        self._truncating = Tokenizer.from_file(str(path))
        self._truncating.no_padding()
        self._truncating.enable_truncation(max_length)
        self.path = path
        self.max_length = max_length
        self.max_chars = max_chars or CHARS_PER_TOKEN_BOUND * max_length
        self.add_special_tokens = add_special_tokens

    @classmethod
    def from_model(cls, config: ModelConfig, default_max_length: int = 512) -> TextTokenizer:
        """The tokenizer of a model, from its [tokenizer] table (errors name file and key)."""
        s = backend_settings(config, "tokenizer", TokenizerSettings)
        if "max_length" not in config.tokenizer:
            s.max_length = default_max_length
        for key in ("max_length", "max_chars"):
            if getattr(s, key) < (1 if key == "max_length" else 0):
                raise ConfigError(f"{config.directory / 'model.toml'}: [tokenizer] {key}: "
                                  f"expected a positive integer, got {getattr(s, key)}")
        path = Path(s.file)
        if not path.is_absolute():
            path = config.directory / path
        if not path.is_file():
            raise ConfigError(f"{config.directory / 'model.toml'}: [tokenizer] file: {path} not found")
        return cls(path, max_length=s.max_length, max_chars=s.max_chars, add_special_tokens=s.add_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def vocabulary(self) -> list[str]:
        """Every token of the vocabulary, as text (rag/spelling.py takes its whole words)."""
        return list(self._tok.get_vocab())

    def encode(self, text: str, *, truncate: bool = False, special: bool | None = None) -> list[int]:
        """Token ids of one text. truncate=False leaves long texts whole (callers that need a
        limit check it and say so); truncate=True cuts at max_length, keeping the special tokens."""
        return self.encode_batch([text], truncate=truncate, special=special)[0]

    def encode_batch(self, texts: list[str], *, truncate: bool = False, special: bool | None = None) -> list[list[int]]:
        """Token ids of each text; truncate=True cuts at max_length with the library's truncation,
        so the closing special token ([SEP]) stays. Costs time in proportion to the characters:
        callers bound them first (max_chars)."""
        add = self.add_special_tokens if special is None else special
        tokenizer = self._truncating if truncate else self._tok
        return [list(enc.ids) for enc in tokenizer.encode_batch(texts, add_special_tokens=add)]

    def pad(self, rows: list[list[int]], length: int | None = None, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """input_ids and attention_mask, int64 [len(rows), length] (default: the longest row), right-padded."""
        length = length or max((len(r) for r in rows), default=0)
        ids = np.full((len(rows), length), pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), length), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
            mask[i, : len(r)] = 1
        return ids, mask

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces for streaming.

    Byte-level tokenizers split multi-byte characters across tokens, so a piece is emitted
    only once the text decoded so far no longer ends in an incomplete character (U+FFFD);
    pieces joined equal decode(all ids)."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""  # wait for the rest of the character (or a re-segmentation) before emitting
        piece = text[len(self.emitted):]
        self.emitted = text
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece


def texts_from_bytes(array: np.ndarray, name: str, max_chars: int, reader: str) -> list[str]:
    """The elements of a BYTES tensor as str (utf-8), each at most max_chars characters, or
    InvalidInput naming the input and the limit (`reader`: who reads the text, e.g. "model 'rag'").
    An element too long to hold so few characters is refused before it is decoded."""
    out = []
    for i, value in enumerate(array.reshape(-1).tolist()):
        where = f"input {name!r}: element {i}"
        if isinstance(value, bytes) and len(value) > UTF8_MAX_BYTES * max_chars:
            raise InvalidInput(f"{where} is {len(value)} bytes long (so over {max_chars} characters); "
                               f"{reader} reads at most {max_chars} characters")
        text = _text(value, where)
        if len(text) > max_chars:
            raise InvalidInput(f"{where} is {len(text)} characters long; {reader} reads at most {max_chars} characters")
        out.append(text)
    return out


def text_heads(array: np.ndarray, name: str, max_chars: int) -> list[str]:
    """text_head() of each element of a BYTES tensor (utf-8); InvalidInput naming the input
    when that part is not text. The rest of a longer element is not read."""
    out = []
    for i, value in enumerate(array.reshape(-1).tolist()):
        where = f"input {name!r}: element {i}"
        if isinstance(value, bytes) and len(value) > max_chars:
            # Enough bytes for max_chars characters; a character cut at the end waits in the
            # incremental decoder instead of failing.
            try:
                value = codecs.getincrementaldecoder("utf-8")().decode(value[:UTF8_MAX_BYTES * max_chars])
            except UnicodeDecodeError:
                raise InvalidInput(f"{where} is not valid UTF-8 text") from None
        out.append(text_head(_text(value, where), max_chars))
    return out


def text_head(text: str, max_chars: int) -> str:
    """The first max_chars characters of `text`, cut back to its last space when one is in
    their second half, so no word is split."""
    if len(text) <= max_chars:
        return text
    text = text[:max_chars]
    space = text.rfind(" ")
    return text[:space] if space > max_chars // 2 else text


def _text(value: object, where: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidInput(f"{where} is not valid UTF-8 text") from None
    if not isinstance(value, str):
        raise InvalidInput(f"{where} is {type(value).__name__}, expected text (BYTES)")
    return value
