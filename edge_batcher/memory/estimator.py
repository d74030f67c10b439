"""OnnxFootprintEstimator: how much memory one batch of an ONNX model needs, without running it:
weights (initializers, Constant nodes, external data files), the peak of live activations
(liveness.py walks the shape-inferred graph with the batch and sequence dimensions bound) times
a calibration factor, and the KV cache of models with past_key_values inputs. The scheduler asks
it per (batch, seq_len) before a batch runs, so answers are cached. docs/memory.md ("The
estimator", "Calibration") explains the method and its accuracy.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import GraphProto, ModelProto, NodeProto, TensorProto, TypeProto, helper
from onnx.external_data_helper import load_external_data_for_tensor

from ..errors import ConfigError
from .liveness import (
    Activations,
    LivenessWalk,
    collect_types,
    constant_nbytes,
    is_constant,
    subgraphs,
    tensor_nbytes,
    tensor_proto_nbytes,
)  # fmt: skip

# Initializers and Constant tensors at most this many elements stay embedded in the model used
# for shape inference (data propagation needs the values of shape tensors such as a Reshape
# target); larger ones are replaced by a typed graph input so copying the model per estimate
# does not copy the weights.
_KEEP_FOR_INFERENCE_ELEMENTS = 1024

_PAST_KV = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_PAST_SEQ_AXIS = 2  # [batch, kv_heads, past_seq, head_dim]

@dataclass(frozen=True)
class Footprint:
    """Bytes one batch needs. activations already include the estimator's calibration.

    unknown_shapes counts tensors whose shape inference failed and whose size was guessed (see
    OnnxFootprintEstimator.activation_peak); when it is not 0 the figure is less certain.
    """

    weights: int
    activations: int
    kv_cache: int
    unknown_shapes: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.kv_cache


class OnnxFootprintEstimator:
    """Memory footprint of one batch of an ONNX model: weights + peak activations + KV cache.

    sequence_axes maps an input name to the axis holding the variable sequence length (dim 0
    of every input is the batch). Other inputs whose dimension has the same symbolic name
    (e.g. attention_mask's "sequence_length") are bound too. past_key_values.N.key/value
    inputs get dim 0 bound to the batch and their past-length axis (2) to seq_len.

    The model is loaded once without its external data; weights are counted from the
    initializers, the Constant nodes and the sizes of the external data files.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        sequence_axes: dict[str, int] | None = None,
        calibration: float = 1.0,
        max_new_tokens: int = 0,
    ):
        path = Path(model_path)
        if not path.is_file():
            raise ConfigError(f"model_path: {path} is not a file")
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 0
        ):
            raise ConfigError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as e:  # DecodeError and friends: not an ONNX file
            raise ConfigError(f"model_path: cannot load {path} as ONNX: {e}") from e

        self.model_path = path
        self.max_new_tokens = max_new_tokens
        self.calibration = calibration  # validated by the property setter
        self._length_calibration: dict[int, float] = {}  # seq_len -> its own factor, see set_calibration
        self._weight_sizes: dict[str, int] = {}
        self._weights = self._count_weights(model.graph, path.parent, set())

        graph_inputs = {
            i.name: i for i in model.graph.input if i.name not in self._weight_sizes
        }
        self._sequence_axes = self._check_sequence_axes(sequence_axes or {}, graph_inputs)
        self._kv_inputs: set[str] = {n for n in graph_inputs if _PAST_KV.match(n)}
        self.kv_layers, self.kv_bytes_per_token = self._kv_layout(graph_inputs)

        # From here on the loaded model *is* the template: its large weights are dropped.
        self._template = self._inference_template(model, path.parent)
        self._cache: dict[tuple[int, int | None], Activations] = {}
        self.unknown_shapes = 0
        self.unknown_tensors: tuple[str, ...] = ()

    # -- settings -----------------------------------------------------------------------------

    @property
    def calibration(self) -> float:
        """Multiplier on the activation estimate (1.0 = trust the liveness walk), for every
        sequence length without a factor of its own (set_calibration)."""
        return self._calibration

    @calibration.setter
    def calibration(self, value: float) -> None:
        self._calibration = _checked_factor(value)

    def set_calibration(self, factor: float, seq_len: int | None = None) -> None:
        """The multiplier for one sequence length (a length bucket), or with seq_len=None the
        default for all: ONNX Runtime's excess over liveness grows with the length (docs/memory.md)."""
        if seq_len is None:
            self.calibration = factor
        else:
            _check_positive("seq_len", seq_len)
            self._length_calibration[seq_len] = _checked_factor(factor)

    def calibration_for(self, seq_len: int | None) -> float:
        return self._length_calibration.get(seq_len, self._calibration) if seq_len is not None else self._calibration

    def scale_calibration(self, step: float) -> None:
        """Multiply every factor (the default and each length's): estimates proved low."""
        self.calibration = self._calibration * step
        for seq_len, factor in self._length_calibration.items():
            self._length_calibration[seq_len] = _checked_factor(factor * step)

    @staticmethod
    def _check_sequence_axes(
        axes: dict[str, int], inputs: dict[str, onnx.ValueInfoProto]
    ) -> dict[str, int]:
        checked: dict[str, int] = {}
        for name, axis in axes.items():
            if name not in inputs:
                raise ConfigError(
                    f"sequence_axes: the model has no input {name!r}; "
                    f"inputs are {', '.join(inputs) or 'none'}"
                )
            rank = len(inputs[name].type.tensor_type.shape.dim)
            if isinstance(axis, bool) or not isinstance(axis, int) or not -rank <= axis < rank:
                raise ConfigError(
                    f"sequence_axes[{name!r}] must be an axis of a rank-{rank} input, got {axis!r}"
                )
            axis %= rank
            if axis == 0:
                raise ConfigError(f"sequence_axes[{name!r}]: axis 0 is the batch dimension")
            checked[name] = axis
        return checked

    # -- weights ------------------------------------------------------------------------------

    def _count_weights(self, graph: GraphProto, base: Path, files_seen: set[Path]) -> int:
        """Initializer + Constant bytes of graph and its subgraphs; records each name's size.

        Tensors stored externally are counted by the size of their files (each file once):
        that is what gets read and mapped, whatever the per-tensor offsets say.
        """
        total = 0
        for t in graph.initializer:
            size = tensor_proto_nbytes(t)
            self._weight_sizes[t.name] = size
            if t.data_location == TensorProto.EXTERNAL:
                location = next((e.value for e in t.external_data if e.key == "location"), None)
                file = (base / location).resolve() if location else None
                if file is not None and file.is_file():
                    if file not in files_seen:
                        files_seen.add(file)
                        total += file.stat().st_size
                    continue
            total += size
        for st in graph.sparse_initializer:
            size = tensor_proto_nbytes(st.values) + tensor_proto_nbytes(st.indices)
            self._weight_sizes[st.values.name] = size
            total += size
        for node in graph.node:
            if is_constant(node):
                size = constant_nbytes(node)
                for o in node.output:
                    if o:
                        self._weight_sizes[o] = size
                total += size
            for g in subgraphs(node):
                total += self._count_weights(g, base, files_seen)
        return total

    def weights_bytes(self) -> int:
        """Bytes of all weights (initializers, Constant tensors, external data files)."""
        return self._weights

    # -- KV cache -----------------------------------------------------------------------------

    def _kv_layout(self, inputs: dict[str, onnx.ValueInfoProto]) -> tuple[int, int]:
        """(layers, bytes per token) from past_key_values.N.key/value input shapes.

        Each past tensor is [batch, kv_heads, past_seq, head_dim]; one token adds
        kv_heads * head_dim elements to each, so summing over the key and value inputs gives
        2 x layers x kv_heads x head_dim x dtype_bytes for uniform layers (and stays right
        for models whose layers differ).
        """
        layers: set[int] = set()
        per_token = 0
        for name in sorted(self._kv_inputs):
            match = _PAST_KV.match(name)
            assert match is not None
            layers.add(int(match.group(1)))
            tt = inputs[name].type.tensor_type
            dims = tt.shape.dim
            if len(dims) != 4 or not all(dims[a].HasField("dim_value") for a in (1, 3)):
                raise ConfigError(
                    f"input {name!r} must be [batch, kv_heads, past_seq, head_dim] with fixed "
                    "kv_heads and head_dim to size the KV cache"
                )
            per_token += tensor_nbytes(tt.elem_type, [dims[1].dim_value, dims[3].dim_value])
        return len(layers), per_token

    def kv_bytes(self, batch: int, seq_len: int) -> int:
        """KV cache for batch sequences of seq_len prompt tokens plus max_new_tokens; 0 for
        models without past_key_values inputs."""
        _check_positive("batch", batch)
        _check_positive("seq_len", seq_len)
        return self.kv_bytes_per_token * batch * (seq_len + self.max_new_tokens)

    # -- activations --------------------------------------------------------------------------

    @staticmethod
    def _inference_template(model: ModelProto, base_dir: Path) -> ModelProto:
        """The model as shape inference sees it: large initializers and Constant values
        replaced by typed graph inputs, stale intermediate and output shapes dropped (they may
        have been recorded at another batch size and would conflict), weights not copied.

        Small initializers stay, and are read from their external file if they live in one:
        data propagation needs the values of shape tensors (a Reshape target) to size what
        follows, and a model saved with size_threshold=0 keeps even those outside.
        """
        graph = model.graph
        declared = {i.name for i in graph.input}
        keep: list[TensorProto] = []
        for t in graph.initializer:
            small = math.prod(t.dims) <= _KEEP_FOR_INFERENCE_ELEMENTS
            if small and t.data_location == TensorProto.EXTERNAL:
                try:
                    load_external_data_for_tensor(t, str(base_dir))
                    # onnx < 1.18 leaves the tensor marked external, and shape inference then
                    # ignores the bytes it just read.
                    t.data_location = TensorProto.DEFAULT
                    del t.external_data[:]
                except Exception:  # missing/unsafe file: shape inference gets its type only
                    small = False
            if small:
                keep.append(t)
            elif t.name not in declared:
                graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
                declared.add(t.name)
        del graph.initializer[:]
        graph.initializer.extend(keep)

        nodes: list[NodeProto] = []
        for node in graph.node:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if (
                is_constant(node)
                and value is not None
                and math.prod(value.dims) > _KEEP_FOR_INFERENCE_ELEMENTS
            ):
                graph.input.append(
                    helper.make_tensor_value_info(node.output[0], value.data_type, list(value.dims))
                )
            else:
                nodes.append(node)
        del graph.node[:]
        graph.node.extend(nodes)

        del graph.value_info[:]
        for out in graph.output:
            if out.type.WhichOneof("value") == "tensor_type":
                out.type.tensor_type.ClearField("shape")
        # A copy, so the loaded model can be freed: protobuf keeps a message's memory (its
        # weights here) until the whole message goes, whatever was deleted from it. Holding it
        # kept a second copy of the weights in the daemon's memory (86 MiB for MiniLM).
        template = ModelProto()
        template.CopyFrom(model)
        return template

    def _bound_model(self, batch: int, seq_len: int | None) -> ModelProto:
        """A copy of the template with batch and sequence dims of the inputs made concrete."""
        model = ModelProto()
        model.CopyFrom(self._template)
        symbols: dict[str, int] = {}

        def bind(dim: onnx.TensorShapeProto.Dimension, value: int) -> None:
            if dim.HasField("dim_param") and dim.dim_param:
                symbols.setdefault(dim.dim_param, value)
            dim.dim_value = value  # clears dim_param (oneof)

        inputs = [
            i for i in model.graph.input
            if i.name not in self._weight_sizes and i.type.WhichOneof("value") == "tensor_type"
        ]
        for inp in inputs:
            dims = inp.type.tensor_type.shape.dim
            if not dims:
                continue
            bind(dims[0], batch)
            axis = self._sequence_axes.get(inp.name)
            if axis is None and inp.name in self._kv_inputs and len(dims) == 4:
                axis = _PAST_SEQ_AXIS
            if axis is not None and seq_len is not None:
                bind(dims[axis], seq_len)
        for inp in inputs:
            for d in inp.type.tensor_type.shape.dim:
                if d.HasField("dim_param") and d.dim_param in symbols:
                    d.dim_value = symbols[d.dim_param]
        return model

    def _infer(self, model: ModelProto) -> ModelProto:
        """Shape inference, strict first (errors surface instead of silently unknown shapes),
        lenient if the strict pass fails (custom ops, partially broken models)."""
        try:
            return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
        except Exception:
            return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)

    def _activations(self, batch: int, seq_len: int | None) -> Activations:
        key = (batch, seq_len)
        cached = self._cache.get(key)
        if cached is None:
            inferred = self._infer(self._bound_model(batch, seq_len))
            types: dict[str, TypeProto] = {}
            collect_types(inferred.graph, types)
            walk = LivenessWalk(types, self._weight_sizes, self._kv_inputs)
            peak = walk.graph_peak(self._template.graph, top=True)
            cached = Activations(peak, tuple(walk.unknown))
            self._cache[key] = cached
        self.unknown_shapes = len(cached.unknown)
        self.unknown_tensors = cached.unknown
        return cached

    def activation_peak(self, batch: int, seq_len: int | None = None) -> int:
        """Peak bytes of live activations (inputs, intermediates, outputs) for one batch,
        without calibration. Sets unknown_shapes / unknown_tensors for this (batch, seq_len)."""
        _check_positive("batch", batch)
        if seq_len is not None:
            _check_positive("seq_len", seq_len)
        elif self._sequence_axes or self._kv_inputs:
            raise ValueError(
                "seq_len is required: this model has sequence axes or past_key_values inputs"
            )
        return self._activations(batch, seq_len).peak

    def estimate(self, batch: int, seq_len: int | None = None) -> Footprint:
        """Footprint of one batch; activations scaled by the calibration for seq_len. Cached
        per (batch, seq_len) (calibration is applied after the cache, so changing it is free)."""
        peak = self.activation_peak(batch, seq_len)
        kv = self.kv_bytes(batch, seq_len) if seq_len is not None else 0
        return Footprint(
            weights=self._weights,
            activations=math.ceil(peak * self.calibration_for(seq_len)),
            kv_cache=kv,
            unknown_shapes=self.unknown_shapes,
        )


def _checked_factor(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"calibration must be a finite number > 0, got {value!r}")
    return float(value)


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
