"""The rag model's settings: model.toml's [rag] table (and [rag.peer]), checked at load with
errors naming the key, and where its index lives. docs/rag.md lists the keys."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import ModelConfig, backend_settings
from ..errors import ConfigError
from .fusion import DEFAULT_FUSION, METHODS, MODES, Fusion
from .index import default_index_dir
from .peer import ChatPeerSettings
from .prompt import DEFAULT_PASSAGE_TEMPLATE, DEFAULT_TEMPLATE, check_template


@dataclass
class RagSettings:
    embedding_model: str = "minilm"
    index_dir: str = ""
    top_k: int = 3
    max_top_k: int = 20
    min_score: float = 0.0
    generator: str = ""
    prompt_template: str = DEFAULT_TEMPLATE
    passage_template: str = DEFAULT_PASSAGE_TEMPLATE
    max_question_chars: int = 2000
    max_rows: int = 8
    max_new_tokens: int = 0  # 0: the generator's own default
    retrieval: str = "hybrid"  # "hybrid" (dense + BM25, fused), "dense" or "lexical"
    fusion: str = DEFAULT_FUSION.method  # "minmax" (normalised scores added) or "rrf" (reciprocal rank fusion)
    dense_weight: float = DEFAULT_FUSION.dense_weight  # weight of the passage cosine
    sentence_weight: float = DEFAULT_FUSION.sentence_weight  # ... of the best sentence's cosine
    heading_weight: float = DEFAULT_FUSION.heading_weight  # ... of the cosine to the passage's heading alone
    lexical_weight: float = DEFAULT_FUSION.lexical_weight  # ... of BM25, times coverage ** coverage_exponent
    coverage_exponent: float = DEFAULT_FUSION.coverage_exponent  # 0: BM25's weight does not depend on the question
    rrf_k: float = DEFAULT_FUSION.rrf_k  # "rrf" only: rank offset; small values let the first places dominate
    answer_sentences: int = 2  # extractive answers: at most this many sentences ...
    sentence_margin: float = 0.1  # ... each within this cosine of the best one ...
    answer_passages: int = 1  # ... from the first this many passages retrieved (1: the one ranked first)
    ambiguous_margin: float = DEFAULT_FUSION.ambiguous_margin  # sources: first passage ambiguous below this lead
    correct_spelling: bool = True  # misspelt question words -> corpus words before retrieval (spelling.py)
    peer: ChatPeerSettings | None = None  # [rag.peer]: an OpenAI-compatible generation server


def fusion_from(s: RagSettings) -> Fusion:
    return Fusion(s.retrieval, s.dense_weight, s.lexical_weight, s.rrf_k, s.fusion, s.sentence_weight,
                  s.coverage_exponent, s.ambiguous_margin, s.heading_weight)


def rag_settings(config: ModelConfig) -> RagSettings:
    s = backend_settings(config, "rag", RagSettings)
    where = f"{config.directory / 'model.toml'}: [rag]"
    if s.answer_sentences < 1 or s.sentence_margin < 0 or s.answer_passages < 1:
        raise ConfigError(f"{where} answer_sentences and answer_passages must be >= 1 and sentence_margin >= 0")
    if s.peer is not None and not (s.peer.url and s.peer.model):
        raise ConfigError(f"{where}.peer: url and model are required (the chat-completions server and its model name)")
    if s.retrieval not in MODES:
        raise ConfigError(f"{where} retrieval: expected one of {', '.join(MODES)}, got {s.retrieval!r}")
    if s.fusion not in METHODS:
        raise ConfigError(f"{where} fusion: expected one of {', '.join(METHODS)}, got {s.fusion!r}")
    weights = (s.dense_weight, s.sentence_weight, s.lexical_weight, s.heading_weight)
    if min(weights) < 0 or sum(weights) <= 0 or s.rrf_k < 0:
        raise ConfigError(f"{where} dense_weight, sentence_weight, lexical_weight, heading_weight and rrf_k must be "
                          f">= 0 (and one weight > 0), got {s.dense_weight}, {s.sentence_weight}, {s.lexical_weight}, "
                          f"{s.heading_weight}, {s.rrf_k}")
    if s.coverage_exponent < 0 or not 0 <= s.ambiguous_margin <= 1:
        raise ConfigError(f"{where} coverage_exponent must be >= 0 and ambiguous_margin in [0, 1], "
                          f"got {s.coverage_exponent}, {s.ambiguous_margin}")
    if not 1 <= s.top_k <= s.max_top_k:
        raise ConfigError(f"{where} top_k: expected 1..max_top_k ({s.max_top_k}), got {s.top_k}")
    if s.max_rows <= 0 or s.max_question_chars <= 0:
        raise ConfigError(f"{where} max_rows and max_question_chars must be positive")
    if not s.embedding_model:
        raise ConfigError(f"{where} embedding_model: name the text-embedding model")
    check_template(s.prompt_template, where)
    return s


def index_dir_for(config: ModelConfig, settings: RagSettings | None = None) -> Path:
    """The rag model's index directory ([rag] index_dir, else the default)."""
    s = settings or rag_settings(config)
    if not s.index_dir:
        return default_index_dir()
    path = Path(s.index_dir)
    return path if path.is_absolute() else config.directory / path
