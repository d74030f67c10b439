"""TextEmbeddingEngine: an ONNX sentence-embedding model that takes text.

Clients send `text` BYTES [batch] and get `embedding` FP32 [batch, dim]. The engine's
prepare() hook (called for the ModelRunner on the model's prepare thread before the request is
queued, scheduler/preparing.py) tokenizes the texts into `input_ids` / `attention_mask` [rows,
longest]; the runner then queues the request in the length bucket of its longest text and pads
whole batches to the bucket with the model's `[sequence]` settings. The model's attention mask
keeps padding out of the result, so a text's embedding does not depend on the bucket or on its
batch neighbours (tools/build_embedding_model.py checks this for the demo model).

Texts longer than `[tokenizer] max_length` tokens are truncated (as sentence-transformers
does): an embedding of the first max_length tokens. Since tokenizing costs time per character,
a text is first cut to `[tokenizer] max_chars` characters (default 16 per token of max_length,
rag/tokenize.py): what follows is never read.

model.toml::

    backend = "edge_batcher.rag.embed:TextEmbeddingEngine"
    [sequence]
    inputs = ["input_ids", "attention_mask"]
    axis = 1
    buckets = [16, 32, 64, 128]
    [tokenizer]
    file = "tokenizer.json"
    max_length = 128
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from ..config import ModelConfig
from ..engines.onnxruntime import OnnxRuntimeEngine
from ..errors import ConfigError
from ..types import TensorSpec
from .tokenize import TextTokenizer, text_head, text_heads

TEXT_INPUT = "text"


class TextEmbeddingEngine(OnnxRuntimeEngine):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.tokenizer: TextTokenizer | None = None
        self.batch_inputs: list[TensorSpec] = []
        self.dim = 0
        self._tokens_lock = threading.Lock()
        self.real_tokens = 0  # token slots holding text, in batches the engine ran
        self.padded_tokens = 0  # all token slots of those batches (rows x bucket)

    def load(self) -> None:
        super().load()
        where = f"{self.config.directory / 'model.toml'}"
        names = {spec.name for spec in self.inputs}
        if not {"input_ids", "attention_mask"} <= names:
            raise ConfigError(f"{where}: a text embedding model needs inputs input_ids and attention_mask, "
                              f"{self.config.model_path} has {', '.join(sorted(names))}")
        self.has_token_types = "token_type_ids" in names
        seq = self.config.sequence
        if seq is None or not {"input_ids", "attention_mask"} <= set(seq.inputs):
            raise ConfigError(f"{where}: [sequence] inputs must name input_ids and attention_mask "
                              "(the scheduler pads them to the length buckets)")
        if len(self.outputs) != 1 or len(self.outputs[0].shape) != 2:
            raise ConfigError(f"{where}: expected one output [batch, dim], the model has "
                              + ", ".join(f"{o.name}{list(o.shape)}" for o in self.outputs))
        self.tokenizer = TextTokenizer.from_model(self.config, default_max_length=seq.buckets[-1])
        # The tokenizers library starts its (process-wide) thread pool on the first batch:
        # start it here, where the loading thread may use every CPU (load_runner), rather than
        # later from the event loop, whose CPU the pool would inherit (cpu_affinity.py).
        self.tokenizer.encode_batch(["warm-up", "warm-up"])
        if self.tokenizer.max_length > seq.buckets[-1]:
            raise ConfigError(f"{where}: [tokenizer] max_length {self.tokenizer.max_length} is longer than "
                              f"the largest [sequence] bucket {seq.buckets[-1]}")
        self.batch_inputs = self.inputs
        self.dim = self.outputs[0].shape[1]
        self.inputs = [TensorSpec(TEXT_INPUT, "BYTES", (-1,))]
        out = self.outputs[0]
        self.outputs = [TensorSpec(out.name, out.datatype, (-1, self.dim))]

    def prepare(self, inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        """text [rows] -> input_ids, attention_mask [rows, longest] (+ token_type_ids). On the
        model's prepare thread: at most max_chars characters of each text are decoded and tokenized."""
        assert self.tokenizer is not None, "prepare() before load()"
        texts = text_heads(inputs[TEXT_INPUT], TEXT_INPUT, self.tokenizer.max_chars)
        ids, mask = self.tokenizer.pad(self.tokenizer.encode_batch(texts, truncate=True))
        prepared = {"input_ids": ids, "attention_mask": mask}
        if self.has_token_types:
            prepared["token_type_ids"] = np.zeros_like(ids)
        return prepared, ids.shape[1]

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        mask = inputs["attention_mask"]
        real = int(mask.sum())
        if real:  # warm-up batches are all padding: not counted
            with self._tokens_lock:
                self.real_tokens += real
                self.padded_tokens += mask.size
        return super().infer(inputs)

    def token_padding(self) -> dict:
        """Token-level padding waste of the batches run so far (the core's padding_ratio counts rows)."""
        with self._tokens_lock:
            real, total = self.real_tokens, self.padded_tokens
        return {"real_tokens": real, "batch_tokens": total,
                "token_padding_ratio": (total - real) / total if total else 0.0}

    def embed(self, texts: list[str], batch_size: int = 16,
              progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """Embed many texts directly (no scheduler: index building). Blocking. Texts are taken
        in order of length, so each chunk pads little, and tokenized a chunk at a time, so only
        one chunk's tokens are held; returned in the original order. `progress(done, total)` is
        called after each chunk."""
        assert self.tokenizer is not None, "embed() before load()"
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # characters: a cheap proxy for tokens
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            heads = [text_head(texts[i], self.tokenizer.max_chars) for i in chunk]  # as prepare() cuts them
            ids, mask = self.tokenizer.pad(self.tokenizer.encode_batch(heads, truncate=True))
            feed = {"input_ids": ids, "attention_mask": mask}
            if self.has_token_types:
                feed["token_type_ids"] = np.zeros_like(ids)
            out[chunk] = super().infer(feed)[self.outputs[0].name]
            if progress is not None:
                progress(start + len(chunk), len(texts))
        return out
