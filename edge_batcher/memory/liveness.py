"""Peak activation memory of an ONNX graph by tensor liveness, and the graph helpers it needs.

Summing every tensor overestimates the peak 15-80x, so LivenessWalk steps through the nodes of a
shape-inferred graph in topological order keeping the set of live tensors: graph inputs are live
for the whole run (the caller owns them); a node's outputs become live when it runs, while its
inputs still are (plus its subgraphs' own peaks); an intermediate dies after its last reader;
graph outputs stay live to the end; weights and past_key_values inputs are counted elsewhere
(estimator.py). Shapes that inference could not settle are guessed and reported. docs/memory.md
("The estimator") explains the method and its accuracy.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import onnx
from onnx import GraphProto, NodeProto, TensorProto, TypeProto, helper

from ..errors import ConfigError

# Sub-byte element types are packed; numpy reports them as 1 byte.
_PACKED_BITS: dict[int, int] = {
    code: bits
    for name, bits in (("UINT4", 4), ("INT4", 4), ("FLOAT4E2M1", 4), ("UINT2", 2), ("INT2", 2))
    if (code := getattr(TensorProto, name, None)) is not None
}


def tensor_nbytes(elem_type: int, dims: list[int] | tuple[int, ...]) -> int:
    """Bytes of a dense tensor; sub-byte types rounded up to whole bytes."""
    numel = math.prod(dims)
    if elem_type in _PACKED_BITS:
        return (numel * _PACKED_BITS[elem_type] + 7) // 8
    if elem_type == TensorProto.STRING:
        return numel * 8  # pointers only; string payloads are not knowable from the shape
    return numel * helper.tensor_dtype_to_np_dtype(elem_type).itemsize


def tensor_proto_nbytes(t: TensorProto) -> int:
    if t.data_type == TensorProto.STRING:
        return sum(len(s) for s in t.string_data)
    return tensor_nbytes(t.data_type, list(t.dims))


def constant_nbytes(node: NodeProto) -> int:
    """Bytes of a Constant node's value, whichever attribute holds it."""
    total = 0
    for a in node.attribute:
        if a.name == "value":
            total += tensor_proto_nbytes(a.t)
        elif a.name == "sparse_value":
            total += tensor_proto_nbytes(a.sparse_tensor.values)
            total += tensor_proto_nbytes(a.sparse_tensor.indices)
        elif a.name == "value_float":
            total += 4
        elif a.name == "value_floats":
            total += 4 * len(a.floats)
        elif a.name == "value_int":
            total += 8
        elif a.name == "value_ints":
            total += 8 * len(a.ints)
        elif a.name == "value_string":
            total += len(a.s)
        elif a.name == "value_strings":
            total += sum(len(s) for s in a.strings)
    return total


def subgraphs(node: NodeProto) -> list[GraphProto]:
    graphs: list[GraphProto] = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            graphs.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            graphs.extend(a.graphs)
    return graphs


def is_constant(node: NodeProto) -> bool:
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx")


def outer_refs(graph: GraphProto) -> set[str]:
    """Names a (sub)graph reads from enclosing scopes: used but not defined inside it."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    used: set[str] = set()
    for node in graph.node:
        used.update(n for n in node.input if n)
        for g in subgraphs(node):
            used |= outer_refs(g)
        defined.update(n for n in node.output if n)
    used.update(o.name for o in graph.output)
    return used - defined


def node_reads(node: NodeProto) -> list[str]:
    """Explicit inputs plus the outer-scope names its subgraphs read (If/Loop/Scan bodies)."""
    names = [n for n in node.input if n]
    for g in subgraphs(node):
        names.extend(sorted(outer_refs(g)))
    return names


def topological_nodes(graph: GraphProto) -> list[NodeProto]:
    """graph.node in an order where every tensor is produced before it is read.

    Valid ONNX is already sorted, so the common case only verifies. Otherwise Kahn's
    algorithm, preferring the original order among ready nodes. Names produced by no node in
    this graph (inputs, initializers, outer scope) are available from the start.
    """
    nodes = list(graph.node)
    producer: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for name in node.output:
            if name:
                producer[name] = i
    reads = [[n for n in node_reads(node) if n in producer] for node in nodes]

    produced: set[str] = set()
    in_order = True
    for i, node in enumerate(nodes):
        if any(n not in produced for n in reads[i]):
            in_order = False
            break
        produced.update(n for n in node.output if n)
    if in_order:
        return nodes

    waiting = [len({producer[n] for n in r}) for r in reads]
    consumers: dict[int, set[int]] = {i: set() for i in range(len(nodes))}
    for i, r in enumerate(reads):
        for n in r:
            consumers[producer[n]].add(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for c in consumers[i]:
            waiting[c] -= 1
            if waiting[c] == 0:
                heapq.heappush(ready, c)
    if len(order) != len(nodes):
        raise ConfigError(f"graph {graph.name!r} has a cycle; it is not a valid ONNX model")
    return [nodes[i] for i in order]


def collect_types(graph: GraphProto, types: dict[str, TypeProto]) -> None:
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        if vi.HasField("type"):
            types[vi.name] = vi.type
    for node in graph.node:
        for g in subgraphs(node):
            collect_types(g, types)


def known_dims(t: TypeProto) -> tuple[int, list[int]] | None:
    """(elem_type, dims) when t is a tensor of fully known shape, else None."""
    if t.WhichOneof("value") != "tensor_type":
        return None
    tt = t.tensor_type
    if not tt.elem_type or not tt.HasField("shape"):
        return None
    dims: list[int] = []
    for d in tt.shape.dim:
        if not d.HasField("dim_value") or d.dim_value < 0:
            return None
        dims.append(d.dim_value)
    return tt.elem_type, dims


@dataclass
class Activations:
    peak: int
    unknown: tuple[str, ...]


class LivenessWalk:
    """One liveness walk over an inferred model; holds the per-tensor sizes it has settled."""

    def __init__(
        self, types: dict[str, TypeProto], weight_sizes: dict[str, int], skip_inputs: set[str]
    ):
        self.types = types
        self.weight_sizes = weight_sizes
        self.skip_inputs = skip_inputs
        self.sizes: dict[str, int] = dict(weight_sizes)
        self.unknown: list[str] = []

    def _input_size(self, name: str) -> int:
        """A graph input; dims inference could not resolve (a symbolic dim nobody bound)
        count as 1, a lower bound, and the tensor is reported as unknown."""
        t = self.types.get(name)
        known = known_dims(t) if t is not None else None
        if known is not None:
            size = tensor_nbytes(*known)
        else:
            self.unknown.append(name)
            size = 0
            if t is not None and t.WhichOneof("value") == "tensor_type" and t.tensor_type.elem_type:
                dims = [
                    d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else 1
                    for d in t.tensor_type.shape.dim
                ]
                size = tensor_nbytes(t.tensor_type.elem_type, dims)
        self.sizes[name] = size
        return size

    def _output_size(self, name: str, node: NodeProto) -> int:
        """A node output. When shape inference could not say (custom ops, data-dependent
        shapes, sequences), assume it is as large as the node's largest input (weights
        included): exact for elementwise ops, an over-estimate for most reductions, gathers
        and slices. Expand/Tile/ConstantOfShape-like ops can exceed it, which is why the
        count of such guesses is reported."""
        t = self.types.get(name)
        known = known_dims(t) if t is not None else None
        if known is not None:
            size = tensor_nbytes(*known)
        else:
            self.unknown.append(name)
            size = max((self.sizes.get(n, 0) for n in node.input if n), default=0)
        self.sizes[name] = size
        return size

    def graph_peak(self, graph: GraphProto, *, top: bool) -> int:
        """Peak live bytes of one graph. Tensors read from outer scopes are the caller's."""
        nodes = topological_nodes(graph)
        last_read: dict[str, int] = {}
        for i, node in enumerate(nodes):
            for name in node_reads(node):
                last_read[name] = i
        held = {o.name for o in graph.output}

        live: dict[str, int] = {}
        for inp in graph.input:
            if inp.name in self.weight_sizes or (top and inp.name in self.skip_inputs):
                continue
            live[inp.name] = self._input_size(inp.name)
            held.add(inp.name)  # graph inputs are owned by the caller for the whole run
        current = sum(live.values())
        peak = current

        for i, node in enumerate(nodes):
            if is_constant(node):
                continue
            outputs = {
                o: self._output_size(o, node)
                for o in node.output
                if o and o not in self.weight_sizes
            }
            # Subgraphs (If branches, Loop/Scan bodies) are charged as if all of them ran at
            # once, on top of everything live: conservative, and rare in batched models.
            inner = sum(self.graph_peak(g, top=False) for g in subgraphs(node))
            during = current + sum(outputs.values()) + inner
            peak = max(peak, during)

            live.update(outputs)
            current += sum(outputs.values())
            for name in set(node_reads(node)) | set(outputs):
                if name in live and name not in held and last_read.get(name, i) <= i:
                    current -= live.pop(name)
        return peak
