"""The engine interface every backend implements.

An engine is one loaded instance of a model (one ONNX Runtime session, one TensorRT execution
context). It is created with its settings, loaded once, then `infer` is called from exactly one
dedicated worker thread with whole batches (batch dimension first, already padded to one of
the preferred sizes). It never sees the event loop.

Besides the four required members, `Engine` declares the optional hooks with their defaults
(`batch_inputs`, `prepare`, `memory_footprint`, `tokenizer`, `token_padding`,
`accepts_any_length`, `device_inputs`, `device_batch_buffers`, `host_batch_buffers`,
`cuda_graphs`): an engine that subclasses it inherits them; `with_hook_defaults` gives an engine
that only duck-types the protocol (a user's backend, a test's fake) the same defaults once, at
creation, so callers read the hooks directly instead of probing with getattr.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..config import ModelConfig
from ..types import TensorSpec

# ONNX Runtime execution providers whose memory is a device's, not the process's heap
# (memory/device.py measures it with the device's probe).
DEVICE_PROVIDERS = frozenset({"CUDAExecutionProvider", "TensorrtExecutionProvider", "NvTensorRTRTXExecutionProvider"})

# prepare(inputs as clients send them) -> (inputs as the model runs on them, sequence length);
# called on the model's prepare thread (scheduler/preparing.py), one request at a time, never on
# the event loop and never beside infer() on the same thread
PrepareHook = Callable[[dict[str, np.ndarray]], "tuple[dict[str, np.ndarray], int]"]
# memory_footprint(batch, seq_len) -> {"resident": bytes, "per_batch": bytes}
FootprintHook = Callable[[int, "int | None"], "dict[str, int]"]
# device_batch_buffers({input: (batch shape, dtype)}) -> {input: device address} of the engine's
# own buffers for a batch of exactly those shapes, or None when it has none for them
BuffersHook = Callable[[dict[str, "tuple[tuple[int, ...], np.dtype]"]], "dict[str, int] | None"]
# host_batch_buffers({input: (batch shape, dtype)}) -> {input: host array of exactly that shape and
# dtype} where a host batch of those shapes is to be written, or None when it has none for them
HostBuffersHook = Callable[[dict[str, "tuple[tuple[int, ...], np.dtype]"]], "dict[str, np.ndarray] | None"]


@dataclass(frozen=True)
class DeviceArray:
    """A batch input assembled in device memory (scheduler/device_batch.py), handed to an engine
    whose `device_inputs` names its device: `ptr` is valid until infer() returns; it is one of
    the engine's own buffers when `device_batch_buffers` gave one. `copy_to(dst)` copies it to a
    device address of the same device and returns once the copy is done."""

    ptr: int
    device_id: int
    dtype: np.dtype
    shape: tuple[int, ...]
    copy_to: Callable[[int], None] = field(repr=False, compare=False)


@runtime_checkable
class Engine(Protocol):
    inputs: list[TensorSpec]  # after load(): names, datatypes, shapes (-1 = dynamic)
    outputs: list[TensorSpec]

    # Optional hooks, with their defaults.
    # What batches are built from when prepare changes the inputs (text -> token ids); None: inputs.
    batch_inputs: list[TensorSpec] | None = None
    prepare: PrepareHook | None = None  # None: requests run as clients send them
    # Exact memory figures (TensorRT allocates everything at load); None: estimate from the model file.
    memory_footprint: FootprintHook | None = None
    tokenizer: Any = None  # the text tokenizer of an engine that takes text (RAG reads it)
    token_padding: Callable[[], dict[str, Any]] | None = None  # its batches' token padding (RAG's stats)
    # True: a sequence input may have any length, so a batch is padded only to its longest member
    # (scheduler/batch.py); False: only the bucket lengths (TensorRT optimisation profiles).
    accepts_any_length: bool = False
    # The CUDA device whose memory infer() takes as input (a DeviceArray in place of an array, bound
    # with IOBinding): batches of inputs in CUDA shared memory are assembled there. None: host only.
    device_inputs: int | None = None

    @property
    def device_batch_buffers(self) -> BuffersHook | None:
        """Where a device batch of given shapes may be assembled: the engine's own buffers (the
        bound buffers a CUDA graph replays), written on its worker thread just before infer(), so
        the batch is copied once. None: into a buffer of the batch's own (device_batch.py)."""
        return None

    @property
    def host_batch_buffers(self) -> HostBuffersHook | None:
        """Where a host batch of given shapes may be assembled: the engine's own page-locked
        staging, which its copy to the device reads by DMA (Triton's input_pinned_memory), written
        on its worker thread just before infer(), so the batch is not copied again on the host.
        None: a fresh array per batch (scheduler/batch.py)."""
        return None

    @property
    def cuda_graphs(self) -> bool:
        """True once loaded when its batches replay captured CUDA graphs (the backend's
        cuda_graphs setting, as far as its runtime accepted it): the Triton config reports it."""
        return False

    def __init__(self, config: ModelConfig) -> None: ...

    def load(self) -> None:
        """Load the model (blocking, may take long: called off the event loop)."""

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch; every output has the batch dimension first."""

    def close(self) -> None:
        """Release the model's memory."""


HOOK_DEFAULTS: dict[str, Any] = {
    "batch_inputs": None, "prepare": None, "memory_footprint": None, "tokenizer": None, "token_padding": None,
    "accepts_any_length": False, "device_inputs": None, "device_batch_buffers": None, "host_batch_buffers": None,
    "cuda_graphs": False,
}


def with_hook_defaults(engine: Any) -> Engine:
    """`engine` with every optional hook it does not define set to the protocol's default (a
    subclass of Engine has them all already)."""
    if not isinstance(engine, type) and not _subclasses_engine(engine):
        for name, default in HOOK_DEFAULTS.items():
            if not hasattr(engine, name):
                setattr(engine, name, default)
    return engine


def _subclasses_engine(engine: Any) -> bool:
    return Engine in type(engine).__mro__


def apply_overrides(specs: list[TensorSpec], overrides, kind: str, model: str) -> list[TensorSpec]:
    """Narrow specs read from the model file with model.toml's [[inputs]]/[[outputs]] entries."""
    from ..errors import ConfigError

    by_name = {s.name: s for s in specs}
    for o in overrides:
        if o.name not in by_name:
            raise ConfigError(
                f"model {model!r}: model.toml names {kind} {o.name!r}, but the model's {kind}s are "
                f"{', '.join(by_name)}"
            )
        spec = by_name[o.name]
        datatype, shape = spec.datatype, spec.shape
        if o.datatype:
            if o.datatype != spec.datatype:
                raise ConfigError(
                    f"model {model!r}: {kind} {o.name!r} is {spec.datatype} in the model file, "
                    f"model.toml says {o.datatype}"
                )
        if o.shape:
            if len(o.shape) != len(spec.shape) or any(
                m != -1 and m != n for m, n in zip(spec.shape, o.shape)
            ):
                raise ConfigError(
                    f"model {model!r}: {kind} {o.name!r} shape {list(o.shape)} in model.toml does not "
                    f"narrow the model's shape {list(spec.shape)}"
                )
            shape = tuple(o.shape)
        by_name[o.name] = TensorSpec(o.name, datatype, shape)
    return [by_name[s.name] for s in specs]
