"""Each model's <repository>/<model>/model.toml: typed, validated on load.

An unknown key, a wrong type or an impossible value raises ConfigError naming the file, the key and
what was expected. Backend-specific tables are kept as written and built by their backend with
backend_settings(), so their errors name the file and key too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .toml_settings import build_dataclass, check_positive, read_toml


@dataclass
class ExecutionProvider:
    name: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class OnnxRuntimeSettings:
    # Tried in order; providers this onnxruntime build lacks are skipped with a warning.
    execution_providers: list[ExecutionProvider] = field(
        default_factory=lambda: [ExecutionProvider("CPUExecutionProvider")]
    )
    intra_op_threads: int = 1
    inter_op_threads: int = 1
    graph_optimization_level: str = "all"  # disable | basic | extended | all
    # Whether ONNX Runtime's pool threads busy-wait for the next parallel section instead of
    # sleeping (its own default: true). Off trades a little latency for CPU a shared device's
    # other work can use (docs/benchmarks.md, "Spinning thread pools").
    allow_spinning: bool = True
    # CUDA graphs per batch shape on the CUDA EP (engines/ort_graphs.py): "auto" uses them where
    # ONNX Runtime accepts them (every node on the device) and says so where it does not; "on"
    # refuses to load without them; "off" never.
    cuda_graphs: str = "auto"
    # With CUDA graphs, host batches are assembled in page-locked memory that the copy to the
    # device reads by DMA (engines/ort_graphs.py: PinnedStaging; needs a CUDA Python binding).
    pinned_inputs: bool = True


@dataclass
class SequenceSettings:
    """Variable-length inputs: requests batch with others of their length bucket."""

    inputs: list[str]  # inputs that share the dynamic sequence axis
    axis: int = 1
    buckets: list[int] = field(default_factory=list)  # ascending boundaries
    pad_value: float = 0.0


@dataclass
class BatchingSettings:
    preferred_batch_sizes: list[int] = field(default_factory=lambda: [2, 4, 8])
    max_batch_size: int = 0  # 0: the largest preferred size
    max_queue_delay_ms: float = 2.0
    # A request that finds the model idle (nothing queued, no batch running) waits only for as
    # many requests as the last batch carried, not max_queue_delay_ms (README, "How batches are formed").
    dispatch_when_idle: bool = True
    priority_levels: int = 1  # priorities 0..levels-1, higher first
    default_priority: int = 0
    default_timeout_ms: float = 5000.0
    max_timeout_ms: float = 60000.0
    queue_capacity: int = 256  # requests waiting per model; beyond it: "overloaded" at once


@dataclass
class TensorOverride:
    """Narrow what the model file declares: a dynamic dim fixed, or a datatype checked."""

    name: str
    datatype: str = ""
    shape: list[int] = field(default_factory=list)


@dataclass
class ModelConfig:
    name: str
    directory: Path
    backend: str = "onnxruntime"
    model_file: str = "model.onnx"
    instances: int = 1
    description: str = ""
    labels: list[str] = field(default_factory=list)
    # NaN and +-Infinity in a floating-point input: refused (400) unless true, since a broken
    # sensor sends them and a model still answers something that looks normal.
    allow_non_finite_inputs: bool = False
    onnxruntime: OnnxRuntimeSettings = field(default_factory=OnnxRuntimeSettings)
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    sequence: SequenceSettings | None = None
    inputs: list[TensorOverride] = field(default_factory=list)
    outputs: list[TensorOverride] = field(default_factory=list)
    # Backend-specific tables, kept as written and validated by their backend with
    # backend_settings() (so the errors still name the file and key).
    tensorrt: dict[str, Any] = field(default_factory=dict)
    tokenizer: dict[str, Any] = field(default_factory=dict)
    rag: dict[str, Any] = field(default_factory=dict)
    generator: dict[str, Any] = field(default_factory=dict)

    @property
    def model_path(self) -> Path:
        return self.directory / self.model_file


MODEL_KEYS = {
    "backend", "model_file", "instances", "description", "labels", "allow_non_finite_inputs",
    "onnxruntime", "batching", "sequence", "inputs", "outputs",
    "tensorrt", "tokenizer", "rag", "generator",
}  # fmt: skip


def backend_settings(config: ModelConfig, table: str, cls: type) -> Any:
    """Build a backend's own settings dataclass from its model.toml table, e.g.
    backend_settings(config, "tensorrt", TensorRTSettings); errors name the file and key."""
    return build_dataclass(cls, getattr(config, table), f"{config.directory / 'model.toml'}: [{table}]")


def load_model_config(model_dir: Path) -> ModelConfig:
    """Load <repository>/<model>/model.toml; the directory name is the model name."""
    path = model_dir / "model.toml"
    raw = read_toml(path)
    where = str(path)
    for key in raw:
        if key not in MODEL_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}; expected one of {', '.join(sorted(MODEL_KEYS))}")
    raw = dict(raw)
    ort = raw.get("onnxruntime")
    providers = ort.get("execution_providers") if isinstance(ort, dict) else None
    if providers is not None:
        # Accept plain names as shorthand for {name = "..."}.
        if not isinstance(providers, list):
            raise ConfigError(f"{where}: [onnxruntime] execution_providers: expected a list")
        raw["onnxruntime"] = dict(raw["onnxruntime"])
        raw["onnxruntime"]["execution_providers"] = [
            {"name": p} if isinstance(p, str) else p for p in providers
        ]
    raw["name"] = model_dir.name
    raw["directory"] = model_dir
    config = build_dataclass(ModelConfig, raw, where)
    _validate_model(config, where)
    return config


def repository_models(repository: Path) -> dict[str, Path]:
    """A repository's model directories by name: each subdirectory holding a model.toml (none
    when the repository is not a directory)."""
    if not repository.is_dir():
        return {}
    return {d.name: d for d in sorted(repository.iterdir()) if (d / "model.toml").is_file()}


def models_used_by(config: ModelConfig) -> set[str]:
    """The models a service's config names ([rag] embedding_model and generator)."""
    return {v for v in (config.rag.get("embedding_model"), config.rag.get("generator")) if isinstance(v, str) and v}


def discover_models(repository: Path, only: list[str] | None = None) -> list[ModelConfig]:
    """Every <repository>/<name>/model.toml, validated (only the named ones when `only` is set)."""
    if not repository.is_dir():
        raise ConfigError(f"model repository {repository} is not a directory")
    found = repository_models(repository)
    if only:
        missing = [n for n in only if n not in found]
        if missing:
            raise ConfigError(
                f"[models] load names {', '.join(map(repr, missing))}, not found in {repository} "
                f"(it has {', '.join(found) or 'no models'})"
            )
        found = {n: found[n] for n in only}
    return [load_model_config(d) for d in found.values()]


def _validate_model(c: ModelConfig, where: str) -> None:
    if not c.name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(f"{where}: model name {c.name!r} must use letters, digits, '-', '_' or '.'")
    check_positive(c.instances, f"{where}: instances")
    b = c.batching
    sizes = b.preferred_batch_sizes
    if not sizes or any(s <= 0 for s in sizes) or sorted(set(sizes)) != sizes:
        raise ConfigError(
            f"{where}: [batching] preferred_batch_sizes: expected ascending distinct positive sizes "
            f"like [2, 4, 8], got {sizes}"
        )
    if b.max_batch_size == 0:
        b.max_batch_size = sizes[-1]
    if b.max_batch_size < sizes[0]:
        raise ConfigError(
            f"{where}: [batching] max_batch_size {b.max_batch_size} is smaller than the smallest "
            f"preferred batch size {sizes[0]}"
        )
    check_positive(b.max_queue_delay_ms, f"{where}: [batching] max_queue_delay_ms", allow_zero=True)
    check_positive(b.priority_levels, f"{where}: [batching] priority_levels")
    if not 0 <= b.default_priority < b.priority_levels:
        raise ConfigError(
            f"{where}: [batching] default_priority: expected 0..{b.priority_levels - 1}, got {b.default_priority}"
        )
    check_positive(b.default_timeout_ms, f"{where}: [batching] default_timeout_ms")
    if b.max_timeout_ms < b.default_timeout_ms:
        raise ConfigError(
            f"{where}: [batching] max_timeout_ms {b.max_timeout_ms} is below default_timeout_ms {b.default_timeout_ms}"
        )
    check_positive(b.queue_capacity, f"{where}: [batching] queue_capacity")
    if c.sequence is not None:
        s = c.sequence
        if not s.inputs:
            raise ConfigError(f"{where}: [sequence] inputs: name at least one input")
        if s.axis < 1:
            raise ConfigError(f"{where}: [sequence] axis: expected >= 1 (axis 0 is the batch), got {s.axis}")
        if not s.buckets or any(x <= 0 for x in s.buckets) or sorted(set(s.buckets)) != s.buckets:
            raise ConfigError(
                f"{where}: [sequence] buckets: expected ascending distinct positive lengths, got {s.buckets}"
            )
    if c.onnxruntime.graph_optimization_level not in ("disable", "basic", "extended", "all"):
        raise ConfigError(
            f"{where}: [onnxruntime] graph_optimization_level: expected disable, basic, extended or all, "
            f"got {c.onnxruntime.graph_optimization_level!r}"
        )
    if c.onnxruntime.cuda_graphs not in ("auto", "on", "off"):
        raise ConfigError(f"{where}: [onnxruntime] cuda_graphs: expected auto, on or off, "
                          f"got {c.onnxruntime.cuda_graphs!r}")
