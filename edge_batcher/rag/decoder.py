"""A decoder LLM in the Hugging Face Optimum ONNX layout, and the KV cache of a running batch.

Optimum's `text-generation-with-past` export (optimum-cli export onnx --task
text-generation-with-past) has::

    inputs   input_ids [batch, seq], attention_mask [batch, past + seq], position_ids [batch, seq]
             (most architectures), past_key_values.N.key / .value [batch, kv_heads, past, head_dim]
             (and use_cache_branch [1] in "merged" exports)
    outputs  logits [batch, seq, vocab], present.N.key / .value [batch, kv_heads, past + seq, head_dim]

A second layout, written by tools/build_smollm2.py (the default there), keeps the cache in
place: inputs ``input_ids``, ``seqlens_k`` INT32 [batch] (each row's length after this run, less
one: ONNX Runtime's GroupQueryAttention convention) and ``total_sequence_length`` INT32 [] instead
of attention_mask and position_ids, and past_key_values.N / present.N of [batch, kv_heads,
max_sequence_length, head_dim] bound to the same buffers (kv_slots.SlotCache), so a step writes
one token per row and copies nothing.

In the Optimum layout the batch is kept LEFT-padded: every row's tokens end at the last column,
so one decode step appends one column for all rows. A row's padding columns have attention_mask 0 (the model
gives them zero attention weight) and its position ids count only its real tokens, so a row
computes what it would compute alone; only floating-point rounding of the batched matmuls
differs. Sequences joining are prefilled on their own (batch 1, no padding) and their cache is
padded to the batch's width and concatenated; rows that finish are dropped at once and the
columns that became padding for every remaining row are trimmed.

Thread: a Decoder and its BatchCache are used by the generation worker thread only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..engines.onnxruntime import OnnxRuntimeEngine
from ..engines.ort_graphs import older_than
from ..errors import ConfigError
from .kv import COLUMN_STEP, DTYPE_BYTES, CacheFootprint, KvShape, round_up
from .kv_slots import SlotCache

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_ORT_FLOAT = {"FP32": np.float32, "FP16": np.float16}
# ONNX Runtime's CPU GroupQueryAttention computes the in-place layout right since 1.20: 1.18 and
# 1.19 accept a prompt's later chunks (and the builders' checks) and give wrong logits.
IN_PLACE_SINCE = (1, 20)


def in_place_refused(version: str) -> str | None:
    """Why this onnxruntime cannot run the in-place layout, or None if it can."""
    if not older_than(version, IN_PLACE_SINCE):
        return None
    return (f"onnxruntime {version} computes it wrong (GroupQueryAttention needs "
            f"{'.'.join(map(str, IN_PLACE_SINCE))} or newer)")


@dataclass
class BatchCache:
    """The running batch's KV cache, left-padded: past[2*layer + (0 key | 1 value)] is
    [rows, kv_heads, width, head_dim]; mask [rows, width]; positions [rows] = the next
    position of each row (its number of real tokens)."""

    past: list[np.ndarray]
    mask: np.ndarray
    positions: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.past)

    def join(self, new: BatchCache) -> BatchCache:
        """The batch with `new`'s rows appended (last), both left-padded to the wider width,
        written straight into the joined arrays (no padded copy of the batch first)."""
        width, n = max(self.width, new.width), self.rows
        past = []
        for mine, theirs in zip(self.past, new.past):
            joined = np.zeros((n + new.rows, mine.shape[1], width, mine.shape[3]), dtype=mine.dtype)
            joined[:n, :, width - self.width:] = mine
            joined[n:, :, width - new.width:] = theirs
            past.append(joined)
        mask = np.zeros((n + new.rows, width), dtype=np.int64)
        mask[:n, width - self.width:] = self.mask
        mask[n:, width - new.width:] = new.mask
        return BatchCache(past, mask, np.concatenate([self.positions, new.positions]))

    def keep(self, rows: list[int]) -> BatchCache | None:
        """Only the given rows (in that order), with the columns now padding for all of them trimmed."""
        if not rows:
            return None
        index = np.asarray(rows, dtype=np.int64)
        mask = self.mask[index]
        used = np.flatnonzero(mask.any(axis=0))
        start = int(used[0]) if used.size else mask.shape[1]
        # one fancy index over rows and columns at once: copies only what is kept
        return BatchCache([p[index, :, start:] for p in self.past], mask[:, start:], self.positions[index])


KvCache = BatchCache | SlotCache


class Decoder:
    def __init__(self, config: ModelConfig, kv_heads: int = 0, head_dim: int = 0, max_context: int = 2048):
        self.config = config
        self.engine = OnnxRuntimeEngine(config)
        self._kv_heads_override = kv_heads
        self._head_dim_override = head_dim
        self.max_context = max_context
        self.kv: KvShape | None = None
        self.vocab = 0
        self.shared_kv = False

    def load(self) -> None:
        """Load the session and read the KV layout from its inputs. Blocking."""
        self.engine.load()
        try:
            self._read_layout()
        except ConfigError:
            self.engine.close()  # a model the decoder cannot run does not keep its session
            raise
        if not self.shared_kv and self.engine.providers[:1] == ["CPUExecutionProvider"]:
            # Optimum's layout gets its cache back from ONNX Runtime as new tensors, one size
            # larger every step: in the CPU arena they left a high-water mark hundreds of MiB
            # above the KV reservation that never came back (docs/rag.md, "KV memory").
            self.engine.reopen_without_cpu_arena()

    def _read_layout(self) -> None:
        where = f"{self.config.directory / 'model.toml'}"
        specs = {s.name: s for s in self.engine.inputs}
        self.shared_kv = "seqlens_k" in specs
        needed = ["input_ids"] + (["seqlens_k", "total_sequence_length"] if self.shared_kv else ["attention_mask"])
        for name in needed:
            if name not in specs:
                raise ConfigError(f"{where}: {self.config.model_path} is not a decoder export of a known layout: "
                                  f"no input {name!r} (inputs: {', '.join(specs)}; docs/rag.md)")
        if self.shared_kv:
            import onnxruntime as ort

            why = in_place_refused(ort.__version__)
            if why:
                raise ConfigError(f"{where}: {self.config.model_path} keeps its KV cache in place (seqlens_k), and "
                                  f"{why}: upgrade onnxruntime, or build the model with --kv-layout optimum")
        if self.shared_kv and self.engine.providers[:1] != ["CPUExecutionProvider"]:
            raise ConfigError(f"{where}: {self.config.model_path} keeps its KV cache in place (seqlens_k), which "
                              f"edge-batcher binds in host memory: run it on the CPUExecutionProvider (providers now: "
                              f"{', '.join(self.engine.providers)}), or build it with --kv-layout optimum")
        layers = sorted({int(m.group(1)) for n in specs if (m := _PAST.match(n))})
        if not layers or layers != list(range(len(layers))):
            raise ConfigError(f"{where}: {self.config.model_path} has no past_key_values.N.key/value inputs: export it "
                              "with --task text-generation-with-past")
        first = specs["past_key_values.0.key"]
        if len(first.shape) != 4:
            raise ConfigError(f"{where}: past_key_values.0.key has shape {list(first.shape)}, expected "
                              "[batch, kv_heads, past, head_dim]")
        kv_heads = self._kv_heads_override or first.shape[1]
        head_dim = self._head_dim_override or first.shape[3]
        if kv_heads <= 0 or head_dim <= 0:
            raise ConfigError(f"{where}: the model does not fix kv_heads/head_dim in past_key_values.0.key "
                              f"{list(first.shape)}; set [generator] kv_heads and head_dim")
        dtype = _ORT_FLOAT.get(first.datatype)
        if dtype is None:
            raise ConfigError(f"{where}: past_key_values are {first.datatype}; FP32 and FP16 are supported")
        self.dtype = np.dtype(dtype)
        self.kv = KvShape(len(layers), kv_heads, head_dim, DTYPE_BYTES[self.dtype.name])
        self.has_positions = "position_ids" in specs
        self.has_logits_from = "logits_from" in specs  # the builders' graphs (not Optimum's) can skip logits
        self.has_cache_branch = "use_cache_branch" in specs
        outputs = {s.name for s in self.engine.outputs}
        missing = [n for n in ["logits"] + [f"present.{i}.{k}" for i in layers for k in ("key", "value")]
                   if n not in outputs]
        if missing:
            raise ConfigError(f"{where}: {self.config.model_path} lacks outputs {', '.join(missing)}")
        logits = next(s for s in self.engine.outputs if s.name == "logits")
        self.vocab = logits.shape[-1] if logits.shape[-1] > 0 else 0
        self._past_names = [f"past_key_values.{i}.{k}" for i in layers for k in ("key", "value")]
        self._present_names = [f"present.{i}.{k}" for i in layers for k in ("key", "value")]

    def close(self) -> None:
        self.engine.close()

    def footprint(self) -> CacheFootprint:
        """How much this decoder's batches hold (after load)."""
        assert self.kv is not None
        return CacheFootprint(self.kv, self.shared_kv, self.max_context)

    def logits_bytes(self, rows: int = 0, prefill_tokens: int = 0) -> int:
        """The float32 logits over the vocabulary of the larger of a decode step of `rows` rows
        and a prefill run of `prefill_tokens` tokens: one position of the run's with
        `logits_from`, every one without (an Optimum export: 128 x 49,152 x 4 B = 24 MiB for
        SmolLM2's chunk, 78 MiB with Qwen2.5's vocabulary)."""
        positions = (1 if self.has_logits_from else prefill_tokens) if prefill_tokens else 0
        return 4 * self.vocab * max(rows, positions)

    @property
    def weights_bytes(self) -> int:
        try:
            return self.config.model_path.stat().st_size
        except OSError:
            return 0

    # ------------------------------------------------------------------ runs

    def _run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: list[np.ndarray],
             logits_from: int = 0):
        feed = {"input_ids": ids, "attention_mask": mask}
        if self.has_logits_from:
            feed["logits_from"] = np.array(logits_from, dtype=np.int64)
        if self.has_positions:
            feed["position_ids"] = positions
        if self.has_cache_branch:
            feed["use_cache_branch"] = np.array([past[0].shape[2] > 0])
        feed.update(zip(self._past_names, past))
        out = self.engine.infer(feed)
        return out["logits"], [out[n] for n in self._present_names]

    def _run_in_place(self, ids: np.ndarray, cache: SlotCache, logits_from: int = 0) -> np.ndarray:
        """One run of the shared layout over the cache's running rows; their lengths advance."""
        binding = bind_in_place(self.engine.session, ids, cache.lengths, cache.views(), self.vocab,
                                logits_from if self.has_logits_from else None)
        self.engine.run_binding(binding.binding)
        cache.lengths = cache.lengths + ids.shape[1]
        return binding.logits

    def _new_slots(self, rows: int, columns: int) -> SlotCache:
        assert self.kv is not None
        columns = max(columns, min(round_up(columns + 1, COLUMN_STEP), self.max_context))  # room to decode
        return SlotCache(self.kv.layers, self.kv.kv_heads, self.kv.head_dim, self.dtype, rows, columns,
                         self.max_context)

    def empty_past(self, rows: int) -> list[np.ndarray]:
        assert self.kv is not None
        return [np.zeros((rows, self.kv.kv_heads, 0, self.kv.head_dim), dtype=self.dtype)
                for _ in self._past_names]

    def prefill(self, prompt: list[int], all_logits: bool = False) -> tuple[np.ndarray, KvCache]:
        """Run one prompt alone (batch 1, no padding, no past): its cache, and the logits of its
        last position [1, vocab] (which choose the first new token), or with `all_logits` (or a
        model without the `logits_from` input) of every position [len, vocab]."""
        return self.extend(None, prompt, all_logits=all_logits)

    def extend(self, cache: KvCache | None, tokens: list[int], room: int = 0,
               all_logits: bool = False) -> tuple[np.ndarray, KvCache]:
        """Feed one sequence (a one-row cache, or None to start one) several more tokens: a
        prompt in chunks computes what it computes whole. Logits as prefill()'s, of the tokens
        fed. `room`: the whole prompt's length when this is its first chunk (the buffers are
        sized once)."""
        n = len(tokens)
        ids = np.asarray([tokens], dtype=np.int64)
        logits_from = 0 if all_logits or not self.has_logits_from else n - 1
        if self.shared_kv:
            if cache is None:
                cache = self._new_slots(1, max(n, room))
                cache.lengths = np.zeros(1, dtype=np.int64)
            assert isinstance(cache, SlotCache) and cache.rows == 1
            # never below the whole prompt: fitted to each chunk, it shrank at the second and grew
            # past the prompt by half again at the later ones, beyond what admission reserved
            cache.fit(1, max(int(cache.lengths[0]) + n, room))
            return self._run_in_place(ids, cache, logits_from)[0], cache
        assert cache is None or (isinstance(cache, BatchCache) and cache.rows == 1)
        past = self.empty_past(1) if cache is None else cache.past
        start = 0 if cache is None else cache.width  # one row alone: no padding columns
        mask = np.ones((1, start + n), dtype=np.int64)
        logits, present = self._run(ids, mask, np.arange(start, start + n, dtype=np.int64)[None], past, logits_from)
        return logits[0], BatchCache(present, mask, np.array([start + n], dtype=np.int64))

    def step(self, cache: KvCache, tokens: np.ndarray) -> tuple[np.ndarray, KvCache]:
        """One decode step for every row: feed each row's next token, get logits [rows, vocab]."""
        rows = cache.rows
        if isinstance(cache, SlotCache):
            cache.fit(rows, int(cache.lengths.max()) + 1)
            ids = np.asarray(tokens, dtype=np.int64).reshape(rows, 1)
            return self._run_in_place(ids, cache)[:, -1], cache
        mask = np.concatenate([cache.mask, np.ones((rows, 1), dtype=np.int64)], axis=1)
        ids = np.asarray(tokens, dtype=np.int64).reshape(rows, 1)
        logits, present = self._run(ids, mask, cache.positions.reshape(rows, 1), cache.past)
        return logits[:, -1], BatchCache(present, mask, cache.positions + 1)


Declared = tuple[str, type, list[int | str]]  # name, numpy scalar type, dims (symbolic or fixed)


@dataclass
class InPlaceRun:
    binding: Any  # an onnxruntime IOBinding, ready for session.run_with_iobinding
    logits: np.ndarray  # where the run writes its logits


def bind_in_place(session: Any, ids: np.ndarray, lengths: np.ndarray, buffers: list[np.ndarray], vocab: int,
                  logits_from: int | None = 0) -> InPlaceRun:
    """Bind one run of the in-place layout: `buffers` (past_key_values.0.key, .0.value, 1.key,
    ...: each [rows, kv_heads, capacity, head_dim], contiguous) as both past and present, so the
    model writes the new tokens' keys and values after each row's `lengths` tokens. `logits_from`
    None for a model without that input. (The builders' checks run their graphs this way too.)"""
    rows, tokens = ids.shape
    ends = lengths + tokens  # each row's length after this run
    binding = session.io_binding()
    binding.bind_cpu_input("input_ids", np.ascontiguousarray(ids, dtype=np.int64))
    binding.bind_cpu_input("seqlens_k", (ends - 1).astype(np.int32))
    binding.bind_cpu_input("total_sequence_length", np.array(int(ends.max()), dtype=np.int32))
    for i, buffer in enumerate(buffers):
        name = f"{i // 2}.{'value' if i % 2 else 'key'}"
        shape, where = list(buffer.shape), buffer.ctypes.data
        binding.bind_input(f"past_key_values.{name}", "cpu", 0, buffer.dtype.type, shape, where)
        binding.bind_output(f"present.{name}", "cpu", 0, buffer.dtype.type, shape, where)
    if logits_from is not None:
        binding.bind_cpu_input("logits_from", np.array(logits_from, dtype=np.int64))
    logits = np.empty((rows, tokens - (logits_from or 0), vocab), dtype=np.float32)
    binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
    return InPlaceRun(binding, logits)


def signature(layers: int, kv_heads: int, head_dim: int, vocab: int,
              shared_kv: bool) -> tuple[list[Declared], list[Declared]]:
    """The graph inputs and outputs of either layout, as (name, numpy dtype, dims) for a builder
    to declare (tools/build_smollm2.py, tools/build_tiny_decoder.py): what load() reads back."""
    ids: Declared = ("input_ids", np.int64, ["batch_size", "sequence_length"])
    if shared_kv:
        inputs: list[Declared] = [ids, ("seqlens_k", np.int32, ["batch_size"]),
                                  ("total_sequence_length", np.int32, [])]
        past = present = "max_sequence_length"
    else:
        inputs = [ids, ("attention_mask", np.int64, ["batch_size", "past_sequence_length + sequence_length"]),
                  ("position_ids", np.int64, ["batch_size", "sequence_length"])]
        past, present = "past_sequence_length", "past_sequence_length + sequence_length"
    inputs.append(("logits_from", np.int64, []))  # logits for positions logits_from.. only (0: every one)
    outputs: list[Declared] = [("logits", np.float32, ["batch_size", "logits_length", vocab])]
    for i in range(layers):
        for kind in ("key", "value"):
            inputs.append((f"past_key_values.{i}.{kind}", np.float32, ["batch_size", kv_heads, past, head_dim]))
            outputs.append((f"present.{i}.{kind}", np.float32, ["batch_size", kv_heads, present, head_dim]))
    return inputs, outputs


# ---------------------------------------------------------------------- cache surgery


def join(batch: KvCache | None, new: KvCache) -> KvCache:
    """The batch with `new`'s rows appended (last)."""
    if batch is None or batch.rows == 0:
        return new
    return batch.join(new)  # type: ignore[arg-type]  # one decoder makes both caches: the same layout


def keep(batch: KvCache, rows: list[int]) -> KvCache | None:
    """Only the given rows, in that order."""
    return batch.keep(rows)


def held_shape(cache: KvCache | None) -> tuple[int, int]:
    """(rows, columns) an in-place cache's buffers have now, whatever its rows use; (0, 0) for
    none and for Optimum's layout, which holds its rows' tokens only."""
    if isinstance(cache, SlotCache):
        return cache.row_capacity, cache.width
    return 0, 0


def limit(cache: KvCache | None, rows: int, tokens: int) -> None:
    """Keep an in-place cache within `rows` rows of `tokens` tokens (what admission reserved);
    Optimum's layout never holds more than its rows' tokens."""
    if isinstance(cache, SlotCache):
        cache.limit(rows, tokens)
