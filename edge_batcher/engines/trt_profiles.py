"""TensorRT optimization profiles for the preferred batch sizes: planning, selection, sizing.

Pure (no tensorrt import), so the builder, the TensorRT backend, the ONNX Runtime TensorRT
execution provider options and the tests share one definition of "which shapes does the plan
serve".

Why one profile per preferred size: the batcher only ever runs the preferred sizes (2/4/8,
padded up), and TensorRT picks its kernels for a profile's *opt* shape. A profile with
min = opt = max = (size, ...) gets kernels tuned for exactly that size, and is what DLA requires
(DLA has no dynamic dimensions). The alternative, a single profile 1..max ("range" mode), builds
faster and gives a smaller plan, but its kernels are tuned for one size only.

With sequence buckets ([sequence] in model.toml) batches are padded to the bucket length, so
"per_size" plans one profile per (size, bucket) pair: 3 sizes x 4 buckets = 12 profiles. Each
profile costs build time and some plan size; "range" keeps it at one.

Shapes are tuples with the batch dimension first. Datatypes are KServe v2 names (FP32, FP16, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..types import TensorSpec

PROFILE_MODES = ("per_size", "range")

# KServe v2 datatype -> bytes per element, for buffer sizing.
DATATYPE_BYTES: dict[str, int] = {
    "BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2,
    "UINT32": 4, "INT32": 4, "FP32": 4, "UINT64": 8, "INT64": 8, "FP64": 8,
}  # fmt: skip

# tensorrt.DataType member name -> KServe v2 datatype. Types the v2 protocol cannot carry as a
# numpy array (BF16, FP8, INT4, FP4) are missing on purpose: an engine with such an I/O tensor
# is refused at load with a message naming the tensor.
TRT_DTYPE_TO_DATATYPE: dict[str, str] = {
    "FLOAT": "FP32", "HALF": "FP16", "INT8": "INT8", "INT32": "INT32", "INT64": "INT64",
    "BOOL": "BOOL", "UINT8": "UINT8",
}  # fmt: skip


@dataclass(frozen=True)
class ShapeRange:
    """min / opt / max shape of one input in one profile (as IOptimizationProfile.set_shape)."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.min) == len(self.opt) == len(self.max)):
            raise ValueError(f"min/opt/max ranks differ: {self.min} {self.opt} {self.max}")
        for lo, mid, hi in zip(self.min, self.opt, self.max):
            if not 0 <= lo <= mid <= hi:
                raise ValueError(f"expected 0 <= min <= opt <= max per dimension, got {self.min} {self.opt} {self.max}")

    def contains(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.min) and all(
            lo <= d <= hi for lo, d, hi in zip(self.min, shape, self.max)
        )

    @property
    def static(self) -> bool:
        return self.min == self.opt == self.max


@dataclass(frozen=True)
class Profile:
    """One optimization profile: the index TensorRT knows it by and a range per input."""

    index: int
    inputs: Mapping[str, ShapeRange] = field(hash=False)

    def contains(self, shapes: Mapping[str, Sequence[int]]) -> bool:
        """True when every input shape lies inside this profile (set_input_shape would accept it)."""
        return all(name in shapes and r.contains(shapes[name]) for name, r in self.inputs.items())

    def batch_range(self) -> tuple[int, int]:
        """The batch sizes every input accepts: (largest min, smallest max) of dimension 0."""
        lo = max(r.min[0] for r in self.inputs.values())
        hi = min(r.max[0] for r in self.inputs.values())
        return lo, hi

    def max_volume(self) -> int:
        return sum(math.prod(r.max) for r in self.inputs.values())

    def describe(self) -> str:
        parts = []
        for name, r in self.inputs.items():
            if r.static:
                parts.append(f"{name} {_dims(r.opt)}")
            else:
                parts.append(f"{name} {_dims(r.min)}..{_dims(r.max)} (opt {_dims(r.opt)})")
        return f"profile {self.index}: " + ", ".join(parts)


def _dims(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape)


# --------------------------------------------------------------------------- planning


def plan_profiles(
    inputs: Sequence[TensorSpec],
    preferred_sizes: Sequence[int],
    *,
    mode: str = "per_size",
    sequence_inputs: Sequence[str] = (),
    sequence_axis: int = 1,
    buckets: Sequence[int] = (),
    model: str = "model",
) -> list[Profile]:
    """The optimization profiles a plan for these preferred sizes (and buckets) needs.

    Every non-batch dimension must be static, except the sequence axis of the inputs named in
    [sequence]; fix others with model.toml [[inputs]] shape overrides. A fixed batch dimension
    (an ONNX model exported with batch 1) cannot serve other sizes: that is an error too.
    """
    if mode not in PROFILE_MODES:
        raise ConfigError(f"model {model!r}: profile mode {mode!r}: expected one of {', '.join(PROFILE_MODES)}")
    sizes = list(preferred_sizes)
    if not sizes or any(s <= 0 for s in sizes) or sorted(set(sizes)) != sizes:
        raise ConfigError(
            f"model {model!r}: preferred batch sizes must be ascending distinct positive sizes, got {sizes}"
        )
    bucket_list = list(buckets)
    if bucket_list and (any(b <= 0 for b in bucket_list) or sorted(set(bucket_list)) != bucket_list):
        raise ConfigError(
            f"model {model!r}: sequence buckets must be ascending distinct positive lengths, got {bucket_list}"
        )
    if sequence_inputs and not bucket_list:
        raise ConfigError(f"model {model!r}: sequence inputs {list(sequence_inputs)} need buckets to plan profiles")
    if not inputs:
        raise ConfigError(f"model {model!r}: the model has no inputs")
    names = {spec.name for spec in inputs}
    for name in sequence_inputs:
        if name not in names:
            raise ConfigError(
                f"model {model!r}: [sequence] names input {name!r}, but the inputs are {', '.join(sorted(names))}"
            )

    templates: dict[str, list[int | None]] = {}  # None marks the batch / sequence positions
    for spec in inputs:
        if not spec.shape:
            raise ConfigError(
                f"model {model!r}: input {spec.name!r} is a scalar; TensorRT profiles need a batch dimension"
            )
        if spec.shape[0] not in (-1, None) and sizes != [spec.shape[0]]:
            raise ConfigError(
                f"model {model!r}: input {spec.name!r} has a fixed batch dimension {spec.shape[0]}; re-export the "
                f"ONNX model with a dynamic batch dimension to serve sizes {sizes}"
            )
        dims: list[int | None] = [None]
        seq_axis = sequence_axis if spec.name in sequence_inputs else None
        if seq_axis is not None and seq_axis >= len(spec.shape):
            raise ConfigError(
                f"model {model!r}: [sequence] axis {seq_axis} is outside input {spec.name!r} "
                f"of rank {len(spec.shape)}"
            )
        for axis, d in enumerate(spec.shape[1:], start=1):
            if axis == seq_axis:
                dims.append(None)
            elif d is None or d < 0:
                raise ConfigError(
                    f"model {model!r}: input {spec.name!r} dimension {axis} is dynamic; fix it in model.toml, e.g. "
                    f'[[inputs]] name = "{spec.name}" shape = [...], or declare it in [sequence]'
                )
            else:
                dims.append(int(d))
        templates[spec.name] = dims

    def shape_of(name: str, batch: int, seq: int | None) -> tuple[int, ...]:
        out = []
        for axis, d in enumerate(templates[name]):
            if axis == 0:
                out.append(batch)
            elif d is None:
                assert seq is not None
                out.append(seq)
            else:
                out.append(d)
        return tuple(out)

    seqs: list[int | None] = list(bucket_list) if sequence_inputs else [None]
    profiles: list[Profile] = []
    if mode == "per_size":
        for size in sizes:
            for seq in seqs:
                ranges = {}
                for spec in inputs:
                    s = shape_of(spec.name, size, seq if spec.name in sequence_inputs else None)
                    ranges[spec.name] = ShapeRange(s, s, s)
                profiles.append(Profile(len(profiles), ranges))
    else:
        ranges = {}
        for spec in inputs:
            is_seq = spec.name in sequence_inputs
            lo = shape_of(spec.name, 1, 1 if is_seq else None)
            hi = shape_of(spec.name, sizes[-1], bucket_list[-1] if is_seq else None)
            ranges[spec.name] = ShapeRange(lo, hi, hi)
        profiles.append(Profile(0, ranges))
    return profiles


def profiles_for_model(config: Any, inputs: Sequence[TensorSpec], mode: str = "per_size") -> list[Profile]:
    """plan_profiles with the preferred sizes and [sequence] buckets of a ModelConfig."""
    seq = getattr(config, "sequence", None)
    return plan_profiles(
        inputs,
        config.batching.preferred_batch_sizes,
        mode=mode,
        sequence_inputs=list(seq.inputs) if seq else (),
        sequence_axis=seq.axis if seq else 1,
        buckets=list(seq.buckets) if seq else (),
        model=config.name,
    )


# --------------------------------------------------------------------------- selection


def select_profile(shapes: Mapping[str, Sequence[int]], profiles: Sequence[Profile]) -> int | None:
    """The profile to run these input shapes with, or None when no profile accepts them.

    A profile whose opt shape *is* the batch wins (its kernels were tuned for it); among
    several, or when none is exact, the smallest one that accepts the shapes (least padding
    work inside TensorRT's kernels); ties go to the lower index.
    """
    candidates = [p for p in profiles if p.contains(shapes)]
    if not candidates:
        return None
    exact = [p for p in candidates if all(tuple(shapes[n]) == r.opt for n, r in p.inputs.items())]
    pool = exact or candidates
    return min(pool, key=lambda p: (p.max_volume(), p.index)).index


def profile_for_batch(size: int, profiles: Sequence[Profile], seq_len: int | None = None,
                      sequence_axis: int = 1, sequence_inputs: Sequence[str] = ()) -> int:
    """The profile for a batch of `size` rows (and padded sequence length), by batch dimension.

    Raises ValueError naming the sizes the profiles do serve, so a mismatch between
    preferred_batch_sizes and the plan reads as what it is.
    """
    candidates = []
    for p in profiles:
        lo, hi = p.batch_range()
        if not lo <= size <= hi:
            continue
        if seq_len is not None:
            if not all(
                r.min[sequence_axis] <= seq_len <= r.max[sequence_axis]
                for name, r in p.inputs.items() if name in sequence_inputs
            ):
                continue
        candidates.append(p)
    if not candidates:
        served = ", ".join(
            f"{lo}..{hi}" if lo != hi else str(lo) for lo, hi in sorted({p.batch_range() for p in profiles})
        )
        what = f"batch size {size}" + (f" at sequence length {seq_len}" if seq_len is not None else "")
        raise ValueError(f"no optimization profile serves {what}; the plan serves batch sizes {served}")

    def exactness(p: Profile) -> tuple[int, int, int]:
        opt_batch = min(r.opt[0] for r in p.inputs.values())
        return (0 if opt_batch == size else 1, p.max_volume(), p.index)

    return min(candidates, key=exactness).index


def uncovered(profiles: Sequence[Profile], preferred_sizes: Sequence[int], seq_inputs: Sequence[str] = (),
              sequence_axis: int = 1, buckets: Sequence[int] = ()) -> list[str]:
    """The preferred sizes (x buckets) no profile serves, as readable strings; [] when all are."""
    missing = []
    for size in preferred_sizes:
        for seq in (list(buckets) if seq_inputs else [None]):
            try:
                profile_for_batch(size, profiles, seq, sequence_axis, seq_inputs)
            except ValueError:
                missing.append(str(size) if seq is None else f"{size} (sequence {seq})")
    return missing


# --------------------------------------------------------------------------- sizing


def tensor_bytes(shape: Sequence[int], datatype: str) -> int:
    """Bytes of a dense tensor of this v2 datatype."""
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {list(shape)} is not concrete")
    try:
        itemsize = DATATYPE_BYTES[datatype]
    except KeyError:
        raise ValueError(f"datatype {datatype!r} has no fixed element size") from None
    return math.prod(shape) * itemsize


def profile_buffer_bytes(max_shapes: Mapping[str, Sequence[int]], datatypes: Mapping[str, str]) -> dict[str, int]:
    """Bytes per I/O tensor at one profile's max shapes (inputs: the profile; outputs: what
    TensorRT reports for those input shapes)."""
    return {name: tensor_bytes(shape, datatypes[name]) for name, shape in max_shapes.items()}


def shared_buffer_bytes(per_profile: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """One buffer per tensor serving every profile: the largest size any profile needs.

    One execution context runs one batch at a time on one stream, so the profiles never need
    their buffers at the same time: sharing costs max(profile) instead of sum(profiles).
    """
    out: dict[str, int] = {}
    for sizes in per_profile:
        for name, n in sizes.items():
            out[name] = max(out.get(name, 0), n)
    return out


@dataclass(frozen=True)
class TrtFootprint:
    """Device bytes one engine instance needs, for the memory estimator.

    weights:     the engine's weights (each instance deserializes its own engine)
    activations: TensorRT's scratch memory for the profile serving this batch
    io:          the I/O buffers at that profile's max shapes
    reserved:    activations + I/O buffers the instance holds from load to close (allocated
                 once, at the largest profile)
    resident:    weights + reserved: everything the instance holds while loaded
    per_batch:   what running a batch allocates on top of resident: 0, by construction

    For admission control, resident belongs with the loaded models (it is in the probe's
    free memory once loaded) and per_batch is a batch's cost; activations/io say how much of
    reserved the batch's profile actually uses.
    """

    weights: int
    activations: int
    io: int
    reserved: int

    @property
    def resident(self) -> int:
        return self.weights + self.reserved

    def as_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "activations": self.activations, "io": self.io,
                "reserved": self.reserved, "resident": self.resident, "per_batch": 0, "kv_cache": 0}


def footprint(weights: int, activations_per_profile: Sequence[int], io_per_profile: Sequence[Mapping[str, int]],
              profile: int) -> TrtFootprint:
    """The footprint of one instance when it runs `profile` (see TrtFootprint)."""
    if not activations_per_profile or len(activations_per_profile) != len(io_per_profile):
        raise ValueError("need activation and I/O sizes for every profile")
    shared = shared_buffer_bytes(io_per_profile)
    return TrtFootprint(
        weights=int(weights),
        activations=int(activations_per_profile[profile]),
        io=int(sum(io_per_profile[profile].values())),
        reserved=int(max(activations_per_profile) + sum(shared.values())),
    )


# --------------------------------------------------------------------------- ONNX Runtime TensorRT EP


def profile_shape_strings(profiles: Sequence[Profile]) -> dict[str, str]:
    """The trt_profile_{min,opt,max}_shapes strings of ONNX Runtime's TensorRT EP.

    Its format is "input1:d0xd1,input2:d0xd1,..."; an input named again starts the next
    profile (onnxruntime's ParseProfileShapes), so profiles are written one after the other.
    """
    out: dict[str, list[str]] = {
        "trt_profile_min_shapes": [], "trt_profile_opt_shapes": [], "trt_profile_max_shapes": []
    }
    for p in profiles:
        for name, r in p.inputs.items():
            if not _safe_name(name):
                raise ConfigError(
                    f"input {name!r} contains ':' or ',', which the TensorRT EP profile-shape format cannot carry"
                )
            out["trt_profile_min_shapes"].append(f"{name}:{_dims(r.min)}")
            out["trt_profile_opt_shapes"].append(f"{name}:{_dims(r.opt)}")
            out["trt_profile_max_shapes"].append(f"{name}:{_dims(r.max)}")
    return {k: ",".join(v) for k, v in out.items()}


def _safe_name(name: str) -> bool:
    # onnxruntime splits on ',' then on the first ':' (an 'x' in the name is harmless).
    return ":" not in name and "," not in name


def ort_trt_provider_options(
    model_config: Any,
    input_specs: Sequence[TensorSpec],
    cache_dir: str | Path,
    *,
    fp16: bool = False,
    mode: str = "per_size",
    dla_core: int = -1,
) -> dict[str, str]:
    """Provider options for `TensorrtExecutionProvider` that pin its profiles to the preferred sizes.

    Without explicit profiles the TensorRT EP rebuilds its engine whenever a batch shape falls
    outside the shapes it has seen (seconds to minutes on a Jetson, in the middle of serving).
    With one profile per preferred size (or one 1..max range) built once and cached on disk
    (trt_engine_cache_path), the first start builds and later starts load the cache.

    Values are strings, as onnxruntime wants them ("True"/"False" for flags). Put them in
    model.toml as
        [[onnxruntime.execution_providers]]
        name = "TensorrtExecutionProvider"
        options = { trt_engine_cache_enable = "True", ... }
    """
    if dla_core >= 0 and not fp16:
        raise ConfigError("DLA runs FP16 or INT8 only: set fp16=True with dla_core")
    if dla_core >= 0 and mode != "per_size":
        raise ConfigError("DLA has no dynamic dimensions: use one profile per size (mode='per_size') with dla_core")
    profiles = profiles_for_model(model_config, input_specs, mode)
    cache = str(cache_dir)
    options = {
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": cache,
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": cache,
        "trt_fp16_enable": "True" if fp16 else "False",
    }
    if dla_core >= 0:
        options["trt_dla_enable"] = "True"
        options["trt_dla_core"] = str(dla_core)
    options.update(profile_shape_strings(profiles))
    return options
