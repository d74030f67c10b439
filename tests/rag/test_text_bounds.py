"""The character bounds every text passes before it is tokenized (rag/tokenize.py): embedding
texts cut to max_chars without reading the rest, prompts and questions refused by their byte
length before they are decoded. The end-to-end proof over every door is
test_text_doors_keep_loop_free.py; these pin the edges of the cut."""

from __future__ import annotations

import numpy as np
import pytest

from edge_batcher.errors import ConfigError, InvalidInput
from edge_batcher.rag.tokenize import CHARS_PER_TOKEN_BOUND, TextTokenizer, text_heads, texts_from_bytes


def texts(*values) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def test_a_long_text_is_cut_at_max_chars_back_to_its_last_space():
    (head,) = text_heads(texts(("word " * 1000).encode()), "text", 102)
    assert head == ("word " * 20).rstrip() and len(head) == 99
    # No space in the second half: cut at the bound itself.
    (head,) = text_heads(texts(b"x" * 5000), "text", 100)
    assert head == "x" * 100


def test_a_character_cut_in_its_bytes_does_not_fail_and_what_follows_the_head_is_never_read():
    # 3-byte characters: the 4 x max_chars bytes decoded end inside one.
    (head,) = text_heads(texts("\u20ac".encode() * 1000 + b"\xff"), "text", 100)
    assert head == "\u20ac" * 100
    with pytest.raises(InvalidInput, match="input 'text': element 1 is not valid UTF-8 text"):
        text_heads(texts(b"fine", b"\xff" + b"x" * 5000), "text", 100)
    assert text_heads(texts("short", b"ok"), "text", 100) == ["short", "ok"]


def test_a_prompt_over_the_bound_is_refused_by_its_bytes_before_it_is_decoded():
    invalid_and_long = b"\xff" * 401  # never decoded: its length alone refuses it
    with pytest.raises(InvalidInput) as info:
        texts_from_bytes(texts(b"ok", invalid_and_long), "text_input", 100, "model 'gen'")
    assert str(info.value) == ("input 'text_input': element 1 is 401 bytes long (so over 100 characters); "
                               "model 'gen' reads at most 100 characters")
    with pytest.raises(InvalidInput, match="element 0 is 101 characters long; model 'gen' reads at most 100"):
        texts_from_bytes(texts("\u20ac" * 101), "text_input", 100, "model 'gen'")
    assert texts_from_bytes(texts("\u20ac" * 100), "text_input", 100, "model 'gen'") == ["\u20ac" * 100]


@pytest.fixture
def tokenizer_file(minilm_dir):
    return minilm_dir / "tokenizer.json"


def test_max_chars_defaults_to_16_characters_a_token_and_must_not_be_negative(tokenizer_file):
    assert TextTokenizer(tokenizer_file, max_length=128).max_chars == CHARS_PER_TOKEN_BOUND * 128 == 2048
    assert TextTokenizer(tokenizer_file, max_length=128, max_chars=500).max_chars == 500
    with pytest.raises(ConfigError, match="max_chars must be positive"):
        TextTokenizer(tokenizer_file, max_length=128, max_chars=-1)


def test_truncating_keeps_the_closing_special_token_in_one_pass(tokenizer_file):
    tok = TextTokenizer(tokenizer_file, max_length=16)
    (ids,) = tok.encode_batch(["the bearing fault shows as a peak " * 10], truncate=True)
    (whole,) = tok.encode_batch(["the bearing fault shows as a peak " * 10])
    assert len(ids) == 16 and ids[:15] == whole[:15] and ids[-1] == whole[-1]  # [CLS] ... [SEP]
