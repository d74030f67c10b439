"""FP32 ONNX model -> FP16 compute with FP32 inputs and outputs, for TensorRT's strongly typed builds.

TensorRT 11 removed the builder's precision flags (BuilderFlag.FP16 and friends): a network is
strongly typed, so it runs in the precision its ONNX model states. `build-engine --fp16` on such
a TensorRT therefore converts the model first, the way NVIDIA's migration guide describes (their
tool for it is ModelOpt AutoCast): FP32 initializers and constants become FP16, every FP32 tensor
inside the graph becomes FP16, and Cast nodes at the graph's FP32 inputs and outputs keep the I/O
FP32, so the served model's interface (and the clients) do not change.

This converter is deliberately whole-graph and simple: it does not keep numerically sensitive
operators in FP32 the way AutoCast can, and it refuses models it cannot convert safely (control
flow subgraphs, operators that only take FP32 for some input) with a message naming AutoCast.
Only the onnx package is needed; nothing here imports TensorRT.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ConfigError

FP16_MAX = float(np.finfo(np.float16).max)

# Operators with an input that ONNX only defines for float32 (or that TensorRT's parser reads as
# FP32 shape data): converting their inputs would make the model invalid.
_FP32_ONLY_INPUTS = {"Resize", "Upsample", "RandomNormal", "RandomUniform", "RandomNormalLike",
                     "RandomUniformLike", "Multinomial", "TfIdfVectorizer"}

AUTOCAST_HINT = (
    "convert the model yourself with NVIDIA ModelOpt AutoCast "
    "(pip install nvidia-modelopt; python -m modelopt.onnx.autocast --onnx_path {onnx} "
    "--output_path {fp16} --keep_io_types) and build from that model without --fp16"
)


def autocast_hint(onnx_path: Path) -> str:
    return AUTOCAST_HINT.format(onnx=onnx_path, fp16=onnx_path.with_name(onnx_path.stem + ".fp16.onnx"))


def has_fp16_compute(model) -> bool:
    """True when the model already holds FP16 weights (e.g. converted by AutoCast)."""
    from onnx import TensorProto  # noqa: PLC0415

    return any(i.data_type == TensorProto.FLOAT16 for i in model.graph.initializer)


def convert_to_fp16(source: Path, target: Path) -> dict[str, int]:
    """Write `source` converted to FP16 compute (FP32 I/O kept) to `target`; what changed, counted.

    Raises ConfigError, naming what blocked it and how to convert with AutoCast instead.
    """
    import onnx  # noqa: PLC0415 - only the builder needs it
    from onnx import TensorProto, helper, numpy_helper  # noqa: PLC0415

    try:
        model = onnx.load(str(source))
    except Exception as exc:  # onnx raises DecodeError and friends
        raise ConfigError(f"{source}: not a readable ONNX model: {exc}") from exc
    graph = model.graph

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"--fp16 on a strongly typed TensorRT: cannot convert {source} to FP16 automatically: "
                           f"{why}; {autocast_hint(source)}")

    if has_fp16_compute(model):
        raise refuse("it already has FP16 initializers (build it without --fp16: its types are used as they are)")
    blocked = sorted({n.op_type for n in graph.node if n.op_type in _FP32_ONLY_INPUTS})
    if blocked:
        raise refuse(f"operator(s) {', '.join(blocked)} take FP32-only inputs")
    for node in graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise refuse(f"node {node.name or node.op_type!r} has a control-flow subgraph")

    counts = {"initializers": 0, "constants": 0, "casts": 0, "io_casts": 0}

    def to_fp16(tensor) -> None:
        array = numpy_helper.to_array(tensor)
        if np.isfinite(array).all() and np.abs(array).max(initial=0.0) > FP16_MAX:
            raise refuse(f"tensor {tensor.name!r} holds values beyond FP16's range (+-{FP16_MAX:g})")
        tensor.CopyFrom(numpy_helper.from_array(array.astype(np.float16), tensor.name))

    for init in graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            to_fp16(init)
            counts["initializers"] += 1
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                to_fp16(attr.t)
                counts["constants"] += 1
            elif node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.FLOAT16
                counts["casts"] += 1

    # FP32 graph inputs: a Cast to FP16 right after each, and every consumer reads the cast.
    inits = {i.name for i in graph.initializer}
    head, renames = [], {}
    for value in graph.input:
        if value.name in inits or value.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        renames[value.name] = f"{value.name}__fp16"
        head.append(helper.make_node("Cast", [value.name], [renames[value.name]], to=TensorProto.FLOAT16,
                                     name=f"{value.name}__cast_to_fp16"))
    for node in graph.node:
        node.input[:] = [renames.get(name, name) for name in node.input]
    # FP32 graph outputs: the producer writes an FP16 tensor, a Cast at the end restores FP32.
    tail = []
    for value in graph.output:
        if value.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        inner = f"{value.name}__fp16"
        for node in graph.node:
            node.output[:] = [inner if name == value.name else name for name in node.output]
            node.input[:] = [inner if name == value.name else name for name in node.input]
        tail.append(helper.make_node("Cast", [inner], [value.name], to=TensorProto.FLOAT,
                                     name=f"{value.name}__cast_to_fp32"))
    nodes = head + list(graph.node) + tail
    del graph.node[:]
    graph.node.extend(nodes)
    counts["io_casts"] = len(head) + len(tail)
    # Intermediate types were FP32; let shape inference state them again.
    del graph.value_info[:]
    try:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        onnx.checker.check_model(model)
    except Exception as exc:  # onnx raises InferenceError, ValidationError
        raise refuse(f"the converted model does not type-check ({exc})") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(target))
    return counts
